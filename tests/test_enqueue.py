"""``enqueue()`` joins the caller's transaction and wakes workers only on commit."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, func, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from sqla_queue import (
    EnqueueError,
    InvalidPayload,
    NotAQueueModel,
    QueueSession,
    enqueue,
    notify_on_commit,
    queue_table,
)

from .bad_values import COLUMN_SAMPLE, GOOD_PAYLOAD, GOOD_TEXT, OPTION_SAMPLE, row_values
from .helpers import SENTINEL_CHANNEL, Server, notifications_until_sentinel
from .models import EmailJob, InheritedJob, InheritedJobA, InheritedJobB, Order, ReportJob, Task

EMAIL_CHANNEL = queue_table(EmailJob).channel
TASK_CHANNEL = queue_table(Task).channel


@pytest.fixture
def Sessions(engine: Engine) -> sessionmaker[QueueSession]:
    return sessionmaker(engine, class_=QueueSession)


@pytest.fixture
def listening(listener: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    for channel in (EMAIL_CHANNEL, TASK_CHANNEL, queue_table(ReportJob).channel, SENTINEL_CHANNEL):
        listener.execute(f'LISTEN "{channel}"')
    return listener


def count(engine: Engine, model: Any) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(model)) or 0)


def test_commit_stores_job_with_business_row_and_notifies_once(
    Sessions: sessionmaker[QueueSession], engine: Engine, listening: Any, server: Server
) -> None:
    with Sessions() as session:
        order = Order(customer="ada")
        session.add(order)
        session.flush()
        for n in range(3):
            session.enqueue(EmailJob(order_id=order.id, recipient=f"ada{n}@example.com"))
        session.commit()
    assert count(engine, EmailJob) == 3 and count(engine, Order) == 1
    assert notifications_until_sentinel(listening, server.conninfo) == [(EMAIL_CHANNEL, "default")]


def test_rollback_leaves_no_job_and_no_notification(
    Sessions: sessionmaker[QueueSession], engine: Engine, listening: Any, server: Server
) -> None:
    with Sessions() as session:
        session.add(Order(customer="bob"))
        session.enqueue(EmailJob(recipient="bob@example.com"))
        session.flush()  # the INSERT reached the server...
        session.rollback()  # ...and is undone with the business row
    assert count(engine, EmailJob) == 0 and count(engine, Order) == 0
    assert notifications_until_sentinel(listening, server.conninfo) == []


def test_one_notification_per_table_and_queue(
    Sessions: sessionmaker[QueueSession], listening: Any, server: Server
) -> None:
    with Sessions() as session:
        session.enqueue(EmailJob(), queue="mail")
        session.enqueue(EmailJob(), queue="mail")
        session.enqueue(EmailJob(), queue="bulk")
        session.enqueue(Task(task="resize", payload={"w": 100}))
        session.commit()
    got = notifications_until_sentinel(listening, server.conninfo)
    assert sorted(got) == sorted(
        [(EMAIL_CHANNEL, "mail"), (EMAIL_CHANNEL, "bulk"), (TASK_CHANNEL, "default")]
    )


def test_plain_add_of_a_queue_object_also_notifies(
    Sessions: sessionmaker[QueueSession], listening: Any, server: Server
) -> None:
    with Sessions() as session:
        session.add(EmailJob(queue="added"))
        session.commit()  # no explicit flush: commit's own flush inserts it
    assert notifications_until_sentinel(listening, server.conninfo) == [(EMAIL_CHANNEL, "added")]


def test_enqueue_function_works_with_any_session(
    engine: Engine, listening: Any, server: Server
) -> None:
    with Session(engine) as session:
        job = enqueue(session, EmailJob(recipient="plain@example.com"), priority=5)
        session.commit()
        assert job.id is not None and job.priority == 5
    assert notifications_until_sentinel(listening, server.conninfo) == [(EMAIL_CHANNEL, "default")]
    with Session(engine) as session:  # the hooks of one session do not leak into another
        session.add(Order(customer="x"))
        session.commit()
    assert notifications_until_sentinel(listening, server.conninfo) == []


def test_savepoint_rollback_removes_the_job(
    Sessions: sessionmaker[QueueSession], engine: Engine, listening: Any, server: Server
) -> None:
    with Sessions() as session:
        session.add(Order(customer="kept"))
        with session.begin_nested() as savepoint:
            session.enqueue(EmailJob())
            session.flush()
            savepoint.rollback()
        session.commit()
    assert count(engine, EmailJob) == 0 and count(engine, Order) == 1


def test_notify_on_commit_for_core_inserts(
    Sessions: sessionmaker[QueueSession], listening: Any, server: Server
) -> None:
    with Sessions() as session:
        session.execute(insert(EmailJob), [{"queue": "core"}, {"queue": "core"}])
        notify_on_commit(session, EmailJob, "core")
        session.commit()
    assert notifications_until_sentinel(listening, server.conninfo) == [(EMAIL_CHANNEL, "core")]


def test_options_set_queue_priority_attempts_and_delay(
    Sessions: sessionmaker[QueueSession], engine: Engine
) -> None:
    with Sessions() as session:
        delayed = session.enqueue(EmailJob(), queue="later", priority=-3, max_attempts=2, delay=90)
        at = datetime(2030, 1, 1, tzinfo=UTC)
        scheduled = session.enqueue(EmailJob(), run_at=at)
        session.commit()
        now = session.scalar(select(func.now()))
        assert now is not None
        assert (delayed.queue, delayed.priority, delayed.max_attempts) == ("later", -3, 2)
        # the delay is measured by the database clock
        assert timedelta(seconds=89) < delayed.run_after - now <= timedelta(seconds=90)
        assert scheduled.run_after == at and scheduled.status == "pending"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"delay": -1}, "non-negative"),
        ({"delay": float("nan")}, "non-negative"),
        ({"delay": "soon"}, "seconds or a timedelta"),
        ({"run_at": datetime(2030, 1, 1)}, "timezone-aware"),
        ({"delay": 1, "run_at": datetime(2030, 1, 1, tzinfo=UTC)}, "either delay or run_at"),
        ({"priority": 2**40}, "32-bit"),
        ({"priority": "high"}, "32-bit"),
        ({"max_attempts": 0}, ">= 1"),
        ({"queue": ""}, "non-empty"),
        ({"queue": "sqla_queue.swept:mail"}, "which sqla_queue reserves"),
    ],
)
def test_bad_options_fail_before_anything_is_added(
    Sessions: sessionmaker[QueueSession], engine: Engine, options: dict[str, Any], message: str
) -> None:
    with Sessions() as session:
        session.add(Order(customer="still fine"))
        with pytest.raises(EnqueueError, match=message):
            session.enqueue(EmailJob(), **options)
        assert not any(isinstance(o, EmailJob) for o in session.new)
        session.commit()  # the caller's transaction is intact
    assert count(engine, Order) == 1 and count(engine, EmailJob) == 0


def test_unknown_option_is_a_type_error(Sessions: sessionmaker[QueueSession]) -> None:
    with Sessions() as session, pytest.raises(TypeError, match="prio"):
        session.enqueue(EmailJob(), prio=3)  # type: ignore[call-overload]


def test_not_a_queue_model(Sessions: sessionmaker[QueueSession]) -> None:
    with Sessions() as session:
        with pytest.raises(NotAQueueModel, match="Order"):
            session.enqueue(Order(customer="x"))
        with pytest.raises(NotAQueueModel):
            session.enqueue({"task": "x"})
        assert not session.new


@pytest.mark.parametrize(
    "payload", [{"when": datetime.now()}, {"x": float("nan")}, {"blob": b"bytes"}, {"s": {1, 2}}]
)
def test_payload_must_be_json(Sessions: sessionmaker[QueueSession], payload: dict[str, Any]) -> None:
    with Sessions() as session:
        with pytest.raises(InvalidPayload, match="payload is not JSON-serialisable"):
            session.enqueue(Task(task="t", payload=payload))
        assert not session.new


def test_task_needs_a_name(Sessions: sessionmaker[QueueSession]) -> None:
    with Sessions() as session, pytest.raises(EnqueueError, match="task name"):
        session.enqueue(Task(payload={}))


def test_managed_columns_and_persistent_jobs_are_refused(
    Sessions: sessionmaker[QueueSession],
) -> None:
    with Sessions() as session:
        with pytest.raises(EnqueueError, match="status"):
            session.enqueue(EmailJob(status="done"))
        with pytest.raises(EnqueueError, match="attempts"):
            session.enqueue(EmailJob(attempts=3))
        job = session.enqueue(EmailJob())
        session.commit()
        with pytest.raises(EnqueueError, match="already persistent"):
            session.enqueue(job)


def test_engine_json_serializer_is_respected(server: Server) -> None:
    from sqlalchemy import create_engine

    engine = create_engine(server.url, json_serializer=lambda v: __import__("json").dumps(v, default=str))
    try:
        with Session(engine) as session:
            enqueue(session, Task(task="t", payload={"when": datetime(2030, 1, 1)}))
            session.rollback()
    finally:
        engine.dispose()


def test_async_session_enqueue_notifies_on_commit(
    engine: Engine, listening: Any, server: Server
) -> None:
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    async def main() -> int:
        async_engine = create_async_engine(server.url)
        Sessions = async_sessionmaker(
            async_engine, sync_session_class=QueueSession, expire_on_commit=False
        )
        try:
            async with Sessions() as session:
                job = enqueue(session, EmailJob(recipient="async@example.com"), queue="async")
                await session.commit()
                return job.id
        finally:
            await async_engine.dispose()

    job_id = asyncio.run(main())
    assert job_id is not None and count(engine, EmailJob) == 1
    assert notifications_until_sentinel(listening, server.conninfo) == [(EMAIL_CHANNEL, "async")]


# -- one set of rules: values the database would refuse at commit ------------------------


@pytest.mark.parametrize(("model", "column", "value", "error", "message"), COLUMN_SAMPLE)
def test_bad_job_attributes_fail_before_anything_is_added(
    Sessions: sessionmaker[QueueSession],
    engine: Engine,
    model: Any,
    column: str,
    value: Any,
    error: type[Exception],
    message: str,
) -> None:
    with Sessions() as session:
        session.add(Order(customer="kept"))
        session.flush()
        job = model(**row_values(model, column, value))
        with pytest.raises(error, match=message) as raised:
            session.enqueue(job)
        assert type(raised.value) is error
        assert job not in session
        session.commit()  # the caller's transaction, and its business row, are intact
    assert count(engine, Order) == 1 and count(engine, model) == 0


@pytest.mark.parametrize(("options", "message"), OPTION_SAMPLE)
def test_bad_option_values_fail_before_anything_is_added(
    Sessions: sessionmaker[QueueSession], engine: Engine, options: dict[str, Any], message: str
) -> None:
    with Sessions() as session:
        session.add(Order(customer="kept"))
        session.flush()
        job = EmailJob()
        with pytest.raises(EnqueueError, match=message):
            session.enqueue(job, **options)
        assert job not in session
        session.commit()
    assert count(engine, Order) == 1 and count(engine, EmailJob) == 0


def test_text_and_json_near_the_rules_are_stored_as_given(
    Sessions: sessionmaker[QueueSession], engine: Engine
) -> None:
    """Surrogate pairs (non-BMP characters) and escaped-looking text are not refused."""
    with Sessions() as session:
        session.enqueue(EmailJob(recipient=GOOD_TEXT, queue="q" * 128))
        session.enqueue(Task(task="t" * 200, payload=GOOD_PAYLOAD))
        session.commit()
    with engine.connect() as conn:
        assert conn.scalar(select(EmailJob.recipient)) == GOOD_TEXT
        assert conn.scalar(select(Task.payload)) == GOOD_PAYLOAD


# -- NOTIFY only from the outermost commit -------------------------------------------------


def _failing_savepoint(session: QueueSession) -> None:
    """A SAVEPOINT whose flush fails (a duplicate primary key), caught as callers do."""
    existing = session.scalars(select(Order.id)).first()
    with pytest.raises(IntegrityError), session.begin_nested():
        session.add(Order(id=existing, customer="duplicate"))


def test_a_failed_savepoint_does_not_use_up_the_wake_up(
    Sessions: sessionmaker[QueueSession], engine: Engine, listening: Any, server: Server
) -> None:
    with Sessions() as session:
        session.add(Order(customer="first"))
        session.enqueue(EmailJob(), queue="before-savepoint")
        _failing_savepoint(session)
        session.commit()
    assert count(engine, EmailJob) == 1
    assert notifications_until_sentinel(listening, server.conninfo) == [
        (EMAIL_CHANNEL, "before-savepoint")
    ]


def test_a_committed_savepoint_and_its_commit_wake_once(
    Sessions: sessionmaker[QueueSession], listening: Any, server: Server
) -> None:
    with Sessions() as session:
        session.enqueue(EmailJob(), queue="outer")
        with session.begin_nested():
            session.enqueue(EmailJob(), queue="inner")
        session.commit()
    got = notifications_until_sentinel(listening, server.conninfo)
    assert sorted(got) == [(EMAIL_CHANNEL, "inner"), (EMAIL_CHANNEL, "outer")]


def test_commit_with_a_savepoint_still_open_wakes(
    Sessions: sessionmaker[QueueSession], engine: Engine, listening: Any, server: Server
) -> None:
    """The outermost commit runs the hook while the savepoint is still the current one."""
    with Sessions() as session, session.begin():
        session.enqueue(EmailJob(), queue="open-savepoint")
        session.begin_nested()
    assert count(engine, EmailJob) == 1
    assert notifications_until_sentinel(listening, server.conninfo) == [
        (EMAIL_CHANNEL, "open-savepoint")
    ]


def test_rollback_after_a_failed_savepoint_sends_nothing(
    Sessions: sessionmaker[QueueSession], engine: Engine, listening: Any, server: Server
) -> None:
    with Sessions() as session:
        session.add(Order(customer="first"))
        session.enqueue(EmailJob(), queue="rolled-back")
        _failing_savepoint(session)
        session.rollback()
    assert count(engine, EmailJob) == 0
    assert notifications_until_sentinel(listening, server.conninfo) == []


# -- delay: from the insert, in seconds ----------------------------------------------------


def test_delay_is_measured_from_the_insert(
    Sessions: sessionmaker[QueueSession], engine: Engine
) -> None:
    with Sessions() as session:
        session.execute(select(func.pg_sleep(1)))  # a transaction that waited 1 s
        before = session.scalar(select(func.clock_timestamp()))
        job = session.enqueue(EmailJob(), delay=2)
        session.flush()
        after = session.scalar(select(func.clock_timestamp()))
        started = session.scalar(select(func.now()))
        assert before is not None and after is not None and started is not None
        assert before + timedelta(seconds=2) <= job.run_after <= after + timedelta(seconds=2)
        # now() + 2 s, the transaction's start, would already be over
        assert job.run_after - started >= timedelta(seconds=3)
        session.rollback()


def test_single_table_inheritance_identities(Sessions: sessionmaker[QueueSession], engine: Engine) -> None:
    """The ORM writes a new instance's polymorphic identity; ``enqueue()`` refuses one
    naming another model, and gives a discriminator set to None the model's, as
    ``enqueue_many()`` and ``enqueue_values()`` do."""
    with Sessions() as session:
        with pytest.raises(EnqueueError, match=r"^InheritedJobA job: kind='b' is not a polymorphic identity of"):
            session.enqueue(InheritedJobA(kind="b"))
        with pytest.raises(EnqueueError, match="kind='c' is not a polymorphic identity of InheritedJob "):
            session.enqueue(InheritedJob(kind="c"))
        assert not session.new
        cleared = InheritedJobB()
        cleared.kind = None  # type: ignore[assignment]
        session.enqueue(cleared)
        session.enqueue(InheritedJob(kind="a"))
        session.enqueue(InheritedJobA())
        session.commit()
    with Session(engine) as session:
        loaded = session.scalars(select(InheritedJob).order_by(InheritedJob.id)).all()
        assert [type(job) for job in loaded] == [InheritedJobB, InheritedJobA, InheritedJobA]


def test_every_new_engine_wakes_workers_on_commit(engine: Engine, server: Server, listening: Any) -> None:
    """An engine made after another was dropped may sit at the dropped one's address; it
    must still get the commit hooks that send the wake-up (they were once remembered by
    ``id()``). Engines are made and dropped until one lands on an address seen before
    (within a few, with CPython's allocator), and that one must wake the workers too."""
    import gc

    from sqlalchemy import create_engine

    seen: set[int] = set()
    reused = False
    # Bounded in time as in rounds. Each round collects its engine's garbage; the objects of
    # the hundreds of tests this process ran before are frozen first (gc.freeze), out of
    # the collector's sight until the end, or each round would walk all of them (a second
    # a round on a loaded machine, which once ran out the time with no address reused).
    deadline = time.monotonic() + 45
    gc.collect()
    gc.freeze()
    try:
        for n in range(200):
            if time.monotonic() > deadline:
                break
            other = create_engine(server.url)
            reused = id(other) in seen
            seen.add(id(other))
            try:
                with Session(other) as session:
                    enqueue(session, EmailJob(recipient=f"engine{n}@example.com"))
                    session.commit()
            finally:
                other.dispose()
            del other
            gc.collect()
            if reused:
                break
    finally:
        gc.unfreeze()
    if not reused:  # not a pass: the case this test is for did not come up
        pytest.xfail(f"no engine of {n + 1} was made at a dropped one's address: the case was not tried")
    # One wake-up per engine's commit (each its own transaction, so none is folded).
    assert notifications_until_sentinel(listening, server.conninfo) == [(EMAIL_CHANNEL, "default")] * (n + 1)
