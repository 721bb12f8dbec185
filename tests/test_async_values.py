"""``await enqueue_values(…)`` from asyncio: the fast path's row, checks and wake-up, in the
caller's ``AsyncSession`` or ``AsyncConnection`` transaction.

Each test runs its coroutine with ``asyncio.run`` on an async engine of its own (engines
belong to one event loop), through psycopg 3's async driver, against real PostgreSQL.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Awaitable, Callable, Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, func, insert, select, text
from sqlalchemy.exc import DBAPIError, IntegrityError, InvalidRequestError, OperationalError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_scoped_session,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import Session

from sqla_queue import AsyncQueueSession, EnqueueError, enqueue, enqueue_values, queue_table

from .bad_values import COLUMN_SAMPLE, OPTION_SAMPLE, row_values
from .helpers import SENTINEL_CHANNEL, Server, notifications_until_sentinel, table_of, terminate_backend
from .models import EmailJob, EncodedJob, InheritedJob, InheritedJobA, InheritedJobB, Order, RoutedJob, Task

EMAIL_CHANNEL = queue_table(EmailJob).channel
TASK_CHANNEL = queue_table(Task).channel
EMAILS = table_of(EmailJob)
TASKS = table_of(Task)
ORDERS = table_of(Order)
COMPARED = ("queue", "status", "priority", "attempts", "max_attempts", "isolated", "recipient", "order_id")

Body = Callable[[AsyncEngine], Awaitable[Any]]


@pytest.fixture
def run(engine: Engine, server: Server) -> Callable[..., Any]:
    """``run(body, driver=…)``: ``asyncio.run`` of ``body(async_engine)`` on a fresh engine."""

    def runner(body: Body, driver: str = "psycopg") -> Any:
        async def main() -> Any:
            async_engine = create_async_engine(server.url.set(drivername=f"postgresql+{driver}"))
            try:
                return await body(async_engine)
            finally:
                await async_engine.dispose()

        return asyncio.run(main())

    return runner


Run = Callable[..., Any]


@pytest.fixture
def listening(listener: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    for channel in (EMAIL_CHANNEL, TASK_CHANNEL, SENTINEL_CHANNEL):
        listener.execute(f'LISTEN "{channel}"')
    return listener


def rows(engine: Engine, table: Any) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(table).order_by(table.c.id)))


def test_async_session_commits_the_job_with_its_writes_and_notifies_only_then(
    run: Run, engine: Engine, listening: Any, server: Server
) -> None:
    async def body(async_engine: AsyncEngine) -> tuple[Any, Any]:
        async with AsyncSession(async_engine) as session:
            order = Order(customer="ada")
            session.add(order)
            await session.flush()
            first = await enqueue_values(session, EmailJob, {"order_id": order.id, "recipient": "a@example.com"})
            again = await enqueue_values(session, EmailJob, {"order_id": order.id, "recipient": "a@example.com"})
            enqueue(session, EmailJob(order_id=order.id, recipient="a@example.com"))
            await session.flush()
            # Written in the session's transaction: not seen outside it, no wake-up yet.
            assert rows(engine, EMAILS) == [] and rows(engine, ORDERS) == []
            assert notifications_until_sentinel(listening, server.conninfo) == []
            await session.commit()
        return first, again

    first, again = run(body)
    fast, fast_again, orm = rows(engine, EMAILS)
    assert (fast.id, fast_again.id) == (first, again)
    for column in COMPARED:
        assert getattr(fast, column) == getattr(orm, column) == getattr(fast_again, column), column
    assert [o.customer for o in rows(engine, ORDERS)] == ["ada"]
    assert notifications_until_sentinel(listening, server.conninfo) == [(EMAIL_CHANNEL, "default")]


def test_rollback_leaves_no_job_and_no_wake_up(run: Run, engine: Engine, listening: Any, server: Server) -> None:
    async def body(async_engine: AsyncEngine) -> None:
        async with AsyncSession(async_engine) as session:
            session.add(Order(customer="bob"))
            await enqueue_values(session, EmailJob, {"recipient": "bob@example.com"})
            await session.rollback()
        async with async_engine.connect() as conn:
            await enqueue_values(conn, EmailJob, {"recipient": "closed@example.com"})
            # closed without commit(): rolled back, as any statement of the connection

    run(body)
    assert rows(engine, EMAILS) == [] and rows(engine, ORDERS) == []
    assert notifications_until_sentinel(listening, server.conninfo) == []


def test_async_connection_begun(run: Run, engine: Engine, listening: Any, server: Server) -> None:
    async def body(async_engine: AsyncEngine) -> Any:
        async with async_engine.begin() as conn:
            order_id = (await conn.execute(insert(ORDERS).values(customer="core").returning(ORDERS.c.id))).scalar_one()
            job_id = await enqueue_values(conn, Task, {"task": "ship", "payload": {"order": order_id}}, queue="conn")
            assert notifications_until_sentinel(listening, server.conninfo) == []

        async def abandoned() -> None:
            async with async_engine.begin() as conn:
                await enqueue_values(conn, Task, {"task": "lost"}, queue="lost")
                raise RuntimeError("abandon")

        with pytest.raises(RuntimeError, match="abandon"):
            await abandoned()
        return job_id

    job_id = run(body)
    (task,) = rows(engine, TASKS)
    assert (task.id, task.task, task.queue) == (job_id, "ship", "conn")
    assert task.payload == {"order": rows(engine, ORDERS)[0].id}
    assert notifications_until_sentinel(listening, server.conninfo) == [(TASK_CHANNEL, "conn")]


def test_async_connection_not_begun_begins_as_execute_would(
    run: Run, engine: Engine, listening: Any, server: Server
) -> None:
    """Commit as you go: the call begins the transaction that ``commit()`` commits. After
    the pool replaces the connection's DBAPI connection, the next call revalidates it and
    makes a cursor on the new one."""

    async def body(async_engine: AsyncEngine) -> None:
        async with async_engine.connect() as conn:
            assert not conn.in_transaction()
            await enqueue_values(conn, EmailJob, {"recipient": "before@example.com"}, queue="cay")
            assert conn.in_transaction()
            assert rows(engine, EMAILS) == []
            await conn.commit()
            before = conn.sync_connection.connection.driver_connection  # type: ignore[union-attr]
            await conn.invalidate()
            await conn.rollback()
            await enqueue_values(conn, EmailJob, {"recipient": "after@example.com"}, queue="cay")
            await enqueue_values(conn, EmailJob, {"recipient": "after2@example.com"}, queue="cay")
            assert conn.sync_connection.connection.driver_connection is not before  # type: ignore[union-attr]
            await conn.commit()

    run(body)
    assert [r.recipient for r in rows(engine, EMAILS)] == [
        "before@example.com",
        "after@example.com",
        "after2@example.com",
    ]
    assert notifications_until_sentinel(listening, server.conninfo) == [(EMAIL_CHANNEL, "cay")] * 2


def test_async_scoped_session(run: Run, engine: Engine, listening: Any, server: Server) -> None:
    async def body(async_engine: AsyncEngine) -> None:
        scoped = async_scoped_session(
            async_sessionmaker(async_engine, class_=AsyncQueueSession), scopefunc=asyncio.current_task
        )
        try:
            scoped.add(Order(customer="scoped"))
            await enqueue_values(scoped, EmailJob, {"recipient": "s@example.com"}, queue="scoped")
            await scoped.commit()
        finally:
            await scoped.remove()

    run(body)
    assert [(r.recipient, r.queue) for r in rows(engine, EMAILS)] == [("s@example.com", "scoped")]
    assert [o.customer for o in rows(engine, ORDERS)] == ["scoped"]
    assert notifications_until_sentinel(listening, server.conninfo) == [(EMAIL_CHANNEL, "scoped")]


def test_defaults_options_and_delay_as_the_sync_call(run: Run, engine: Engine) -> None:
    at = datetime(2030, 1, 1, tzinfo=UTC)

    async def body(async_engine: AsyncEngine) -> None:
        async with AsyncSession(async_engine) as session:
            await session.execute(text("SELECT pg_sleep(0.3)"))  # the transaction started earlier
            await enqueue_values(
                session, Task, {"task": "resize"}, queue="images", priority=3, max_attempts=2, run_at=at
            )
            await enqueue_values(session, EmailJob, delay=60)
            inserted = await session.scalar(text("SELECT clock_timestamp()"))
            await session.commit()
        (email,) = rows(engine, EMAILS)
        # From the start of the transaction (now()) it would be 0.3 s short of a minute.
        assert timedelta(seconds=59.9) <= email.run_after - inserted <= timedelta(seconds=60)

    run(body)
    (task,) = rows(engine, TASKS)
    assert (task.task, task.payload, task.queue, task.priority, task.max_attempts) == ("resize", {}, "images", 3, 2)
    assert task.run_after == at
    (email,) = rows(engine, EMAILS)
    assert (email.recipient, email.priority, email.isolated) == ("someone@example.com", 0, False)


@pytest.mark.parametrize("kind", ["AsyncSession", "AsyncConnection"])
@pytest.mark.parametrize(("model", "column", "value", "error", "message"), COLUMN_SAMPLE)
def test_bad_values_raise_from_the_await_before_anything_is_written(
    run: Run, engine: Engine, kind: str, model: Any, column: str, value: Any, error: type[Exception], message: str
) -> None:
    async def body(async_engine: AsyncEngine) -> None:
        if kind == "AsyncSession":
            async with AsyncSession(async_engine) as session:
                await _refused(session, model, row_values(model, column, value), {}, error, message)
        else:
            async with async_engine.connect() as conn:
                await _refused(conn, model, row_values(model, column, value), {}, error, message)

    run(body)
    assert [o.customer for o in rows(engine, ORDERS)] == ["kept"]
    assert rows(engine, EMAILS) == [] and rows(engine, TASKS) == []


@pytest.mark.parametrize(("options", "message"), OPTION_SAMPLE)
def test_bad_options_raise_from_the_await(run: Run, engine: Engine, options: dict[str, Any], message: str) -> None:
    async def body(async_engine: AsyncEngine) -> None:
        async with AsyncSession(async_engine) as session:
            await _refused(session, EmailJob, {}, options, EnqueueError, message)

    run(body)
    assert [o.customer for o in rows(engine, ORDERS)] == ["kept"]
    assert rows(engine, EMAILS) == []


async def _refused(
    target: AsyncSession | Any,
    model: Any,
    values: dict[str, Any],
    options: dict[str, Any],
    error: type[Exception],
    message: str,
) -> None:
    """The call is refused by its ``await`` (not before), with no transaction begun for it;
    the caller's transaction then commits its own row, and nothing of the job."""
    pending: Coroutine[Any, Any, Any] = enqueue_values(target, model, values, **options)
    with pytest.raises(error, match=message):
        await pending
    assert not target.in_transaction()
    if isinstance(target, AsyncSession):
        target.add(Order(customer="kept"))
    else:
        await target.execute(insert(ORDERS).values(customer="kept"))
    await target.commit()


