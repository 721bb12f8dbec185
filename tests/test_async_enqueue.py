"""Enqueue from asyncio: ``await enqueue_many(async_session, …)`` and ``AsyncQueueSession``.

Each test runs its coroutine with ``asyncio.run`` on an async engine of its own (engines
belong to one event loop), through psycopg 3's async driver, against real PostgreSQL.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import psycopg
import pytest
from sqlalchemy import Engine, event, func, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_scoped_session,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import Session

from sqla_queue import (
    AsyncQueueSession,
    BulkRowError,
    EnqueueError,
    QueueSession,
    enqueue,
    enqueue_many,
    queue_table,
)

from .bad_values import COLUMN_SAMPLE, OPTION_SAMPLE, row_values
from .helpers import SENTINEL_CHANNEL, Server, notifications_until_sentinel
from .models import EmailJob, EncodedJob, InheritedJob, InheritedJobB, Order, Task

EMAIL_CHANNEL = queue_table(EmailJob).channel
TASK_CHANNEL = queue_table(Task).channel
METHODS = ["copy", "insert"]

T = TypeVar("T")
Sessions = async_sessionmaker[AsyncQueueSession]


class Db:
    """The async engine of one ``asyncio.run``, its sessions, and the INSERTs it sent."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.Session: Sessions = async_sessionmaker(engine, class_=AsyncQueueSession)
        #: INSERTs into email_jobs sent through SQLAlchemy; COPY goes around it.
        self.inserts: list[str] = []
        event.listen(engine.sync_engine, "before_cursor_execute", self._record)

    def _record(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("INSERT INTO EMAIL_JOBS"):
            self.inserts.append(statement)


@pytest.fixture
def run(engine: Engine, server: Server) -> Callable[[Callable[[Db], Awaitable[T]]], T]:
    """``run(body)``: ``asyncio.run`` of ``body(db)`` on a fresh async psycopg engine."""

    def runner(body: Callable[[Db], Awaitable[T]]) -> T:
        async def main() -> T:
            async_engine = create_async_engine(server.url.set(drivername="postgresql+psycopg"))
            try:
                return await body(Db(async_engine))
            finally:
                await async_engine.dispose()

        return asyncio.run(main())

    return runner


Run = Callable[[Callable[[Db], Awaitable[Any]]], Any]


@pytest.fixture
def listening(listener: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    for channel in (EMAIL_CHANNEL, TASK_CHANNEL, SENTINEL_CHANNEL):
        listener.execute(f'LISTEN "{channel}"')
    return listener


def count(engine: Engine, model: Any) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(model)) or 0)


async def acount(session: AsyncSession, model: Any) -> int:
    return int(await session.scalar(select(func.count()).select_from(model)) or 0)


async def new_order(session: AsyncSession, customer: str = "ada") -> int:
    order = Order(customer=customer)
    session.add(order)
    await session.flush()
    return order.id


async def arows(rows: list[Any]) -> AsyncIterator[Any]:
    for row in rows:
        await asyncio.sleep(0)  # a real suspension between rows, as a network source has
        yield row


# -- what gets written --------------------------------------------------------------------


@pytest.mark.parametrize("source", ["list", "async generator"])
@pytest.mark.parametrize("method", METHODS)
def test_rows_from_dicts_and_instances(run: Run, engine: Engine, method: Any, source: str) -> None:
    async def body(db: Db) -> None:
        async with db.Session() as session:
            order_id = await new_order(session)
            instance = EmailJob(order_id=order_id, recipient="obj@example.com", priority=7)
            rows: list[Any] = [{"order_id": order_id, "recipient": f"u{n}@example.com"} for n in range(40)]
            rows.insert(10, instance)
            rows.append({"recipient": "no-order@example.com", "queue": "other"})
            given = arows(rows) if source == "async generator" else rows
            assert await enqueue_many(session, EmailJob, given, method=method, batch_size=7) == 42
            assert instance not in session and instance.id is None  # read, not added
            await session.commit()
        assert (len(db.inserts) > 0) == (method == "insert")  # the path really taken

    run(body)
    with engine.connect() as conn:
        got = conn.execute(
            select(EmailJob.order_id, EmailJob.recipient, EmailJob.queue, EmailJob.priority).order_by(EmailJob.id)
        ).all()
    assert len(got) == 42
    order_id = got[0].order_id
    assert tuple(got[0]) == (order_id, "u0@example.com", "default", 0)
    assert tuple(got[10]) == (order_id, "obj@example.com", "default", 7)  # input order kept
    assert tuple(got[-1]) == (None, "no-order@example.com", "other", 0)


