"""A first job with Flask and Flask-SQLAlchemy: the order and its job commit in the
request's transaction; ``flask queue worker`` runs the jobs.

    python examples/docs/flask_app.py        # DATABASE_URL, or an embedded server
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sqlalchemy import select

from _db import database_url

# isort: split
# --8<-- [start:app]
import os

from flask import Blueprint, Flask
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import ForeignKey
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from sqla_queue import JobMixin
from sqla_queue.flask import FlaskQueue


class Base(DeclarativeBase):
    pass


class ShopOrder(Base):
    __tablename__ = "shop_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str]
    confirmed: Mapped[bool] = mapped_column(default=False)


class ConfirmationEmail(Base, JobMixin):
    __tablename__ = "confirmation_emails"
    order_id: Mapped[int] = mapped_column(ForeignKey(ShopOrder.id))
    to: Mapped[str]


def send_confirmation(job: ConfirmationEmail, session: Session) -> None:
    order = session.get(ShopOrder, job.order_id)  # session is db.session, in an app context
    assert order is not None
    order.confirmed = True  # commits with the job's completion, exactly once


db = SQLAlchemy(model_class=Base)
queue = FlaskQueue()
shop = Blueprint("shop", __name__)


@shop.post("/orders")
def place_order() -> tuple[dict[str, int], int]:
    order = ShopOrder(email="ada@example.com")
    db.session.add(order)
    db.session.flush()
    queue.enqueue(ConfirmationEmail(order_id=order.id, to=order.email), max_attempts=3)
    db.session.commit()  # the order and its e-mail, or neither
    return {"order_id": order.id}, 201


def create_app(url: str | None = None) -> Flask:  # `flask --app` calls it without arguments
    app = Flask(__name__)
    # "postgresql+psycopg://shop@localhost/shop": psycopg 3
    app.config["SQLALCHEMY_DATABASE_URI"] = url or os.environ["DATABASE_URL"]
    db.init_app(app)
    queue.init_app(app, db)  # adds `flask queue worker|sweep|stats|requeue|prune`
    queue.add_worker(ConfirmationEmail, send_confirmation, concurrency=4)
    app.register_blueprint(shop)
    return app
# --8<-- [end:app]


def tour(url: str) -> None:
    app = create_app(url)
    with app.app_context():
        db.create_all()  # a real app migrates (see Alembic)
    try:
        response = app.test_client().post("/orders")
        assert response.status_code == 201, response.text
        # The command the page shows, as a user runs it (this module is `yourapp`).
        result = subprocess.run(
            [sys.executable, "-m", "flask", "--app", "flask_app", "queue", "worker", "--until-idle",
             "--log-level", "WARNING"],
            cwd=Path(__file__).parent, env={**os.environ, "DATABASE_URL": url},
            capture_output=True, text=True, timeout=60, check=False,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        with app.app_context():
            confirmed = db.session.scalar(select(ShopOrder.confirmed))
            status = db.session.scalar(select(ConfirmationEmail.status))
        print(f"order confirmed: {confirmed}; job {status}")
        assert confirmed and status == "done"
    finally:
        with app.app_context():
            db.drop_all()
            db.engine.dispose()


if __name__ == "__main__":
    with database_url() as url:
        tour(url)