@pytest.mark.parametrize("kind", ["AsyncSession", "AsyncConnection"])
@pytest.mark.parametrize(
    ("values", "orig"),
    [
        pytest.param({"order_id": 10**9}, psycopg.errors.ForeignKeyViolation, id="foreign-key"),
        pytest.param({"recipient": ""}, psycopg.errors.CheckViolation, id="check"),
    ],
)
def test_a_statement_the_database_refuses_raises_what_enqueue_raises(
    run: Run, engine: Engine, kind: str, values: dict[str, Any], orig: type[Exception]
) -> None:
    """SQLAlchemy's ``IntegrityError`` (``.orig`` psycopg's), as from ``enqueue()``'s
    flush; the transaction is aborted as by any failed statement, and works again after
    ``rollback()``."""

    async def body(async_engine: AsyncEngine) -> None:
        async with AsyncSession(async_engine) as session:
            enqueue(session, EmailJob(**values))
            with pytest.raises(DBAPIError) as by_enqueue:
                await session.flush()
            await session.rollback()
        async with AsyncSession(async_engine) as session, async_engine.connect() as conn:
            target: Any = session if kind == "AsyncSession" else conn
            await target.execute(insert(ORDERS).values(customer="lost"))
            with pytest.raises(DBAPIError) as by_values:
                await enqueue_values(target, EmailJob, values)
            assert type(by_values.value) is type(by_enqueue.value) is IntegrityError
            assert type(by_values.value.orig) is type(by_enqueue.value.orig) is orig
            with pytest.raises(DBAPIError, match="current transaction is aborted"):
                await target.execute(select(1))
            await target.rollback()
            await enqueue_values(target, EmailJob, {"recipient": "next@example.com"})
            await target.commit()

    run(body)
    assert rows(engine, ORDERS) == []
    assert [r.recipient for r in rows(engine, EMAILS)] == ["next@example.com"]


