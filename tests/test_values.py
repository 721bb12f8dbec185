"""``enqueue_values()``: the fast path writes what ``enqueue()`` writes, in the caller's
transaction, with the same checks, and one wake-up sent with the COMMIT."""

from __future__ import annotations

import asyncio
import base64
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, event, func, insert, select, text
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from sqla_queue import EnqueueError, QueueSession, enqueue, enqueue_values, queue_table

from .bad_values import COLUMN_SAMPLE, OPTION_SAMPLE, row_values
from .helpers import SENTINEL_CHANNEL, Server, notifications_until_sentinel, table_of, terminate_backend
from .models import EmailJob, EncodedJob, InheritedJob, InheritedJobA, InheritedJobB, Order, RoutedJob, Task, UuidJob

EMAIL_CHANNEL = queue_table(EmailJob).channel
TASK_CHANNEL = queue_table(Task).channel
EMAILS = table_of(EmailJob)
TASKS = table_of(Task)
COMPARED = ("queue", "status", "priority", "attempts", "max_attempts", "isolated", "recipient", "order_id")


@pytest.fixture
def listening(listener: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    for channel in (EMAIL_CHANNEL, TASK_CHANNEL, SENTINEL_CHANNEL):
        listener.execute(f'LISTEN "{channel}"')
    return listener


def rows(engine: Engine, table: Any) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(table).order_by(table.c.id)))


def test_writes_what_enqueue_writes_and_notifies_once_on_commit(
    engine: Engine, listening: Any, server: Server
) -> None:
    with Session(engine) as session:
        order = Order(customer="ada")
        session.add(order)
        session.flush()
        first = enqueue_values(session, EmailJob, {"order_id": order.id, "recipient": "a@example.com"})
        enqueue_values(session, EmailJob, {"order_id": order.id, "recipient": "a@example.com"})
        enqueue(session, EmailJob(order_id=order.id, recipient="a@example.com"))
        session.commit()
    fast, again, orm = rows(engine, EMAILS)
    assert fast.id == first
    for column in COMPARED:
        assert getattr(fast, column) == getattr(orm, column) == getattr(again, column), column
    assert notifications_until_sentinel(listening, server.conninfo) == [(EMAIL_CHANNEL, "default")]


def test_python_defaults_and_options(engine: Engine, listening: Any, server: Server) -> None:
    at = datetime(2030, 1, 1, tzinfo=UTC)
    with Session(engine) as session:
        enqueue_values(session, Task, {"task": "resize"}, queue="images", priority=3, max_attempts=2, run_at=at)
        enqueue_values(session, EmailJob)  # every column from its default
        session.commit()
    (task,) = rows(engine, TASKS)
    assert (task.task, task.payload, task.queue, task.priority, task.max_attempts) == ("resize", {}, "images", 3, 2)
    assert task.run_after == at
    (email,) = rows(engine, EMAILS)
    assert email.recipient == "someone@example.com"  # the model's Python default
    got = notifications_until_sentinel(listening, server.conninfo)
    assert sorted(got) == sorted([(TASK_CHANNEL, "images"), (EMAIL_CHANNEL, "default")])


def test_delay_is_measured_from_the_insert(engine: Engine) -> None:
    with Session(engine) as session:
        session.execute(text("SELECT pg_sleep(0.3)"))  # the transaction started earlier
        enqueue_values(session, EmailJob, delay=60)
        inserted = session.scalar(select(func.clock_timestamp()))
        session.commit()
    (job,) = rows(engine, EMAILS)
    assert inserted is not None
    # From the start of the transaction (now()) it would be 0.3 s short of a minute.
    assert timedelta(seconds=59.9) <= job.run_after - inserted <= timedelta(seconds=60)


def test_rollback_leaves_no_job_and_no_wake_up(engine: Engine, listening: Any, server: Server) -> None:
    with Session(engine) as session:
        session.add(Order(customer="bob"))
        enqueue_values(session, EmailJob, {"recipient": "bob@example.com"})
        session.rollback()
    assert rows(engine, EMAILS) == [] and rows(engine, table_of(Order)) == []
    assert notifications_until_sentinel(listening, server.conninfo) == []


def test_on_a_connection_and_a_scoped_session(engine: Engine, listening: Any, server: Server) -> None:
    with engine.begin() as conn:
        enqueue_values(conn, EmailJob, {"recipient": "c@example.com"}, queue="conn")
    scoped = scoped_session(sessionmaker(engine, class_=QueueSession))
    try:
        enqueue_values(scoped, EmailJob, {"recipient": "s@example.com"}, queue="scoped")
        scoped.commit()
    finally:
        scoped.remove()
    assert [r.queue for r in rows(engine, EMAILS)] == ["conn", "scoped"]
    got = notifications_until_sentinel(listening, server.conninfo)
    assert sorted(got) == [(EMAIL_CHANNEL, "conn"), (EMAIL_CHANNEL, "scoped")]


