"""Timeouts: per job (enqueue), per task (registry), per worker; durable deadlines.

The deadline is set when a job is claimed and stored in its row; leases and heartbeats
never run past it, the completion is refused after it, and the sweeper ends an attempt
whose worker died before it. Past it the attempt fails (``timed out after N s``),
retried or dead-lettered by the usual rules.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import produce_migrations
from alembic.operations.ops import AddColumnOp
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, select, text
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker

from sqla_queue import (
    EnqueueError,
    JobMixin,
    QueueSession,
    Tasks,
    Worker,
    WorkerStartError,
    admin,
    current_job,
)
from sqla_queue.driver import Driver
from sqla_queue.ops import QueueOps
from sqla_queue.sql import ClaimToken

from . import test_cancel
from .helpers import wait_for, wait_for_counts
from .models import Effect, Task
from .test_cancel import enqueue
from .workers import job

#: The fixture of test_cancel: a started worker running a handler as given.
start = test_cancel.start


def test_one_task_timeout_is_found_too(engine: Engine) -> None:
    (job_id,) = enqueue(engine, task="timed")
    driver = Driver(engine)
    ops = QueueOps(driver, Task, lease=60.0, task_timeouts={"timed": 2.5})
    ops.check_table()
    conn = driver.connect("test")
    (found,) = ops.fetch_claimed(conn, ops.claim_request("w/0.0", 10))
    conn.close()
    assert (found.token.job_id, round(found.timeout or 0, 2)) == (job_id, 2.5)


def test_the_most_specific_timeout_wins(engine: Engine) -> None:
    """The job's own, else its task's, else the worker's; none: no deadline."""
    own = enqueue(engine, task="timed", timeout=1.5)[0]
    by_task = enqueue(engine, task="timed")[0]
    by_worker = enqueue(engine, task="other")[0]
    driver = Driver(engine)
    ops = QueueOps(driver, Task, lease=60.0, timeout=7.0, task_timeouts={"timed": 3.0})
    ops.check_table()
    conn = driver.connect("test")
    claimed = {c.token.job_id: c.timeout for c in ops.fetch_claimed(conn, ops.claim_request("w/0.0", 10))}
    assert {k: round(v or 0, 2) for k, v in claimed.items()} == {own: 1.5, by_task: 3.0, by_worker: 7.0}
    with engine.connect() as sa:
        for row in sa.execute(select(Task).where(Task.id.in_(claimed))):
            assert row.lease_expires_at <= row.deadline_at  # the lease never runs past it
    # The heartbeat extends no lease past the deadline.
    tokens = [ClaimToken(i, 1) for i in claimed]
    assert ops.extend_leases(conn, "w/", tokens) == set(tokens)
    with engine.connect() as sa:
        for row in sa.execute(select(Task).where(Task.id.in_(claimed))):
            assert row.lease_expires_at == row.deadline_at
    untimed = enqueue(engine, task="other")[0]
    plain = QueueOps(driver, Task, lease=60.0)
    plain.check_table()
    (found,) = plain.fetch_claimed(conn, plain.claim_request("w/0.1", 10))
    assert (found.token.job_id, found.timeout) == (untimed, None)
    conn.close()


def test_timeout_options_are_checked(engine: Engine) -> None:
    with sessionmaker(engine, class_=QueueSession)() as session:
        bad: Any
        for bad in (0, -1, float("nan"), "30", True):
            with pytest.raises(EnqueueError, match="timeout"):
                session.enqueue(Task(task="t"), timeout=bad)
    with pytest.raises(ValueError, match="timeout"):
        Worker.check_options(timeout=0)
    with pytest.raises(ValueError, match="timeout"):
        Tasks().register("t", lambda job: None, timeout=-1)
    assert main_parses_timeout()


def main_parses_timeout() -> bool:
    from sqla_queue.cli import build_parser, worker_overrides

    args = build_parser().parse_args(["worker", "x:y", "--timeout", "30s"])
    return worker_overrides(timeout=args.timeout) == {"timeout": 30.0}


@pytest.mark.parametrize("runtime", ["asyncio"], indirect=True)
def test_an_async_handler_past_its_deadline_is_cancelled(engine: Engine, start: Callable[..., Any]) -> None:
    seen: list[bool] = []

    async def handler(j: Any) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen.append(current_job().timed_out)
            raise

    (job_id,) = enqueue(engine, timeout=0.5, max_attempts=1)
    worker = start(handler, sweep_interval=60)  # the worker, not a sweep, ends it
    wait_for(lambda: job(engine, job_id).status == "failed", what="the attempt timed out")
    row = job(engine, job_id)
    assert (row.last_error, row.attempts, seen) == ("timed out after 0.5 s", 1, [True])
    wait_for(lambda: worker.stats.failed == 1)


def test_a_sync_handler_past_its_deadline_is_told_and_retried(engine: Engine, start: Callable[..., Any]) -> None:
    """The per-worker timeout; the attempt fails and is retried by the usual rules."""
    attempts: list[tuple[int, bool]] = []

    def handler(j: Any) -> None:
        context = current_job()
        if j.attempts == 1:
            context.wait(60)  # returns when told; then ignores it and returns normally
        attempts.append((j.attempts, context.timed_out))

    (job_id,) = enqueue(engine, max_attempts=3)
    worker = start(handler, timeout=0.5, sweep_interval=60)
    wait_for(lambda: job(engine, job_id).status == "done", what="the retry ran")
    assert attempts == [(1, True), (2, False)]
    assert job(engine, job_id).last_error == "timed out after 0.5 s"
    wait_for_counts(worker, retried=1, done=1)


