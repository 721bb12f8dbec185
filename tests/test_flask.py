"""Flask-SQLAlchemy integration, through the example shop: a real app, real PostgreSQL."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from .helpers import SENTINEL_CHANNEL, Server, notifications_until_sentinel

pytest.importorskip("flask_sqlalchemy")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "flask_shop.py"


def _load_shop() -> Any:
    spec = importlib.util.spec_from_file_location("flask_shop", EXAMPLE)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["flask_shop"] = module
    spec.loader.exec_module(module)
    return module


shop = _load_shop()


@pytest.fixture
def app(server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("SHOP_OUTBOX", str(tmp_path))
    app = shop.create_app(server.url.render_as_string(hide_password=False))
    with app.app_context():
        shop.db.create_all()
        shop.db.session.add(shop.Product(id=1, name="teapot", stock=3))
        shop.db.session.commit()
    yield app
    with app.app_context():
        shop.db.session.close()
        shop.db.drop_all()
        shop.db.engine.dispose()


def counts(app: Any) -> tuple[int, int]:
    with app.app_context():
        orders = shop.db.session.scalar(select(func.count()).select_from(shop.ShopOrder))
        jobs = shop.db.session.scalar(select(func.count()).select_from(shop.ConfirmationEmail))
        return orders, jobs


def test_order_and_its_email_job_commit_together(app: Any, listener: Any, server: Server) -> None:
    from sqla_queue import queue_table

    channel = queue_table(shop.ConfirmationEmail).channel
    listener.execute(f'LISTEN "{channel}"')
    listener.execute(f'LISTEN "{SENTINEL_CHANNEL}"')
    response = app.test_client().post("/orders", json={"product_id": 1, "quantity": 2, "email": "a@example.com"})
    assert response.status_code == 201
    assert counts(app) == (1, 1)
    assert notifications_until_sentinel(listener, server.conninfo) == [(channel, "default")]


def test_failure_after_enqueue_rolls_back_both(app: Any, listener: Any, server: Server) -> None:
    from sqla_queue import queue_table

    listener.execute(f'LISTEN "{queue_table(shop.ConfirmationEmail).channel}"')
    listener.execute(f'LISTEN "{SENTINEL_CHANNEL}"')
    response = app.test_client().post("/orders", json={"product_id": 1, "quantity": 5, "email": "a@example.com"})
    assert response.status_code == 409  # out of stock, raised after the job was enqueued
    assert counts(app) == (0, 0)
    assert notifications_until_sentinel(listener, server.conninfo) == []


def test_db_session_enqueue_is_the_current_session(app: Any) -> None:
    with app.app_context():
        order = shop.ShopOrder(product_id=1, quantity=1, email="x@example.com")
        shop.db.session.add(order)
        shop.db.session.flush()
        job = shop.db.session.enqueue(shop.ConfirmationEmail(order_id=order.id, to=order.email), priority=3)
        assert job in shop.db.session() and job.priority == 3
        rows = [{"order_id": order.id, "to": f"bulk{i}@example.com"} for i in range(3)]
        assert shop.db.session.enqueue_many(shop.ConfirmationEmail, rows, queue="bulk") == 3
        shop.db.session.flush()
        assert counts(app) == (0, 0)  # another session sees nothing uncommitted
        shop.db.session.rollback()
    assert counts(app) == (0, 0)


def test_flask_queue_commands(app: Any, tmp_path: Path) -> None:
    client = app.test_client()
    for email in ("a@example.com", "b@undeliverable.example"):
        assert client.post("/orders", json={"product_id": 1, "quantity": 1, "email": email}).status_code == 201
    runner = app.test_cli_runner()

    stats = runner.invoke(args=["queue", "stats"])
    assert stats.exit_code == 0, stats.output
    assert stats.output.splitlines()[2].split()[:3] == ["default", "pending", "2"]

    worker = runner.invoke(args=["queue", "worker", "--until-idle", "--concurrency", "1"])
    assert worker.exit_code == 0, worker.output
    with app.app_context():
        jobs = {j.to: j for j in shop.db.session.scalars(select(shop.ConfirmationEmail))}
        assert jobs["a@example.com"].status == "done"
        assert jobs["b@undeliverable.example"].status == "failed"
        assert jobs["b@undeliverable.example"].attempts == 3
        confirmed = shop.db.session.scalars(select(shop.ShopOrder.confirmed).order_by(shop.ShopOrder.id)).all()
        assert confirmed == [True, False]  # the handler's write committed with its completion
    # the handler ran in its thread inside an app context: it used db.session and current_app
    assert (tmp_path / "order-1.eml").read_text().startswith("To: a@example.com")

    requeue = runner.invoke(args=["queue", "requeue", "confirmation_email"])
    assert requeue.exit_code == 0 and "requeued 1" in requeue.output
    assert runner.invoke(args=["queue", "sweep"]).output.startswith("swept 0 expired")
    unknown = runner.invoke(args=["queue", "stats", "nope"])
    assert unknown.exit_code != 0 and "no worker named 'nope'" in unknown.output
    bad = runner.invoke(args=["queue", "worker", "--lease", "soon"])
    assert bad.exit_code != 0 and "not a duration" in bad.output