@pytest.mark.parametrize("kind", ["AsyncSession", "AsyncConnection"])
def test_a_lost_connection_is_invalidated_as_sqlalchemy_does(
    run: Run, engine: Engine, server: Server, kind: str
) -> None:
    async def body(async_engine: AsyncEngine) -> None:
        async with AsyncSession(async_engine) as session, async_engine.connect() as conn:
            target: Any = session if kind == "AsyncSession" else conn
            await enqueue_values(target, EmailJob, {"recipient": "lost@example.com"})
            pid = (await target.execute(select(func.pg_backend_pid()))).scalar_one()
            await asyncio.to_thread(terminate_backend, server.conninfo, pid)
            with pytest.raises(OperationalError) as raised:
                await enqueue_values(target, EmailJob, {"recipient": "lost@example.com"})
            assert raised.value.connection_invalidated
            assert isinstance(raised.value.orig, psycopg.OperationalError)
            await target.rollback()
            await enqueue_values(target, EmailJob, {"recipient": "after@example.com"})
            await target.commit()

    run(body)
    assert [r.recipient for r in rows(engine, EMAILS)] == ["after@example.com"]


def test_a_cancelled_call_invalidates_the_connection_as_sqlalchemy_does(run: Run, engine: Engine) -> None:
    """Cancelled while the INSERT waits for a lock: the cancellation propagates and the
    connection, its protocol state unknown, is invalidated as SQLAlchemy invalidates it
    when a statement of its own is cancelled; after ``rollback()`` the session works on a
    new connection, and the cancelled job was never written."""

    async def body(async_engine: AsyncEngine) -> None:
        async with async_engine.connect() as locker:
            await locker.execute(text("LOCK TABLE email_jobs IN SHARE MODE"))  # blocks INSERTs
            async with AsyncSession(async_engine) as session:
                await session.execute(insert(ORDERS).values(customer="lost"))
                pid = (await session.execute(select(func.pg_backend_pid()))).scalar_one()
                pending = asyncio.ensure_future(enqueue_values(session, EmailJob, {"recipient": "cancelled"}))
                deadline = asyncio.get_running_loop().time() + 20
                waiting = text("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :pid")
                while not (await locker.execute(waiting, {"pid": pid})).scalar():
                    assert asyncio.get_running_loop().time() < deadline, "the INSERT never waited for the lock"
                    await asyncio.sleep(0.02)
                pending.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await pending
                connection = await session.connection()
                assert connection.invalidated
                await session.rollback()
                await locker.rollback()  # the lock is gone: the next INSERT goes through
                await enqueue_values(session, EmailJob, {"recipient": "after@example.com"})
                await session.commit()

    run(body)
    assert rows(engine, ORDERS) == []
    assert [r.recipient for r in rows(engine, EMAILS)] == ["after@example.com"]