def test_a_transactional_handler_past_its_deadline_commits_nothing(engine: Engine, start: Callable[..., Any]) -> None:
    def handler(j: Any, session: Session) -> None:
        session.add(Effect(job_id=j.id, worker="w"))
        current_job().wait(60)  # told at the deadline; ignores it

    tasks = Tasks()
    tasks.register("work", handler, timeout=0.4)  # the task's timeout
    (job_id,) = enqueue(engine, max_attempts=1)
    start(tasks, sweep_interval=60)
    wait_for(lambda: job(engine, job_id).status == "failed", what="the attempt timed out")
    assert job(engine, job_id).last_error == "timed out after 0.4 s"
    with engine.connect() as conn:
        assert conn.scalars(select(Effect).where(Effect.job_id == job_id)).all() == []


def test_a_stuck_thread_keeps_its_slot_and_its_completion_is_refused(
    engine: Engine, start: Callable[..., Any]
) -> None:
    """A plain handler that ignores the flag: logged as stuck, the sweeper ends the
    attempt at its deadline, and the worker claims nothing beyond its one slot until the
    thread returns."""
    release = threading.Event()
    ran: list[int] = []

    def handler(j: Any) -> None:
        ran.append(j.id)
        release.wait(60)  # ignores everything

    first = enqueue(engine, max_attempts=1, timeout=0.3)[0]
    worker = start(handler, concurrency=1)
    try:
        wait_for(lambda: job(engine, first).status == "failed", what="the sweeper ended the stuck attempt")
        assert job(engine, first).last_error.startswith("timed out after 0.3 s: worker ")
        wait_for(lambda: worker.stats.stuck == 1, what="the stuck thread logged")
        rounds = worker.listener.rounds
        second = enqueue(engine)[0]
        # The only slot is taken by the stuck thread: the job waits, though its NOTIFY
        # reached the worker (which would have claimed it at once otherwise).
        assert worker.listener.wait_rounds(rounds + 2, 10)
        assert job(engine, second).status == "pending" and len(worker.ledger.held()) == 1
    finally:
        release.set()
    wait_for(lambda: job(engine, second).status == "done", what="the slot freed")
    assert ran == [first, second]
    assert job(engine, first).status == "failed"  # its late return changed nothing
    wait_for_counts(worker, done=1)


def test_a_deadline_outlives_a_killed_worker(
    engine: Engine, worker_processes: Any, tmp_path: Path
) -> None:
    """SIGKILL while the job runs: no one extends its lease past its deadline, so the
    sweeper ends the attempt there, as timed out (not after the 60 s lease)."""
    marker = tmp_path / "started"
    with sessionmaker(engine, class_=QueueSession)() as session:
        row = session.enqueue(Task(task="stuck", payload={"started": str(marker)}), timeout=3, max_attempts=1)
        session.commit()
        job_id = row.id
    process = worker_processes("--sweep-interval", "60", "--lease", "60")
    wait_for(marker.exists, what="the job started")
    process.signal(signal.SIGKILL)
    process.wait(10)
    assert job(engine, job_id).status == "running"

    def swept() -> bool:
        admin.sweep(engine, Task)
        return bool(job(engine, job_id).status == "failed")

    wait_for(swept, timeout=30, interval=0.1, what="the sweeper ended the attempt at its deadline")
    row = job(engine, job_id)
    assert row.last_error.startswith("timed out after 3 s: worker ")
    assert (row.finished_at - row.started_at).total_seconds() < 60  # before the lease would have lapsed


class _Base(DeclarativeBase):
    pass


class UnmigratedJob(_Base, JobMixin):
    __tablename__ = "timeouts_unmigrated_jobs"


def test_an_unmigrated_table_is_refused_and_autogenerate_adds_the_columns(engine: Engine) -> None:
    """A table from before timeouts: the worker says to migrate; autogenerate writes it."""
    _Base.metadata.create_all(engine)
    try:
        with engine.begin() as conn:
            conn.execute(text(
                "ALTER TABLE timeouts_unmigrated_jobs DROP COLUMN timeout, DROP COLUMN started_at, "
                "DROP COLUMN deadline_at"
            ))
        with pytest.raises(WorkerStartError, match="lacks the columns timeout, started_at, deadline_at"):
            Worker(engine, UnmigratedJob, lambda job: None).start()
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"target_metadata": _Base.metadata})
            script = produce_migrations(context, _Base.metadata)
        assert script.upgrade_ops is not None
        added = sorted(
            op.column.name for group in script.upgrade_ops.ops for op in getattr(group, "ops", [group])
            if isinstance(op, AddColumnOp)
        )
        assert added == ["deadline_at", "started_at", "timeout"]
        assert all(op.column.nullable for group in script.upgrade_ops.ops for op in getattr(group, "ops", [group])
                   if isinstance(op, AddColumnOp))
    finally:
        _Base.metadata.drop_all(engine)
