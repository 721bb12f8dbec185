"""``__queue_wake__ = "after_commit"``: the wake-up is sent after the enqueuing commit, by
the process's waker, never inside the caller's transaction, and only if it committed."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, String, func, select, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from sqla_queue import AsyncQueueSession, JobMixin, QueueSession, enqueue_many, enqueue_values, queue_table
from sqla_queue.enqueue import waker

from .helpers import SENTINEL_CHANNEL, Server, wait_for
from .models import Order, WakeAfterJob
from .workers import async_engine_like

CHANNEL = queue_table(WakeAfterJob).channel


@pytest.fixture
def listening(listener: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    for channel in (CHANNEL, SENTINEL_CHANNEL):
        listener.execute(f'LISTEN "{channel}"')
    return listener


def woken(listen_conn: psycopg.Connection[Any], conninfo: str) -> list[tuple[str, int]]:
    """The (queue, sender's backend pid) wake-ups on CHANNEL once the waker sent all it
    was handed (its flush), up to a sentinel sent after that: what came, and from whom."""
    import uuid

    assert waker.flush(10.0), "the waker did not send within 10 s"
    token = uuid.uuid4().hex
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("SELECT pg_notify(%s, %s)", (SENTINEL_CHANNEL, token))
    got: list[tuple[str, int]] = []
    for note in listen_conn.notifies(timeout=10.0):
        if note.channel == SENTINEL_CHANNEL and note.payload == token:
            return got
        if note.channel == CHANNEL:
            got.append((note.payload, note.pid))
    raise AssertionError(f"sentinel not received; got {got}")


def backend_pid(session: Session) -> int:
    return int(session.execute(text("SELECT pg_backend_pid()")).scalar_one())


def test_the_wake_up_comes_after_the_commit_from_another_backend(
    engine: Engine, listening: Any, server: Server
) -> None:
    with QueueSession(engine) as session:
        order = Order(customer="ada")
        session.add(order)
        session.flush()
        session.enqueue(WakeAfterJob(order_id=order.id), queue="mail")
        session.enqueue(WakeAfterJob(order_id=order.id), queue="bulk")
        mine = backend_pid(session)
        session.commit()
    got = woken(listening, server.conninfo)
    assert sorted(q for q, _ in got) == ["bulk", "mail"]
    assert all(pid != mine for _, pid in got), "the wake-up was sent in the caller's transaction"
    with engine.connect() as conn:
        assert conn.scalar(select(func.count()).select_from(WakeAfterJob)) == 2


def test_a_rollback_wakes_nobody(engine: Engine, listening: Any, server: Server) -> None:
    with QueueSession(engine) as session:
        session.enqueue(WakeAfterJob(), queue="mail")
        session.flush()
        session.rollback()
    with engine.connect() as conn:
        enqueue_values(conn, WakeAfterJob, {"queue": "values"})
        conn.rollback()
    assert woken(listening, server.conninfo) == []
    with engine.connect() as conn:
        assert conn.scalar(select(func.count()).select_from(WakeAfterJob)) == 0


def test_a_table_at_the_default_still_wakes_in_the_commit(engine: Engine, listening: Any, server: Server) -> None:
    """Two tables in one transaction: each wakes its own way."""
    from .models import EmailJob

    email_channel = queue_table(EmailJob).channel
    listening.execute(f'LISTEN "{email_channel}"')
    with QueueSession(engine) as session:
        session.enqueue(WakeAfterJob(), queue="after")
        session.enqueue(EmailJob(), queue="with")
        mine = backend_pid(session)
        session.commit()
    assert waker.flush(10.0)
    senders: dict[str, int] = {}
    with psycopg.connect(server.conninfo, autocommit=True) as conn:
        conn.execute("SELECT pg_notify(%s, 'end')", (SENTINEL_CHANNEL,))
    for note in listening.notifies(timeout=10.0):
        if note.channel == SENTINEL_CHANNEL:
            break
        senders[note.payload] = note.pid
    assert senders["with"] == mine and senders["after"] != mine


def test_enqueue_values_and_enqueue_many_wake_after_their_commit(
    engine: Engine, listening: Any, server: Server
) -> None:
    with QueueSession(engine) as session:
        enqueue_values(session, WakeAfterJob, {"queue": "values-session"})
        enqueue_many(session, WakeAfterJob, [{"queue": "many"}])
        session.commit()
    with engine.connect() as conn:
        enqueue_values(conn, WakeAfterJob, {"queue": "values-connection"})
        conn.commit()
    with engine.connect() as conn:
        enqueue_values(conn, WakeAfterJob, {"queue": "values-rolled-back"})
        conn.rollback()
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        enqueue_values(conn, WakeAfterJob, {"queue": "values-autocommit"})  # committed by itself
    got = sorted(q for q, _ in woken(listening, server.conninfo))
    assert got == ["many", "values-autocommit", "values-connection", "values-session"]


def test_async_sessions_wake_after_their_commit(engine: Engine, listening: Any, server: Server) -> None:
    async def main() -> int:
        async_engine = async_engine_like(engine)
        try:
            async with AsyncQueueSession(async_engine) as session:
                session.enqueue(WakeAfterJob(), queue="async-enqueue")
                await enqueue_values(session, WakeAfterJob, {"queue": "async-values"})
                mine = int((await session.execute(text("SELECT pg_backend_pid()"))).scalar_one())
                await session.commit()
            async with AsyncSession(async_engine) as session:
                await enqueue_values(session, WakeAfterJob, {"queue": "async-rolled-back"})
                await session.rollback()
            return mine
        finally:
            await async_engine.dispose()

    mine = asyncio.run(main())
    got = woken(listening, server.conninfo)
    assert sorted(q for q, _ in got) == ["async-enqueue", "async-values"]
    assert all(pid != mine for _, pid in got)


def test_many_writers_at_once_wake_every_queue(engine: Engine, listening: Any, server: Server) -> None:
    """16 threads committing at once, a queue each: every queue is woken, after its
    commits, with no failure; the waker may fold them into fewer sends."""
    failures = waker.failures()
    start = threading.Barrier(16)
    errors: list[BaseException] = []

    def write(n: int) -> None:
        try:
            start.wait()
            for _ in range(10):
                with QueueSession(engine) as session:
                    session.enqueue(WakeAfterJob(), queue=f"q{n}")
                    session.commit()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    got = woken(listening, server.conninfo)
    assert {q for q, _ in got} == {f"q{n}" for n in range(16)}
    assert len(got) <= 160
    assert waker.failures() == failures


def test_a_send_that_fails_is_logged_and_the_next_commit_wakes_again(
    engine: Engine, listening: Any, server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    """The waker's connection killed under it: the caller's commits never see it; the
    wake-up is given up (the poll covers it), counted and logged; later ones get through."""
    with QueueSession(engine) as session:
        session.enqueue(WakeAfterJob(), queue="first")
        session.commit()
    ((_, sender),) = woken(listening, server.conninfo)
    with psycopg.connect(server.conninfo, autocommit=True) as raw:  # the waker's own backend
        raw.execute("SELECT pg_terminate_backend(%s)", (sender,))
    failures = waker.failures()
    with caplog.at_level(logging.WARNING, logger="sqla_queue.waker"):
        with QueueSession(engine) as session:
            session.enqueue(WakeAfterJob(), queue="lost")
            session.commit()  # no error here: the send is the waker's
        assert waker.flush(10.0)
    assert waker.failures() == failures + 1
    assert any("not sent" in r.getMessage() for r in caplog.records)
    woken(listening, server.conninfo)  # drain

    def wakes_again() -> bool:
        with QueueSession(engine) as session:
            session.enqueue(WakeAfterJob(), queue="again")
            session.commit()
        return "again" in [q for q, _ in woken(listening, server.conninfo)]

    wait_for(wakes_again, timeout=10.0, interval=0.2, what="a wake-up after the failed one")
    with engine.connect() as conn:
        assert (conn.scalar(select(func.count()).select_from(WakeAfterJob)) or 0) >= 3


def test_a_worker_picks_the_jobs_up_without_waiting_for_its_poll(engine: Engine, start_worker: Any) -> None:
    """On both runtimes: once the worker is idle (a first job done, its queue empty), a
    job of an after-commit table starts long before its 60 s poll would find it."""
    ran: list[int] = []
    each = threading.Semaphore(0)

    def handler(job: Any) -> None:
        ran.append(job.id)
        each.release()

    start_worker(handler=handler, model=WakeAfterJob, poll_interval=60)
    Sessions = sessionmaker(engine, class_=QueueSession)
    for n in range(2):  # the first proves the worker up; the second finds it idle
        with Sessions() as session:
            job = session.enqueue(WakeAfterJob())
            session.flush()
            job_id = job.id
            session.commit()
        assert each.acquire(timeout=10.0), f"job {n} waited for the worker's 60 s poll"
        assert ran[-1] == job_id


def test_an_unknown_wake_mode_is_refused_at_class_creation() -> None:
    class Base(DeclarativeBase):
        pass

    wanted = "__queue_wake__ must be one of 'with_commit', 'after_commit', 'none', got 'later'"
    with pytest.raises(ValueError, match=wanted):

        class Wrong(Base, JobMixin):
            __tablename__ = "wrong_wake_jobs"
            __queue_wake__ = "later"
            note: Mapped[str] = mapped_column(String(10), default="")


def test_a_table_that_wakes_nobody_sends_no_notify(engine: Engine, listener: Any, server: Server) -> None:
    """``__queue_wake__ = "none"``: the jobs are written, no NOTIFY at all (the poll finds them)."""

    class Base(DeclarativeBase):
        pass

    class Polled(Base, JobMixin):
        __tablename__ = "polled_only_jobs"
        __queue_wake__ = "none"
        note: Mapped[str] = mapped_column(String(10), default="")

    channel = queue_table(Polled).channel
    listener.execute(f'LISTEN "{channel}"')
    listener.execute(f'LISTEN "{SENTINEL_CHANNEL}"')
    Base.metadata.create_all(engine)
    try:
        with QueueSession(engine) as session:
            session.enqueue(Polled())
            enqueue_values(session, Polled, {"note": "values"})
            session.commit()
        assert waker.flush(10.0)
        with psycopg.connect(server.conninfo, autocommit=True) as raw:
            raw.execute("SELECT pg_notify(%s, 'end')", (SENTINEL_CHANNEL,))
        notes = []
        for note in listener.notifies(timeout=10.0):
            if note.channel == SENTINEL_CHANNEL:
                break
            notes.append(note)
        assert notes == []
        with engine.connect() as conn:
            assert conn.scalar(select(func.count()).select_from(Polled)) == 2
    finally:
        Base.metadata.drop_all(engine)


def test_a_translated_schema_wakes_its_own_channel_after_the_commit(
    engine: Engine, listener: Any, server: Server
) -> None:
    """With ``schema_translate_map``, the after-commit wake-up goes to the translated
    table's channel, from the waker, for every path (two queues in one commit: one send
    carrying both)."""

    class Base(DeclarativeBase):
        pass

    class TenantJob(Base, JobMixin):
        __tablename__ = "tenant_wake_jobs"
        __queue_wake__ = "after_commit"
        note: Mapped[str] = mapped_column(String(10), default="")

    from sqla_queue.model import notify_channel

    tenant = engine.execution_options(schema_translate_map={None: "tenant_wake"})
    translated = notify_channel(queue_table(TenantJob).table, {None: "tenant_wake"})
    untranslated = queue_table(TenantJob).channel
    assert translated != untranslated
    for name in (translated, untranslated, SENTINEL_CHANNEL):
        listener.execute(f'LISTEN "{name}"')
    with engine.begin() as conn:
        conn.execute(text("DROP SCHEMA IF EXISTS tenant_wake CASCADE"))
        conn.execute(text("CREATE SCHEMA tenant_wake"))
    Base.metadata.create_all(tenant)
    try:
        with QueueSession(tenant) as session:
            session.enqueue(TenantJob(), queue="orm-a")
            session.enqueue(TenantJob(), queue="orm-b")
            mine = backend_pid(session)
            session.commit()
        with tenant.connect() as conn:
            enqueue_values(conn, TenantJob, {"note": "v"}, queue="values")
            conn.commit()
        assert waker.flush(10.0)
        with psycopg.connect(server.conninfo, autocommit=True) as raw:
            raw.execute("SELECT pg_notify(%s, 'end')", (SENTINEL_CHANNEL,))
        got = []
        for note in listener.notifies(timeout=10.0):
            if note.channel == SENTINEL_CHANNEL:
                break
            got.append((note.channel, note.payload, note.pid))
        assert sorted((c, q) for c, q, _ in got) == [(translated, "orm-a"), (translated, "orm-b"),
                                                     (translated, "values")]
        assert all(pid != mine for _, _, pid in got)
        with tenant.connect() as conn:
            assert conn.scalar(select(func.count()).select_from(TenantJob)) == 3
    finally:
        with engine.begin() as conn:
            conn.execute(text("DROP SCHEMA IF EXISTS tenant_wake CASCADE"))