@pytest.mark.parametrize("kind", ["AsyncSession", "AsyncConnection"])
def test_a_default_taking_the_execution_context_is_evaluated_as_by_enqueue(run: Run, engine: Engine, kind: str) -> None:
    """As the sync call: SQLAlchemy's execution of the INSERT evaluates the default."""

    async def body(async_engine: AsyncEngine) -> None:
        async with AsyncSession(async_engine) as session, async_engine.connect() as conn:
            enqueue(session, RoutedJob(customer="ada"), queue="orm")
            await session.commit()
            target: Any = session if kind == "AsyncSession" else conn
            await enqueue_values(target, RoutedJob, {"customer": "ada"}, queue="values")
            await enqueue_values(target, RoutedJob, {"customer": "bob", "routing": "own"}, queue="values")
            await enqueue_values(target, RoutedJob, {"customer": "cy"}, queue="values", delay=60)
            await target.commit()

    run(body)
    got = rows(engine, table_of(RoutedJob))
    assert [(r.customer, r.routing, r.queue) for r in got] == [
        ("ada", "routing:ada", "orm"),
        ("ada", "routing:ada", "values"),
        ("bob", "own", "values"),
        ("cy", "routing:cy", "values"),
    ]
    assert got[-1].run_after - got[-1].created_at >= timedelta(seconds=59)