@pytest.mark.parametrize("method", METHODS)
def test_task_rows_with_jsonb_payloads(run: Run, engine: Engine, method: Any) -> None:
    payloads: list[Any] = [{"nested": {"l": [1, 2.5, None, True]}}, ["a", {"b": []}], "text \\N \t", {}]

    async def body(db: Db) -> None:
        async with db.Session() as session:
            rows: list[Any] = [{"task": f"t{n}", "payload": p} for n, p in enumerate(payloads)]
            rows.append(Task(task="from-object", payload={"ü": "ß"}))
            await session.enqueue_many(Task, rows, method=method)
            await session.commit()

    run(body)
    with engine.connect() as conn:
        got: dict[str, Any] = dict(conn.execute(select(Task.task, Task.payload)).all())
    assert got == {**{f"t{n}": p for n, p in enumerate(payloads)}, "from-object": {"ü": "ß"}}


@pytest.mark.parametrize("method", METHODS)
def test_rows_match_what_enqueue_writes(run: Run, method: Any) -> None:
    """Same transaction, so now() (created_at) is the same instant for every row."""
    options: dict[str, Any] = {
        "queue": "q",
        "priority": -4,
        "max_attempts": 3,
        "run_at": datetime(2031, 5, 1, tzinfo=UTC),
    }

    async def body(db: Db) -> None:
        async with db.Session() as session:
            order_id = await new_order(session)
            session.enqueue(EmailJob(order_id=order_id), **options)
            await session.flush()
            await session.enqueue_many(EmailJob, [{"order_id": order_id}], method=method, **options)
            await session.enqueue_many(EmailJob, arows([EmailJob(order_id=order_id)]), method=method, **options)
            table = queue_table(EmailJob).table
            rows = [
                {k: v for k, v in r._mapping.items() if k != "id"}
                for r in await session.execute(select(table).order_by(table.c.id))
            ]
            assert len(rows) == 3 and rows[1] == rows[0] and rows[2] == rows[0]
            await session.rollback()

    run(body)


def test_delay_is_measured_by_the_database_clock(run: Run) -> None:
    async def body(db: Db) -> None:
        async with db.Session() as session:
            before = await session.scalar(select(func.clock_timestamp()))
            await session.enqueue_many(EmailJob, [{}] * 3, delay=300)
            after = await session.scalar(select(func.clock_timestamp()))
            run_after = set(await session.scalars(select(EmailJob.run_after)))
            assert len(run_after) == 1 and before is not None and after is not None
            (at,) = run_after
            assert (at - before).total_seconds() >= 300 and (at - after).total_seconds() <= 300
            await session.rollback()

    run(body)


# -- streaming ----------------------------------------------------------------------------


class Row(dict):  # type: ignore[type-arg]
    """A dict that counts how many of its kind are alive at once."""

    live = 0

    def __del__(self) -> None:
        Row.live -= 1


@pytest.mark.parametrize(("method", "total", "batch"), [("copy", 50_000, 1000), ("insert", 3_000, 100)])
def test_async_rows_stream_in_bounded_batches(
    run: Run, engine: Engine, method: Any, total: int, batch: int
) -> None:
    Row.live = peak = pulled = 0

    async def rows() -> AsyncIterator[Row]:
        nonlocal peak, pulled
        for n in range(total):
            if n % 500 == 0:
                await asyncio.sleep(0)
            row = Row(recipient=f"r{n}")
            Row.live += 1
            pulled += 1
            peak = max(peak, Row.live)
            yield row

    async def body(db: Db) -> int:
        async with db.Session() as session:
            written = await session.enqueue_many(EmailJob, rows(), method=method, batch_size=batch)
            await session.commit()
            return written

    assert run(body) == total == pulled
    assert count(engine, EmailJob) == total
    # a list of the rows would keep every one alive; batching keeps about one batch
    assert peak <= 2 * batch, peak


# -- bad rows and database errors ---------------------------------------------------------