@pytest.mark.parametrize(("model", "column", "value", "error", "message"), COLUMN_SAMPLE)
def test_bad_values_raise_before_anything_is_written(
    engine: Engine, model: Any, column: str, value: Any, error: type[Exception], message: str
) -> None:
    with Session(engine) as session:
        session.add(Order(customer="kept"))
        session.flush()
        with pytest.raises(error, match=message):
            enqueue_values(session, model, row_values(model, column, value))
        session.commit()  # the caller's transaction is still whole
    assert [o.customer for o in rows(engine, table_of(Order))] == ["kept"]
    assert rows(engine, EMAILS) == [] and rows(engine, TASKS) == []


@pytest.mark.parametrize(("options", "message"), OPTION_SAMPLE)
def test_bad_options_raise_before_anything_is_written(engine: Engine, options: dict[str, Any], message: str) -> None:
    with Session(engine) as session:
        with pytest.raises(EnqueueError, match=message):
            enqueue_values(session, EmailJob, **options)
        session.commit()
    assert rows(engine, EMAILS) == []


@pytest.mark.parametrize(
    ("values", "message"),
    [
        pytest.param({"recipent": "typo"}, "no column 'recipent'", id="unknown-column"),
        pytest.param({"status": "done"}, "status is managed by the queue", id="managed-status"),
        pytest.param({"attempts": 3}, "attempts is managed by the queue", id="managed-attempts"),
    ],
)
def test_unknown_and_managed_columns_are_refused(engine: Engine, values: dict[str, Any], message: str) -> None:
    with Session(engine) as session, pytest.raises(EnqueueError, match=message):
        enqueue_values(session, EmailJob, values)
    assert rows(engine, EMAILS) == []


def test_a_refused_value_begins_nothing_on_the_session(engine: Engine) -> None:
    with Session(engine) as session:
        with pytest.raises(EnqueueError, match="task name"):
            enqueue_values(session, Task, {"task": ""})
        assert not session.in_transaction()


def test_checks_run_on_every_call_whatever_the_shape_cached(engine: Engine) -> None:
    """The plan of a shape (its SQL, checks and defaults) is worked out once; the values of
    each call are still checked, and keys given in another order or with options get
    their own plan."""
    with Session(engine) as session:
        enqueue_values(session, Task, {"task": "a", "payload": {"n": 1}})
        enqueue_values(session, Task, {"payload": {"n": 2}, "task": "b"}, priority=2)
        enqueue_values(session, Task, {"payload": {"n": 3}, "task": "c"})
        with pytest.raises(EnqueueError, match="task name"):
            enqueue_values(session, Task, {"task": "", "payload": {"n": 4}})
        with pytest.raises(EnqueueError, match="priority must be"):
            enqueue_values(session, Task, {"payload": {"n": 5}, "task": "e"}, priority=2**40)
        session.commit()
    assert [(t.task, t.payload, t.priority) for t in rows(engine, TASKS)] == [
        ("a", {"n": 1}, 0),
        ("b", {"n": 2}, 2),
        ("c", {"n": 3}, 0),
    ]


def test_commit_as_you_go_and_a_replaced_dbapi_connection(engine: Engine) -> None:
    """On a Connection with no transaction begun, the call begins one as
    ``Connection.execute`` would, so ``commit()`` commits the job. The statement runs on a
    cursor kept with the pooled connection; when the pool replaces the DBAPI connection,
    the next call makes a cursor on the new one."""
    with engine.connect() as conn:
        enqueue_values(conn, EmailJob, {"recipient": "before@example.com"})
        conn.commit()
        before = conn.connection.dbapi_connection
        conn.invalidate()
        conn.rollback()
        enqueue_values(conn, EmailJob, {"recipient": "after@example.com"})
        assert conn.connection.dbapi_connection is not before
        conn.commit()
    assert [r.recipient for r in rows(engine, EMAILS)] == ["before@example.com", "after@example.com"]


SAME_ID = uuid.UUID(int=7)
#: Values only the database refuses: (model, values of each call, the last one refused,
#: psycopg's error). The same SQLAlchemy class as ``enqueue()``'s flush must come out.
REFUSED = [
    pytest.param(EmailJob, [{"order_id": 10**9}], psycopg.errors.ForeignKeyViolation, id="foreign-key"),
    pytest.param(EmailJob, [{"recipient": ""}], psycopg.errors.CheckViolation, id="check"),
    pytest.param(UuidJob, [{"id": SAME_ID}, {"id": SAME_ID}], psycopg.errors.UniqueViolation, id="unique"),
]