@pytest.mark.parametrize("kind", ["AsyncSession", "AsyncConnection"])
def test_a_subclass_of_single_table_inheritance_writes_its_identity(run: Run, engine: Engine, kind: str) -> None:
    async def body(async_engine: AsyncEngine) -> None:
        async with AsyncSession(async_engine) as session, async_engine.connect() as conn:
            target: Any = session if kind == "AsyncSession" else conn
            await enqueue_values(target, InheritedJobA)
            await enqueue_values(target, InheritedJobB, queue="b")
            await enqueue_values(target, InheritedJob, {"kind": "b"})
            with pytest.raises(EnqueueError, match="kind='b' is not a polymorphic identity of InheritedJobA"):
                await enqueue_values(target, InheritedJobA, {"kind": "b"})
            await target.commit()

    run(body)
    with Session(engine) as session:
        assert [type(job) for job in session.scalars(select(InheritedJob).order_by(InheritedJob.id))] == [
            InheritedJobA,
            InheritedJobB,
            InheritedJobB,
        ]


def test_a_type_with_a_bind_expression_is_applied(run: Run, engine: Engine) -> None:
    async def body(async_engine: AsyncEngine) -> None:
        async with AsyncSession(async_engine) as session, async_engine.connect() as conn:
            await enqueue_values(session, EncodedJob, {"secret": "by a session"})
            await session.commit()
            await enqueue_values(conn, EncodedJob, {"secret": "on a connection"})
            await conn.commit()

    run(body)
    written = ["by a session", "on a connection"]
    with engine.connect() as conn:
        stored = conn.scalars(text("SELECT secret FROM encoded_jobs ORDER BY id")).all()
        assert conn.scalars(select(EncodedJob.secret).order_by(EncodedJob.id)).all() == written
    assert stored == [base64.b64encode(s.encode()).decode() for s in written]


def test_another_async_driver_goes_through_sqlalchemy(run: Run, engine: Engine, listening: Any, server: Server) -> None:
    """asyncpg has no psycopg cursor to await: the same plan runs through
    ``Connection.execute``, with the same row, defaults and wake-up."""

    async def body(async_engine: AsyncEngine) -> Any:
        async with AsyncSession(async_engine) as session:
            job_id = await enqueue_values(session, Task, {"task": "t"}, queue="apg", delay=60)
            await session.commit()
        async with async_engine.connect() as conn:
            await enqueue_values(conn, EmailJob, queue="apg")
            await conn.commit()
        return job_id

    job_id = run(body, driver="asyncpg")
    (task,) = rows(engine, TASKS)
    assert (task.id, task.task, task.payload, task.queue, task.isolated) == (job_id, "t", {}, "apg", False)
    assert task.run_after - task.created_at >= timedelta(seconds=59)
    (email,) = rows(engine, EMAILS)
    assert (email.recipient, email.queue) == ("someone@example.com", "apg")
    assert sorted(notifications_until_sentinel(listening, server.conninfo)) == [
        (EMAIL_CHANNEL, "apg"),
        (TASK_CHANNEL, "apg"),
    ]


def test_an_unstarted_async_connection_is_refused(run: Run, engine: Engine) -> None:
    async def body(async_engine: AsyncEngine) -> None:
        with pytest.raises(InvalidRequestError, match="not started"):
            await enqueue_values(async_engine.connect(), EmailJob)

    run(body)
    assert rows(engine, EMAILS) == []
