"""Several workers in one process: ``Workers`` / ``AsyncWorkers`` and ``sqla-queue worker``
with several targets, one worker per table and one shutdown, on both runtimes."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, func, insert, select
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import DeclarativeBase

from sqla_queue import AsyncWorker, AsyncWorkers, JobMixin, Worker, Workers, WorkerStartError
from sqla_queue.cli import main

from .helpers import table_of, wait_for
from .models import Effect, EmailJob, Task
from .workers import FAST, asyncified

TASKS = table_of(Task)
JOBS = table_of(EmailJob)
EFFECTS = table_of(Effect)


def fill(engine: Engine, n: int = 5) -> None:
    with engine.begin() as conn:
        conn.execute(insert(TASKS).values(task="t", payload={}), [{}] * n)
        conn.execute(insert(JOBS).values(recipient="a@example.com"), [{}] * n)


def done(engine: Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        tasks = conn.scalar(select(func.count()).where(TASKS.c.status == "done"))
        jobs = conn.scalar(select(func.count()).where(JOBS.c.status == "done"))
    return int(tasks or 0), int(jobs or 0)


def handler(job: Any) -> None:
    return None


class Missing(DeclarativeBase):
    pass


class MissingJob(Missing, JobMixin):
    """A queue table never created: its worker cannot start."""

    __tablename__ = "missing_jobs"


def test_a_group_of_thread_workers_serves_every_table_until_idle(engine: Engine) -> None:
    fill(engine)
    group = Workers([Worker(engine, Task, handler, backoff=FAST), Worker(engine, EmailJob, handler, backoff=FAST)])
    group.run(install_signal_handlers=False, until_idle=True)
    assert done(engine) == (5, 5)
    assert all(w.stopped for w in group.workers)


def test_a_group_of_async_workers_serves_every_table_until_idle(engine: Engine) -> None:
    fill(engine)

    async def run() -> tuple[AsyncWorker, ...]:
        async_engine = create_async_engine(engine.url)
        try:
            group = AsyncWorkers([AsyncWorker(async_engine, Task, asyncified(handler)),
                                  AsyncWorker(async_engine, EmailJob, asyncified(handler))])
            await group.run(install_signal_handlers=False, until_idle=True)
            return group.workers
        finally:
            await async_engine.dispose()

    workers = asyncio.run(run())
    assert done(engine) == (5, 5) and all(w.stopped for w in workers)


def test_a_worker_that_cannot_start_stops_the_group(engine: Engine) -> None:
    good = Worker(engine, Task, handler)
    group = Workers([good, Worker(engine, MissingJob, handler)])
    with pytest.raises(WorkerStartError, match="missing_jobs"):
        group.start()
    assert good.stopped

    async def run() -> AsyncWorker:
        async_engine = create_async_engine(engine.url)
        try:
            fine = AsyncWorker(async_engine, Task, asyncified(handler))
            with pytest.raises(WorkerStartError, match="missing_jobs"):
                await AsyncWorkers([fine, AsyncWorker(async_engine, MissingJob, handler)]).run(
                    install_signal_handlers=False)
            return fine
        finally:
            await async_engine.dispose()

    assert asyncio.run(run()).stopped


def test_a_group_is_of_one_kind_and_each_worker_once(engine: Engine) -> None:
    worker = Worker(engine, Task, handler)
    with pytest.raises(ValueError, match="at least one"):
        Workers([])
    with pytest.raises(ValueError, match="twice"):
        Workers([worker, worker])
    with pytest.raises(TypeError, match="group thread Workers with Workers"):
        AsyncWorkers([worker])  # type: ignore[list-item]


def test_the_command_refuses_one_table_twice(capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Refused before any connection: the targets' engines need a URL, never a server.
    monkeypatch.setenv("SQLA_QUEUE_TEST_URL", "postgresql+psycopg://nobody@127.0.0.1:9/none")
    assert main(["worker", "tests.worker_app:make_worker", "tests.worker_app:make_worker"]) == 2
    assert "two targets serve the same table" in capsys.readouterr().err


@pytest.mark.system
def test_one_process_serves_two_tables_and_stops_both_on_sigterm(
    engine: Engine, worker_processes: Any, tmp_path: Path
) -> None:
    with engine.begin() as conn:
        conn.execute(insert(TASKS).values(task="record", payload={}), [{}] * 4)
        conn.execute(insert(JOBS).values(recipient="bo@example.com"), [{}] * 4)
    worker = worker_processes("tests.worker_app:make_email_worker", "--concurrency", "2", "--poll-interval", "0.5s")
    wait_for(lambda: done(engine) == (4, 4), timeout=30)
    with engine.connect() as conn:
        notes = sorted(conn.scalars(select(EFFECTS.c.note)))
    assert notes.count("bo@example.com") == 4 and notes.count("attempt 1") == 4
    log = worker.log()
    assert "table=tasks" in log and "table=email_jobs" in log and log.count("concurrency=2") == 2
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    wait_for(lambda: worker.log().count(" stopped: ") == 2, timeout=5, what="both workers' stop lines")