@pytest.mark.parametrize("form", ["Session", "Connection"])
@pytest.mark.parametrize(("model", "calls", "orig"), REFUSED)
def test_a_statement_the_database_refuses_raises_what_enqueue_raises(
    engine: Engine, form: str, model: Any, calls: list[dict[str, Any]], orig: type[Exception]
) -> None:
    """A value only the database can refuse fails the INSERT there, with SQLAlchemy's
    exception (``.orig`` psycopg's), through the engine's ``handle_error`` hooks, as from
    ``enqueue()``'s flush. The transaction is aborted as by any failed statement; after
    ``rollback()`` the session or connection works again."""
    with Session(engine) as session:
        *before, last = calls
        for values in before:
            enqueue(session, model(**values))
        enqueue(session, model(**last))
        with pytest.raises(DBAPIError) as by_enqueue:
            session.flush()
        session.rollback()

    handled: list[Exception] = []
    listener = event.listens_for(engine, "handle_error")(lambda context: handled.append(context.original_exception))
    try:
        with Session(engine) as session, engine.connect() as conn:
            target: Any = session if form == "Session" else conn
            target.execute(insert(table_of(Order)).values(customer="lost"))
            for values in before:
                enqueue_values(target, model, values)
            with pytest.raises(DBAPIError) as by_values:
                enqueue_values(target, model, last)
            assert type(by_values.value) is type(by_enqueue.value) is IntegrityError
            assert type(by_values.value.orig) is type(by_enqueue.value.orig) is orig
            assert handled == [by_values.value.orig]
            assert "INSERT INTO" in str(by_values.value)  # the statement, as SQLAlchemy shows it
            with pytest.raises(DBAPIError, match="current transaction is aborted"):
                target.execute(select(1))  # PostgreSQL's aborted transaction, as after enqueue()
            target.rollback()
            enqueue_values(target, EmailJob, {"recipient": "next@example.com"})
            target.commit()
    finally:
        event.remove(engine, "handle_error", listener)
    assert rows(engine, table_of(Order)) == []
    assert [r.recipient for r in rows(engine, EMAILS)] == ["next@example.com"]


@pytest.mark.parametrize("form", ["Session", "Connection"])
def test_a_lost_connection_is_invalidated_as_sqlalchemy_does(engine: Engine, server: Server, form: str) -> None:
    """The server ends the connection between two calls: the second raises SQLAlchemy's
    ``OperationalError`` with ``connection_invalidated``, and after ``rollback()`` the
    session or connection carries on with a new connection."""
    with Session(engine) as session, engine.connect() as conn:
        target: Any = session if form == "Session" else conn
        enqueue_values(target, EmailJob, {"recipient": "lost@example.com"})
        terminate_backend(server.conninfo, target.execute(select(func.pg_backend_pid())).scalar_one())
        with pytest.raises(OperationalError) as raised:
            enqueue_values(target, EmailJob, {"recipient": "lost@example.com"})
        assert raised.value.connection_invalidated
        assert isinstance(raised.value.orig, psycopg.OperationalError)
        target.rollback()
        enqueue_values(target, EmailJob, {"recipient": "after@example.com"})
        target.commit()
    assert [r.recipient for r in rows(engine, EMAILS)] == ["after@example.com"]


def test_a_type_with_a_bind_expression_is_applied_as_by_enqueue(engine: Engine) -> None:
    """The statement compiled once holds the type's ``bind_expression`` (SQL around the
    value): the row stores what ``enqueue()`` stores, and reads back through the type."""
    with Session(engine) as session, engine.connect() as conn:
        enqueue(session, EncodedJob(secret="by enqueue"))
        session.flush()
        enqueue_values(session, EncodedJob, {"secret": "by enqueue_values"})
        enqueue_values(session, EncodedJob, {"secret": None})
        session.commit()
        enqueue_values(conn, EncodedJob, {"secret": "on a connection"})
        conn.commit()
    written = ["by enqueue", "by enqueue_values", None, "on a connection"]
    with engine.connect() as conn:
        stored = conn.scalars(text("SELECT secret FROM encoded_jobs ORDER BY id")).all()
        read = conn.scalars(select(EncodedJob.secret).order_by(EncodedJob.id)).all()
    assert stored == [None if s is None else base64.b64encode(s.encode()).decode() for s in written]
    assert read == written


