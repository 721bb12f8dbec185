"""A Flask shop whose order confirmations go through sqla_queue.

Placing an order writes the order, takes it from stock and enqueues its confirmation
e-mail in one transaction: an order that fails (out of stock) leaves neither an order nor
an e-mail behind. A worker "sends" the e-mails by writing them to an outbox folder; mail
to an undeliverable domain is retried with backoff and ends in the dead letter.

    python examples/flask_shop.py             # a scripted tour (embedded PostgreSQL if
                                              # DATABASE_URL is unset)
    flask --app examples/flask_shop.py queue worker   # the worker, as you would run it
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from flask import Flask, abort, jsonify, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import ForeignKey, String
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from sqla_queue import Backoff, JobMixin
from sqla_queue.flask import FlaskQueue
from sqla_queue.urls import psycopg_url


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)
queue = FlaskQueue()


class Product(db.Model):  # type: ignore[name-defined, misc]
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100))
    stock: Mapped[int]


class ShopOrder(db.Model):  # type: ignore[name-defined, misc]
    id: Mapped[int] = mapped_column(primary_key=True)
    product_id: Mapped[int] = mapped_column(ForeignKey(Product.id))
    quantity: Mapped[int]
    email: Mapped[str] = mapped_column(String(200))
    confirmed: Mapped[bool] = mapped_column(default=False)


class ConfirmationEmail(db.Model, JobMixin):  # type: ignore[name-defined, misc]
    """The queue table: the shop's own model, with a foreign key to the order."""

    order_id: Mapped[int] = mapped_column(ForeignKey(ShopOrder.id))
    to: Mapped[str] = mapped_column(String(200))


class OutOfStock(Exception):
    pass


class Undeliverable(Exception):
    pass


def send_confirmation(job: ConfirmationEmail, session: Session) -> None:
    """Transactional: the order is marked confirmed in the job's own transaction.

    The file write is an outside effect and may happen twice if a worker dies at the
    wrong moment; naming the file after the order makes a second write harmless.
    """
    if job.to.endswith("@undeliverable.example"):
        raise Undeliverable(f"mail server refused {job.to}")
    order = session.get(ShopOrder, job.order_id)
    assert order is not None
    outbox = Path(os.environ.get("SHOP_OUTBOX", tempfile.gettempdir())) / f"order-{order.id}.eml"
    outbox.write_text(f"To: {job.to}\nSubject: order {order.id} confirmed\n\n{order.quantity} item(s)\n")
    order.confirmed = True


def create_app(database_url: str | None = None) -> Flask:
    app = Flask(__name__)
    url = database_url or os.environ.get("DATABASE_URL")
    if not url:
        raise RuntimeError("set DATABASE_URL (or run this file directly for an embedded database)")
    app.config["SQLALCHEMY_DATABASE_URI"] = psycopg_url(url).render_as_string(hide_password=False)
    db.init_app(app)
    queue.init_app(app, db)
    if "confirmation_email" not in queue.worker_names:
        queue.add_worker(
            ConfirmationEmail,
            send_confirmation,
            concurrency=2,
            poll_interval=0.5,
            backoff=Backoff(base=0.1, cap=1.0),
        )

    @app.post("/orders")
    def place_order() -> Any:
        data = request.get_json(force=True)
        # The product is locked first: inserting the order takes a key-share lock on it (the
        # foreign key), and two orders upgrading theirs to FOR UPDATE would deadlock.
        db.session.get(Product, data["product_id"], with_for_update=True)
        order = ShopOrder(product_id=data["product_id"], quantity=data["quantity"], email=data["email"])
        db.session.add(order)
        db.session.flush()
        queue.enqueue(ConfirmationEmail(order_id=order.id, to=order.email), max_attempts=3)
        try:
            take_from_stock(order)
        except OutOfStock as exc:
            db.session.rollback()  # the order and its e-mail job go together
            abort(409, str(exc))
        db.session.commit()
        return jsonify(order_id=order.id), 201

    @app.get("/orders/<int:order_id>")
    def show_order(order_id: int) -> Any:
        order = db.get_or_404(ShopOrder, order_id)
        return jsonify(order_id=order.id, confirmed=order.confirmed)

    return app


def take_from_stock(order: ShopOrder) -> None:
    product = db.session.get(Product, order.product_id, with_for_update=True)
    if product is None or product.stock < order.quantity:
        raise OutOfStock(f"only {product.stock if product else 0} left")
    product.stock -= order.quantity


def tour(database_url: str) -> None:
    """Place a few orders through the HTTP API, run the worker, show what happened."""
    with tempfile.TemporaryDirectory(prefix="shop_outbox_") as outbox_dir:  # removed afterwards
        outbox = Path(outbox_dir)
        os.environ["SHOP_OUTBOX"] = str(outbox)
        app = create_app(database_url)
        with app.app_context():
            db.create_all()
            try:
                db.session.add(Product(id=1, name="teapot", stock=5))
                db.session.commit()
                client = app.test_client()
                for email, quantity in [("ada@example.com", 2), ("bob@example.com", 2),
                                        ("eve@undeliverable.example", 1), ("cy@example.com", 3)]:
                    response = client.post("/orders", json={"product_id": 1, "quantity": quantity, "email": email})
                    print(f"order by {email:<28} x{quantity}: HTTP {response.status_code}")
                queue.make_worker().run(install_signal_handlers=False, until_idle=True)
                jobs = db.session.scalars(db.select(ConfirmationEmail).order_by(ConfirmationEmail.id)).all()
                for job in jobs:
                    print(f"e-mail to {job.to:<28} {job.status:<7} after {job.attempts} attempt(s)"
                          + (f"  last error: {job.last_error.splitlines()[0]}" if job.status == "failed" else ""))
                print(f"outbox: {sorted(p.name for p in outbox.iterdir())}")
            finally:
                db.session.close()
                db.drop_all()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if os.environ.get("DATABASE_URL"):
        tour(os.environ["DATABASE_URL"])
    else:
        from sqla_queue.embedded import EmbeddedPostgres

        with EmbeddedPostgres() as pg:
            tour(pg.url.render_as_string(hide_password=False))
