"""The SQLModel guide's snippets, run: a SQLModel queue table, a FastAPI app with an
AsyncWorker in its lifespan, ``enqueue_many`` and ``enqueue_values``, the thread Worker,
and Alembic autogenerate of the same models (run it on an empty database).

    python examples/docs/sqlmodel_guide.py   # DATABASE_URL, or an embedded server
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from sqlalchemy import Engine, create_engine, func

from _db import database_url

# isort: split
# --8<-- [start:models]
from sqlmodel import Field, SQLModel

from sqla_queue.sqlmodel import JobModel


class Order(SQLModel, table=True):
    __tablename__ = "orders"
    id: int | None = Field(default=None, primary_key=True)
    customer: str = Field(max_length=100)
    confirmed: bool = False


class ConfirmationEmail(JobModel, table=True):  # the queue table
    __tablename__ = "confirmation_emails"
    order_id: int = Field(foreign_key="orders.id")
    to: str = Field(max_length=200)
# --8<-- [end:models]


# --8<-- [start:app]
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from sqla_queue import AsyncWorker
from sqla_queue.sqlmodel import AsyncQueueSession


async def send_confirmation(job: ConfirmationEmail, session: AsyncQueueSession) -> None:
    order = await session.get(Order, job.order_id)  # the handler's session is SQLModel's too
    assert order is not None
    print(f"mail to {job.to} about order {order.id}")  # an async mail client here
    order.confirmed = True  # commits with the job's completion, once


def create_app(url: str) -> FastAPI:
    engine = create_async_engine(url)  # postgresql+psycopg://...: psycopg 3
    Session = async_sessionmaker(engine, class_=AsyncQueueSession, expire_on_commit=False)
    worker = AsyncWorker(engine, ConfirmationEmail, send_confirmation, session_factory=Session)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await worker.start()  # WorkerStartError now, before the app serves a request
        yield
        await worker.stop()  # running jobs get shutdown_grace, then go back to pending
        await engine.dispose()

    app = FastAPI(lifespan=lifespan)

    @app.post("/orders", status_code=201)
    async def place_order(customer: str) -> dict[str, int]:
        async with Session() as session:
            order = Order(customer=customer)
            session.add(order)
            await session.flush()
            assert order.id is not None
            session.enqueue(ConfirmationEmail(order_id=order.id, to=f"{customer}@example.com"))
            await session.commit()  # the order, its job and the worker's wake-up, or none
        return {"order_id": order.id}

    return app
# --8<-- [end:app]


def wait_until_done(engine: Engine) -> None:
    from sqlmodel import Session, select

    deadline = time.monotonic() + 30
    with Session(engine) as session:
        while session.exec(select(func.count()).where(ConfirmationEmail.status != "done")).one():
            if time.monotonic() > deadline:
                raise RuntimeError("jobs not done in time")
            session.rollback()  # a fresh snapshot for the next look
            time.sleep(0.05)


async def over_http(url: str, customers: list[str]) -> None:
    app = create_app(url)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client,
    ):
        for customer in customers:
            response = await client.post("/orders", params={"customer": customer})
            assert response.status_code == 201, response.text
        await asyncio.to_thread(wait_until_done, create_engine(url))


def bulk_and_thread_worker(engine: Engine) -> None:
    # --8<-- [start:bulk]
    from sqlmodel import select

    from sqla_queue import enqueue_values
    from sqla_queue.sqlmodel import QueueSession

    with QueueSession(engine) as session:
        orders = session.exec(select(Order)).all()
        rows = [ConfirmationEmail(order_id=order.id, to=f"{order.customer}@example.com")
                for order in orders if order.id is not None]
        session.enqueue_many(ConfirmationEmail, rows, queue="reminders")  # COPY, for many rows
        enqueue_values(session, ConfirmationEmail, {"order_id": rows[0].order_id, "to": "ops@example.com"})
        session.commit()
    # --8<-- [end:bulk]
        queues = session.exec(select(ConfirmationEmail.queue, func.count()).group_by(ConfirmationEmail.queue)).all()
        assert sorted(queues) == [("default", 3), ("reminders", 2)], queues
    # --8<-- [start:thread-worker]
    from sqlalchemy.orm import sessionmaker

    from sqla_queue import Worker

    def remind(job: ConfirmationEmail, session: QueueSession) -> None:
        order = session.get(Order, job.order_id)
        assert order is not None
        print(f"reminder to {job.to} about order {order.id}")

    worker = Worker(engine, ConfirmationEmail, remind, session_factory=sessionmaker(engine, class_=QueueSession))
    worker.run(until_idle=True)  # or worker.start() / worker.stop(), or `sqla-queue worker`
    # --8<-- [end:thread-worker]
    assert worker.stats.done == 3, worker.stats


#: The lines that replace ``target_metadata = None`` in ``migrations/env.py``.
ENV_PY = """
# --8<-- [start:alembic-env]
import models  # noqa: F401  (defines the tables)
from sqlmodel import SQLModel
target_metadata = SQLModel.metadata
# --8<-- [end:alembic-env]
"""
#: ``migrations/script.py.mako``: SQLModel's str fields need ``import sqlmodel``.
MAKO = """
# --8<-- [start:alembic-mako]
import sqlalchemy as sa
import sqlmodel
# --8<-- [end:alembic-mako]
"""


def lines(section: str) -> str:
    return "".join(line + "\n" for line in section.strip().splitlines() if "--8<--" not in line)


def alembic(url: str) -> None:
    """``sqla-queue alembic init``, the guide's two edits, autogenerate twice."""
    folder = Path(tempfile.mkdtemp(prefix="sqla_queue_docs_sqlmodel_"))
    bin_dir = Path(sys.executable).parent

    def run(*command: str | Path) -> str:
        done = subprocess.run([str(c) for c in command], cwd=folder, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout + done.stderr

    try:
        run(bin_dir / "sqla-queue", "alembic", "init", "migrations")
        ini = folder / "alembic.ini"
        ini.write_text(
            "\n".join(
                f"sqlalchemy.url = {url.replace('%', '%%')}" if line.startswith("sqlalchemy.url =") else line
                for line in ini.read_text().splitlines()
            )
        )
        env = folder / "migrations" / "env.py"
        assert "\ntarget_metadata = None\n" in env.read_text()
        env.write_text(env.read_text().replace("\ntarget_metadata = None\n", "\n" + lines(ENV_PY)))
        mako = folder / "migrations" / "script.py.mako"
        mako.write_text(mako.read_text().replace("\nimport sqlalchemy as sa\n", "\n" + lines(MAKO)))
        here = Path(__file__).resolve().parent
        (folder / "models.py").write_text(
            f"import sys\nsys.path.insert(0, {str(here)!r})\nfrom sqlmodel_guide import ConfirmationEmail, Order\n"
        )
        alembic_cmd = bin_dir / "alembic"
        run(alembic_cmd, "revision", "--autogenerate", "-m", "orders and emails")
        (migration,) = (folder / "migrations" / "versions").glob("*.py")
        body = migration.read_text()
        for expected in ("create_table('confirmation_emails'", "op.f('confirmation_emails_status_check')",
                         "op.f('confirmation_emails_claim_idx')", "sqlmodel.sql.sqltypes.AutoString"):
            assert expected in body, expected
        run(alembic_cmd, "upgrade", "head")
        run(alembic_cmd, "revision", "--autogenerate", "-m", "nothing")
        second = max((folder / "migrations" / "versions").glob("*.py"), key=lambda p: p.stat().st_mtime_ns)
        upgrade = second.read_text().split("def upgrade()")[1].split("def downgrade()")[0]
        code = [line.strip() for line in upgrade.splitlines()[2:]]
        assert [line for line in code if line and not line.startswith("#")] == ["pass"], upgrade
        run(alembic_cmd, "upgrade", "head")
        run(alembic_cmd, "downgrade", "base")
        print(f"{migration.name}: the queue table, its CHECK and partial indexes; a second autogenerate: empty")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def tour(url: str) -> None:
    engine = create_engine(url)
    SQLModel.metadata.create_all(engine)
    try:
        asyncio.run(over_http(url, ["ada", "bob"]))
        from sqlmodel import Session, col, select

        with Session(engine) as session:
            confirmed = session.exec(select(func.count()).where(col(Order.confirmed))).one()
        assert confirmed == 2, confirmed
        print("2 orders placed over HTTP, each confirmed once by the AsyncWorker in the lifespan")
        bulk_and_thread_worker(engine)
        print("2 reminders by enqueue_many and 1 by enqueue_values, run by the thread Worker")
    finally:
        SQLModel.metadata.drop_all(engine)
        engine.dispose()
    alembic(url)


if __name__ == "__main__":
    with database_url() as url:
        tour(url)