@pytest.mark.parametrize("where", ["first batch", "later batch"])
@pytest.mark.parametrize("source", ["list", "async generator"])
@pytest.mark.parametrize("method", METHODS)
def test_bad_row_leaves_nothing_and_the_session_usable(
    run: Run, engine: Engine, listening: Any, server: Server, method: Any, source: str, where: str
) -> None:
    bad = 2345 if where == "later batch" else 345
    rows: list[Any] = [{"recipient": f"r{n}"} for n in range(3000)]
    rows[bad] = {"recipient": "x", "recipent": "typo"}

    async def body(db: Db) -> None:
        async with db.Session() as session:
            await new_order(session, "kept")
            given = arows(rows) if source == "async generator" else rows
            with pytest.raises(BulkRowError, match=r"^row \d+: unknown column.*'recipent'") as info:
                await session.enqueue_many(EmailJob, given, method=method, batch_size=1000)
            assert info.value.index == bad
            # earlier batches were written, then rolled back to the savepoint: the
            # transaction works and holds the business row but none of the jobs
            assert await acount(session, EmailJob) == 0
            assert await acount(session, Order) == 1
            assert await session.enqueue_many(EmailJob, [{"recipient": "after"}] * 3, method=method) == 3
            await session.commit()

    run(body)
    assert count(engine, Order) == 1
    with engine.connect() as conn:
        assert conn.scalars(select(EmailJob.recipient)).all() == ["after"] * 3
    assert notifications_until_sentinel(listening, server.conninfo) == [(EMAIL_CHANNEL, "default")]


@pytest.mark.parametrize("batches", ["one batch", "several batches"])
@pytest.mark.parametrize("method", METHODS)
def test_a_foreign_key_violation_leaves_the_transaction_usable(
    run: Run, engine: Engine, method: Any, batches: str
) -> None:
    batch_size = 1000 if batches == "one batch" else 10
    rows = [{"recipient": "ok"}] * 30 + [{"order_id": 987654}] + [{"recipient": "ok"}] * 5

    async def body(db: Db) -> None:
        async with db.Session() as session:
            await new_order(session, "kept")
            with pytest.raises(IntegrityError, match="foreign key"):
                await session.enqueue_many(EmailJob, arows(rows), method=method, batch_size=batch_size)
            assert await acount(session, EmailJob) == 0
            assert await session.enqueue_many(EmailJob, [{"recipient": "again"}] * 2, method=method) == 2
            await session.commit()

    run(body)
    assert count(engine, Order) == 1
    with engine.connect() as conn:
        assert conn.scalars(select(EmailJob.recipient)).all() == ["again", "again"]


@pytest.mark.parametrize(("model", "column", "value", "error", "message"), COLUMN_SAMPLE)
def test_bad_values_raise_what_the_sync_load_raises(
    run: Run, engine: Engine, model: Any, column: str, value: Any, error: type[Exception], message: str
) -> None:
    """One set of rules: the async load refuses a row exactly as the sync one does."""
    good = row_values(model, "queue", "fine")
    rows = [good, good, row_values(model, column, value), good]
    with Session(engine) as sync_session, pytest.raises(BulkRowError) as sync_info:
        enqueue_many(sync_session, model, rows, method="copy")

    async def body(db: Db) -> BulkRowError:
        async with db.Session() as session:
            await new_order(session, "kept")
            with pytest.raises(BulkRowError, match=message) as info:
                await session.enqueue_many(model, arows(rows), method="copy")
            await session.commit()
            return info.value

    raised = run(body)
    assert (raised.index, str(raised), type(raised.__cause__)) == (2, str(sync_info.value), error)
    assert type(sync_info.value.__cause__) is error
    assert count(engine, Order) == 1 and count(engine, model) == 0


@pytest.mark.parametrize(("options", "message"), OPTION_SAMPLE)
def test_bad_options_fail_before_any_row_is_read(
    run: Run, engine: Engine, options: dict[str, Any], message: str
) -> None:
    pulled = 0

    async def rows() -> AsyncIterator[dict[str, Any]]:
        nonlocal pulled
        for _ in range(5):
            pulled += 1
            yield {}

    async def body(db: Db) -> None:
        async with db.Session() as session:
            await new_order(session, "kept")
            with pytest.raises(EnqueueError, match=message) as raised:
                await session.enqueue_many(EmailJob, rows(), **options)
            assert not isinstance(raised.value, BulkRowError)
            await session.commit()

    run(body)
    assert pulled == 0
    assert count(engine, Order) == 1 and count(engine, EmailJob) == 0