def test_a_subclass_of_single_table_inheritance_writes_its_identity(engine: Engine) -> None:
    """The discriminator gets the model's polymorphic identity, as the ORM writes it, so
    the ORM loads each row as the class it was enqueued as; an identity that is not the
    model's or a subclass's is refused before anything is sent."""
    with Session(engine) as session, engine.connect() as conn:
        by_orm = enqueue(session, InheritedJobA())
        session.flush()
        ids = {
            "a by enqueue": by_orm.id,
            "a": enqueue_values(session, InheritedJobA),
            "b": enqueue_values(session, InheritedJobB, {"kind": None}, queue="b"),
            "base": enqueue_values(session, InheritedJob),
            "b by the base": enqueue_values(session, InheritedJob, {"kind": "b"}),
            "a on a connection": enqueue_values(conn, InheritedJobA, {"kind": "a"}),
        }
        for model, kind in [(InheritedJobA, "b"), (InheritedJobB, "base"), (InheritedJob, "c")]:
            with pytest.raises(EnqueueError, match=f"kind='{kind}' is not a polymorphic identity of {model.__name__}"):
                enqueue_values(session, model, {"kind": kind})
            with pytest.raises(EnqueueError, match=f"kind='{kind}' is not a polymorphic identity"):
                enqueue_values(conn, model, {"kind": kind})
        session.commit()
        conn.commit()
    with Session(engine) as session:
        loaded = {name: session.get(InheritedJob, job_id) for name, job_id in ids.items()}
        kinds = session.scalars(select(InheritedJob.kind)).all()
    assert {name: type(job) for name, job in loaded.items()} == {
        "a by enqueue": InheritedJobA,
        "a": InheritedJobA,
        "b": InheritedJobB,
        "base": InheritedJob,
        "b by the base": InheritedJobB,
        "a on a connection": InheritedJobA,
    }
    assert sorted(kinds) == ["a", "a", "a", "b", "b", "base"]


def test_a_default_taking_the_execution_context_is_evaluated_as_by_enqueue(
    engine: Engine, listening: Any, server: Server
) -> None:
    """``default=lambda ctx: …`` is evaluated by SQLAlchemy's execution of the INSERT,
    with the row's other values in ``ctx.get_current_parameters()`` and the column in
    ``ctx.current_column``, as when ``enqueue()`` flushes; the wake-up still rides along."""
    routed_channel = queue_table(RoutedJob).channel
    listening.execute(f'LISTEN "{routed_channel}"')
    with Session(engine) as session:
        enqueue(session, RoutedJob(customer="ada"), queue="orm")
        session.flush()
        enqueue_values(session, RoutedJob, {"customer": "ada"}, queue="values")
        enqueue_values(session, RoutedJob, {"customer": "bob", "routing": "own"}, queue="values")
        enqueue_values(session, RoutedJob, queue="values")
        session.commit()
    with engine.begin() as conn:
        job_id = enqueue_values(conn, RoutedJob, {"customer": "cy"}, queue="conn", delay=60)
    got = rows(engine, table_of(RoutedJob))
    assert [(r.customer, r.routing, r.queue) for r in got] == [
        ("ada", "routing:ada", "orm"),
        ("ada", "routing:ada", "values"),
        ("bob", "own", "values"),
        (None, "routing:None", "values"),
        ("cy", "routing:cy", "conn"),
    ]
    orm, by_values = got[0], got[1]
    for column in ("status", "priority", "attempts", "max_attempts", "isolated"):
        assert getattr(orm, column) == getattr(by_values, column), column
    assert got[-1].id == job_id and got[-1].run_after - got[-1].created_at >= timedelta(seconds=59)
    assert sorted(notifications_until_sentinel(listening, server.conninfo)) == [
        (routed_channel, "conn"),
        (routed_channel, "orm"),
        (routed_channel, "values"),
    ]


def test_an_async_session_through_run_sync(engine: Engine, server: Server) -> None:
    """On the async driver the statement goes through ``Connection.execute`` (no psycopg
    cursor to run it on from the sync side): the same row, defaults and delay."""

    async def main() -> None:
        async_engine = create_async_engine(server.url.set(drivername="postgresql+psycopg"))
        try:
            async with AsyncSession(async_engine) as session:
                await session.run_sync(lambda s: enqueue_values(s, Task, {"task": "t"}, queue="aq", delay=60))
                await session.run_sync(lambda s: enqueue_values(s, EmailJob))
                await session.commit()
        finally:
            await async_engine.dispose()

    asyncio.run(main())
    (task,) = rows(engine, TASKS)
    assert (task.task, task.payload, task.queue, task.isolated) == ("t", {}, "aq", False)
    assert task.run_after - task.created_at >= timedelta(seconds=59)
    (email,) = rows(engine, EMAILS)
    assert (email.recipient, email.priority, email.isolated) == ("someone@example.com", 0, False)


def test_on_an_autocommit_connection_each_call_is_committed(engine: Engine, listening: Any, server: Server) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        first = enqueue_values(conn, EmailJob, {"recipient": "x@example.com"}, queue="auto")
        assert [r.id for r in rows(engine, EMAILS)] == [first]  # seen by another connection
        enqueue_values(conn, EmailJob, queue="auto")
    assert len(rows(engine, EMAILS)) == 2
    assert notifications_until_sentinel(listening, server.conninfo) == [(EMAIL_CHANNEL, "auto")] * 2
