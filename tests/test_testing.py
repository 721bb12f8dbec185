"""sqla_queue.testing, used as a user's test suite would use it, on the real table."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker

from sqla_queue import AsyncQueueSession, Backoff, QueueSession, Tasks, enqueue_values
from sqla_queue.testing import (
    aassert_enqueued,
    aassert_not_enqueued,
    aenqueued,
    arun_until_idle,
    assert_enqueued,
    assert_not_enqueued,
    enqueued,
    run_until_idle,
)

from .models import EmailJob, Order, Task


def _sessions(engine: Engine) -> sessionmaker[QueueSession]:
    return sessionmaker(engine, class_=QueueSession, expire_on_commit=False)


def test_enqueued_sees_the_session_s_own_uncommitted_jobs_and_only_matching_ones(engine: Engine) -> None:
    with _sessions(engine)() as session:
        session.enqueue(EmailJob(recipient="ada@example.com"), queue="mail")
        session.enqueue(EmailJob(recipient="bob@example.com"), queue="mail")
        session.enqueue(EmailJob(recipient="ada@example.com"), queue="other")
        found = enqueued(session, EmailJob, recipient="ada@example.com", queue="mail")
        assert [(j.recipient, j.queue) for j in found] == [("ada@example.com", "mail")]
        assert len(enqueued(session, EmailJob)) == 3
        # Another connection sees nothing before the commit.
        assert enqueued(engine, EmailJob) == []
        session.commit()
    assert len(enqueued(engine, EmailJob, recipient="ada@example.com")) == 2


def test_enqueued_on_a_connection_sees_its_transaction(engine: Engine) -> None:
    with engine.connect() as conn:
        enqueue_values(conn, EmailJob, {"recipient": "c@example.com"}, queue="q")
        (job,) = enqueued(conn, EmailJob, queue="q")
        assert job.recipient == "c@example.com"
        conn.rollback()
        assert enqueued(conn, EmailJob) == []


def test_assert_enqueued_returns_the_jobs_and_checks_the_count(engine: Engine) -> None:
    with _sessions(engine)() as session:
        for _ in range(2):
            session.enqueue(EmailJob(recipient="ada@example.com"))
        jobs = assert_enqueued(session, EmailJob, recipient="ada@example.com", count=2)
        assert len(jobs) == 2
        with pytest.raises(AssertionError, match=r"expected 1 job\(s\).*found 2"):
            assert_enqueued(session, EmailJob, recipient="ada@example.com", count=1)


def test_assert_enqueued_failure_shows_what_the_table_holds(engine: Engine) -> None:
    with _sessions(engine)() as session:
        session.enqueue(EmailJob(recipient="ada@example.com"), queue="mail")
        with pytest.raises(AssertionError) as failure:
            assert_enqueued(session, EmailJob, recipient="ada@example.com", queue="mails")
    message = str(failure.value)
    assert "queue='mails'" in message
    assert "holds 1 pending job(s)" in message
    assert "queue='mail'" in message and "recipient='ada@example.com'" in message


def test_assert_not_enqueued(engine: Engine) -> None:
    with _sessions(engine)() as session:
        session.enqueue(EmailJob(recipient="ada@example.com"))
        assert_not_enqueued(session, EmailJob, recipient="bob@example.com")
        with pytest.raises(AssertionError, match="expected no job"):
            assert_not_enqueued(session, EmailJob, recipient="ada@example.com")


def test_status_filters_and_unknown_columns(engine: Engine) -> None:
    with _sessions(engine)() as session:
        session.enqueue(EmailJob(recipient="ada@example.com"))
        session.commit()
    assert enqueued(engine, EmailJob, status="done") == []
    assert len(enqueued(engine, EmailJob, status=None)) == 1
    with pytest.raises(TypeError, match="no column"):
        enqueued(engine, EmailJob, recipent="typo@example.com")


def test_task_tables_match_on_task_and_payload(engine: Engine) -> None:
    with _sessions(engine)() as session:
        session.enqueue(Task(task="mail", payload={"to": "ada"}))
        session.enqueue(Task(task="mail", payload={"to": "bob"}))
        (job,) = assert_enqueued(session, Task, task="mail", payload={"to": "bob"})
        assert job.payload == {"to": "bob"}


def test_run_until_idle_runs_every_job_and_returns_the_stats(engine: Engine) -> None:
    with _sessions(engine)() as session:
        for n in range(5):
            session.enqueue(EmailJob(recipient=f"{n}@example.com"))
        session.commit()
    seen: list[str] = []
    stats = run_until_idle(engine, EmailJob, lambda job: seen.append(job.recipient))
    assert (stats.done, stats.failed) == (5, 0)
    assert sorted(seen) == sorted(f"{n}@example.com" for n in range(5))
    assert enqueued(engine, EmailJob) == []
    assert len(enqueued(engine, EmailJob, status="done")) == 5


def test_run_until_idle_runs_follow_ups_a_handler_enqueues(engine: Engine) -> None:
    with Session(engine) as plain:
        plain.add(Order(id=1, customer="ada"))
        plain.commit()
    with _sessions(engine)() as session:
        session.enqueue(EmailJob(recipient="first@example.com", order_id=1))
        session.commit()

    def handler(job: EmailJob, session: QueueSession) -> None:
        if job.recipient == "first@example.com":
            session.enqueue(EmailJob(recipient="second@example.com", order_id=1))

    stats = run_until_idle(engine, EmailJob, handler)
    assert stats.done == 2
    with Session(engine) as check:
        assert sorted(check.scalars(select(EmailJob.recipient).where(EmailJob.status == "done"))) == [
            "first@example.com", "second@example.com"
        ]


def test_run_until_idle_with_an_immediate_backoff_retries_to_the_dead_letter(engine: Engine) -> None:
    with _sessions(engine)() as session:
        session.enqueue(EmailJob(recipient="x@example.com"), max_attempts=3)
        session.commit()

    def always_fails(job: EmailJob) -> None:
        raise RuntimeError("upstream says no")

    stats = run_until_idle(engine, EmailJob, always_fails, backoff=Backoff(base=0.0, jitter=0.0))
    assert (stats.retried, stats.failed) == (2, 1)
    (job,) = enqueued(engine, EmailJob, status="failed")
    assert "upstream says no" in (job.last_error or "")


def test_run_until_idle_leaves_a_later_retry_pending(engine: Engine) -> None:
    with _sessions(engine)() as session:
        session.enqueue(EmailJob(recipient="x@example.com"), max_attempts=3)
        session.commit()

    def fails(job: EmailJob) -> None:
        raise RuntimeError("later")

    # A retry a minute away (the default backoff's first is about a second away, which a
    # loaded machine can reach before the run is idle).
    stats = run_until_idle(engine, EmailJob, fails, backoff=Backoff(base=60.0, jitter=0.0))
    assert (stats.retried, stats.failed, stats.done) == (1, 0, 0)
    (job,) = assert_enqueued(engine, EmailJob)
    assert job.attempts == 1


def test_arun_until_idle_runs_async_handlers(server: Any, engine: Engine) -> None:
    tasks = Tasks()
    seen: list[Any] = []

    @tasks.task
    async def greet(job: Task) -> None:
        await asyncio.sleep(0)
        seen.append(job.payload["name"])

    with _sessions(engine)() as session:
        for name in ("ada", "bob"):
            session.enqueue(Task(task="greet", payload={"name": name}))
        session.commit()

    async def main() -> Any:
        aengine = create_async_engine(server.url)
        try:
            return await arun_until_idle(aengine, Task, tasks)
        finally:
            await aengine.dispose()

    stats = asyncio.run(main())
    assert stats.done == 2
    assert sorted(seen) == ["ada", "bob"]


# -- async apps: AsyncEngine, AsyncSession, AsyncConnection ---------------------------------


def _async_engine(server: Any) -> AsyncEngine:
    return create_async_engine(server.url)


def test_the_sync_helpers_read_an_async_engine_and_its_sync_engine(server: Any, engine: Engine) -> None:
    """A test driving an async app with a synchronous client holds its AsyncEngine."""
    with _sessions(engine)() as session:
        session.enqueue(EmailJob(recipient="ada@example.com"), queue="mail")
        session.commit()
    aengine = _async_engine(server)
    try:
        for source in (aengine, aengine.sync_engine):
            (job,) = assert_enqueued(source, EmailJob, recipient="ada@example.com", queue="mail")
            assert job.recipient == "ada@example.com"
            assert [j.queue for j in enqueued(source, EmailJob)] == ["mail"]
            assert_not_enqueued(source, EmailJob, recipient="bob@example.com")
            with pytest.raises(AssertionError, match=r"expected a job .* recipient='bob@example.com'"):
                assert_enqueued(source, EmailJob, recipient="bob@example.com")
    finally:
        asyncio.run(aengine.dispose())


def test_the_awaited_helpers_read_an_async_session_s_uncommitted_jobs(server: Any, engine: Engine) -> None:
    async def main() -> None:
        aengine = _async_engine(server)
        try:
            Sessions = async_sessionmaker(aengine, class_=AsyncQueueSession, expire_on_commit=False)
            async with Sessions() as session:
                session.enqueue(EmailJob(recipient="ada@example.com"), queue="mail")
                # Seen before the commit, on the session's own connection; not elsewhere.
                (job,) = await aassert_enqueued(session, EmailJob, recipient="ada@example.com", count=1)
                assert (job.recipient, job.queue) == ("ada@example.com", "mail")
                await aassert_not_enqueued(aengine, EmailJob)
                with pytest.raises(AssertionError, match="found 0; the table holds 1 pending job"):
                    await aassert_enqueued(session, EmailJob, queue="other")
                await session.commit()
            assert [j.recipient for j in await aenqueued(aengine, EmailJob)] == ["ada@example.com"]
            async with aengine.connect() as conn:
                assert len(await aenqueued(conn, EmailJob, queue="mail")) == 1
                await aassert_not_enqueued(conn, EmailJob, status="done")
        finally:
            await aengine.dispose()

    asyncio.run(main())
    assert_enqueued(engine, EmailJob, recipient="ada@example.com")


def test_async_sources_given_to_the_wrong_helper_say_which_to_use(server: Any, engine: Engine) -> None:
    async def main() -> None:
        aengine = _async_engine(server)
        try:
            async with AsyncSession(aengine) as session:
                with pytest.raises(TypeError, match=r"await sqla_queue.testing.aassert_enqueued\(\.\.\.\)"):
                    assert_enqueued(session, EmailJob)  # type: ignore[arg-type]
                with pytest.raises(TypeError, match=r"sync_session of an AsyncSession.*aenqueued"):
                    enqueued(session.sync_session, EmailJob)
            async with aengine.connect() as conn:
                with pytest.raises(TypeError, match=r"AsyncConnection.*aassert_not_enqueued"):
                    assert_not_enqueued(conn, EmailJob)  # type: ignore[arg-type]
                with pytest.raises(TypeError, match=r"sync_connection of an AsyncConnection"):
                    enqueued(conn.sync_connection, EmailJob)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match=r"sqla_queue.testing.aenqueued\(\) reads an AsyncSession.*enqueued"):
                await aenqueued(engine, EmailJob)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match=r"arun_until_idle\(async_engine"):
                run_until_idle(aengine, EmailJob, lambda job: None)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match=r"arun_until_idle\(async_engine"):
                run_until_idle(aengine.sync_engine, EmailJob, lambda job: None)
            with pytest.raises(TypeError, match=r"arun_until_idle\(\) runs an AsyncWorker, which needs an AsyncEngine"):
                await arun_until_idle(engine, EmailJob, lambda job: None)  # type: ignore[arg-type]
        finally:
            await aengine.dispose()

    asyncio.run(main())