# -- commit, rollback and NOTIFY ----------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_rolled_back_with_the_session(
    run: Run, engine: Engine, listening: Any, server: Server, method: Any
) -> None:
    async def body(db: Db) -> None:
        async with db.Session() as session:
            order_id = await new_order(session)
            session.enqueue(EmailJob(order_id=order_id), queue="single")
            await session.enqueue_many(EmailJob, arows([{"order_id": order_id}] * 30), method=method)
            assert await acount(session, EmailJob) == 31
            await session.rollback()

    run(body)
    assert count(engine, EmailJob) == 0 and count(engine, Order) == 0
    assert notifications_until_sentinel(listening, server.conninfo) == []


@pytest.mark.parametrize("method", METHODS)
def test_one_notification_per_queue_on_commit(
    run: Run, listening: Any, server: Server, method: Any
) -> None:
    async def body(db: Db) -> None:
        async with db.Session() as session:
            rows = [{"queue": "a"}] * 50 + [{"queue": "b"}] * 50 + [{}] * 50
            await session.enqueue_many(EmailJob, arows(rows), queue="opt", method=method, batch_size=40)
            await session.enqueue_many(EmailJob, [{"queue": "a"}] * 5, method=method)
            session.enqueue(EmailJob(), queue="a")
            await session.enqueue_many(Task, [{"task": "t"}] * 20, method=method)
            await session.flush()
            assert notifications_until_sentinel(listening, server.conninfo) == []  # not before commit
            await session.commit()

    run(body)
    got = notifications_until_sentinel(listening, server.conninfo)
    assert sorted(got) == [
        (EMAIL_CHANNEL, "a"),
        (EMAIL_CHANNEL, "b"),
        (EMAIL_CHANNEL, "opt"),
        (TASK_CHANNEL, "default"),
    ]


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_enqueue_on_async_sessions_notifies_once_on_commit_only(
    run: Run, engine: Engine, listening: Any, server: Server, outcome: str
) -> None:
    """``AsyncQueueSession.enqueue`` and ``sqla_queue.enqueue`` on a plain ``AsyncSession``."""

    async def body(db: Db) -> None:
        plain = async_sessionmaker(db.engine)  # Session, not QueueSession: hooks installed per session
        for factory in (db.Session, plain):
            async with factory() as session:
                await new_order(session)
                if isinstance(session, AsyncQueueSession):
                    job = session.enqueue(EmailJob(recipient="a@example.com"), queue="mine")
                    session.enqueue(EmailJob(recipient="b@example.com"), queue="mine")
                else:
                    job = enqueue(session, EmailJob(recipient="a@example.com"), queue="plain")
                    await enqueue_many(session, EmailJob, [{"queue": "plain"}] * 3)
                await session.flush()
                assert job.id is not None
                await (session.commit() if outcome == "commit" else session.rollback())

    run(body)
    got = notifications_until_sentinel(listening, server.conninfo)
    if outcome == "commit":
        assert got == [(EMAIL_CHANNEL, "mine"), (EMAIL_CHANNEL, "plain")]  # commit order, once each
        assert count(engine, EmailJob) == 2 + 4
    else:
        assert got == []
        assert count(engine, EmailJob) == 0 and count(engine, Order) == 0


@pytest.mark.parametrize("savepoint", [False, True])
def test_the_wake_up_rides_in_the_commit_query(
    run: Run, engine: Engine, listening: Any, server: Server, savepoint: bool
) -> None:
    """On async psycopg the NOTIFY is sent in the COMMIT's own query, not as a statement
    (and a round trip) of its own: no ``pg_notify`` goes through a cursor, yet the
    workers are woken once per queue, and only after the commit."""
    sent: list[str] = []

    async def body(db: Db) -> None:
        event.listen(
            db.engine.sync_engine, "before_cursor_execute", lambda conn, cur, stmt, *a: sent.append(stmt)
        )
        async with db.Session() as session:
            session.enqueue(EmailJob(), queue="outer")
            if savepoint:
                async with session.begin_nested():
                    session.enqueue(EmailJob(), queue="inner")
            await session.flush()
            assert notifications_until_sentinel(listening, server.conninfo) == []
            await session.commit()

    run(body)
    assert [stmt for stmt in sent if "pg_notify" in stmt.lower()] == []
    got = notifications_until_sentinel(listening, server.conninfo)
    assert sorted(got) == [(EMAIL_CHANNEL, "inner"), (EMAIL_CHANNEL, "outer")][0 if savepoint else 1 :]
    assert count(engine, EmailJob) == (2 if savepoint else 1)


@pytest.mark.parametrize(("model", "column", "value", "error", "message"), COLUMN_SAMPLE)
def test_async_enqueue_validates_as_enqueue(
    run: Run, engine: Engine, model: Any, column: str, value: Any, error: type[Exception], message: str
) -> None:
    with QueueSession(engine) as sync_session, pytest.raises(error) as sync_info:
        sync_session.enqueue(model(**row_values(model, column, value)))

    async def body(db: Db) -> Exception:
        async with db.Session() as session:
            job = model(**row_values(model, column, value))
            with pytest.raises(error, match=message) as info:
                session.enqueue(job)
            assert job not in session and not session.new  # untouched
            return info.value

    assert str(run(body)) == str(sync_info.value)


def test_async_scoped_session_stands_for_its_session(run: Run, engine: Engine) -> None:
    async def body(db: Db) -> None:
        scoped = async_scoped_session(db.Session, scopefunc=asyncio.current_task)
        enqueue(scoped, EmailJob(), queue="scoped")
        assert await enqueue_many(scoped, EmailJob, [{}] * 3) == 3
        await scoped.commit()
        await scoped.remove()

    run(body)
    assert count(engine, EmailJob) == 4


def test_run_sync_form_uses_copy_too(run: Run, engine: Engine) -> None:
    """``await session.run_sync(enqueue_many, …)``, the form of earlier releases, still works."""

    async def body(db: Db) -> int:
        async with db.Session() as session:
            written = await session.run_sync(enqueue_many, EmailJob, [{"queue": "rs"}] * 20, method="copy")
            await session.commit()
        assert db.inserts == []
        return written

    assert run(body) == 20
    assert count(engine, EmailJob) == 20


def test_nothing_happens_until_awaited(run: Run, engine: Engine) -> None:
    async def body(db: Db) -> None:
        async with db.Session() as session:
            pending = enqueue_many(session, EmailJob, [{}] * 3)
            assert inspect.iscoroutine(pending)
            assert await acount(session, EmailJob) == 0
            pending.close()  # never awaited: nothing was, or will be, written
            await session.commit()

    run(body)
    assert count(engine, EmailJob) == 0


def test_an_async_iterable_needs_an_async_session(engine: Engine) -> None:
    with Session(engine) as session, pytest.raises(TypeError, match="only an AsyncSession can read"):
        enqueue_many(session, EmailJob, arows([{}]))  # type: ignore[call-overload]
    with Session(engine) as session, pytest.raises(TypeError, match="rows must be an iterable"):
        enqueue_many(session, EmailJob, {"queue": "x"})


def test_bad_arguments_are_type_errors(run: Run, engine: Engine) -> None:
    async def body(db: Db) -> None:
        async with db.Session() as session:
            with pytest.raises(TypeError, match="rows must be an iterable"):
                await session.enqueue_many(EmailJob, {"queue": "x"})
            with pytest.raises(TypeError, match="expected a SQLAlchemy Session"):
                await enqueue_many(object(), EmailJob, [{}])  # type: ignore[call-overload]

    run(body)


def test_bind_expressions_and_inherited_models_as_the_sync_load(run: Run, engine: Engine) -> None:
    """A type with a ``bind_expression`` takes INSERTs (COPY is refused when asked for);
    a subclass of single-table inheritance writes its identity."""

    async def body(db: Db) -> None:
        async with db.Session() as session:
            await session.enqueue_many(EncodedJob, [{"secret": "a"}, {"secret": "b"}], batch_size=1)
            with pytest.raises(EnqueueError, match=r"secret of encoded_jobs .*bind_expression"):
                await session.enqueue_many(EncodedJob, [{"secret": "c"}] * 2, method="copy")
            await session.enqueue_many(InheritedJobB, arows([{}, {"kind": None}]))
            with pytest.raises(BulkRowError, match=r"^row 0: kind='a' is not a polymorphic identity of InheritedJobB"):
                await session.enqueue_many(InheritedJobB, [{"kind": "a"}])
            await session.commit()

    run(body)
    with Session(engine) as session:
        assert session.scalars(select(EncodedJob.secret).order_by(EncodedJob.id)).all() == ["a", "b"]
        assert session.scalars(text("SELECT secret FROM encoded_jobs ORDER BY id")).all() == ["YQ==", "Yg=="]
        assert [type(job) for job in session.scalars(select(InheritedJob))] == [InheritedJobB, InheritedJobB]
