"""The worker's hook point: observers see every claim, run start and end of a job, on a
thread of their own; a slow or failing observer never slows or breaks job processing; the
counters and the per-job log lines are fed from the same events.

Both runtimes (the ``runtime`` fixture), real PostgreSQL.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import sessionmaker

from sqla_queue import JobEvent, JobOutcome, QueueSession, Tasks, WorkerObserver

from .helpers import wait_for, wait_for_counts
from .models import Task
from .workers import add, job


class Recorder(WorkerObserver):
    """Every event, by kind, with the thread it was delivered on."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, JobEvent]] = []
        self.threads: set[str] = set()
        self.closed = False

    def _add(self, kind: str, event: JobEvent) -> None:
        with self.lock:
            self.events.append((kind, event))
            self.threads.add(threading.current_thread().name)

    def claimed(self, event: JobEvent) -> None:
        self._add("claimed", event)

    def started(self, event: JobEvent) -> None:
        self._add("started", event)

    def finished(self, event: JobEvent) -> None:
        self._add("finished", event)

    def close(self) -> None:
        self.closed = True

    def of(self, kind: str, job_id: int | None = None) -> list[JobEvent]:
        with self.lock:
            return [e for k, e in self.events if k == kind and (job_id is None or e.job_id == job_id)]

    def outcomes(self, job_id: int) -> list[tuple[int | None, JobOutcome | None]]:
        return [(e.attempt, e.outcome) for e in self.of("finished", job_id)]


def _status(engine: Engine, job_id: int) -> str:
    return str(job(engine, job_id).status)


def test_an_observer_sees_claim_start_and_each_outcome(
    engine: Engine, Sessions: sessionmaker[QueueSession], start_worker: Callable[..., Any]
) -> None:
    seen = Recorder()
    [done] = add(Sessions, "work", queue="mail")
    [flaky] = add(Sessions, "flaky", succeed_on=2)
    [poison] = add(Sessions, "poison")
    before = time.time()
    worker = start_worker(observers=[seen])
    wait_for(lambda: len(seen.of("finished")) >= 4, what="four ends")
    assert seen.outcomes(done) == [(1, JobOutcome.DONE)]
    assert seen.outcomes(flaky) == [(1, JobOutcome.RETRIED), (2, JobOutcome.DONE)]
    assert seen.outcomes(poison) == [(1, JobOutcome.FAILED)]
    [end] = seen.of("finished", done)
    assert end.table == "tasks" and end.queue == "mail" and end.task == "work"
    assert end.worker.startswith(worker.owner)
    assert end.run_time is not None and 0 <= end.run_time < 5
    assert end.started_at is not None and before - 1 < end.started_at < time.time() + 1
    latency = end.pickup_latency
    assert latency is not None and -1 < latency < 10  # two clocks: the database's, this host's
    retry = seen.of("finished", flaky)[0]
    assert retry.error.startswith("builtins.RuntimeError: flaky failure on attempt 1") and retry.delay is not None
    assert seen.of("finished", poison)[0].error == "DeadLetter: this input can never work"
    # Every job was claimed and started before it ended, once per attempt.
    assert sorted((e.job_id, e.attempt) for e in seen.of("claimed")) == sorted(
        [(done, 1), (flaky, 1), (flaky, 2), (poison, 1)]
    )
    assert sorted((e.job_id, e.attempt) for e in seen.of("started")) == sorted(
        (e.job_id, e.attempt) for e in seen.of("claimed")
    )
    assert all(e.outcome is None and e.run_time is None for e in seen.of("claimed"))
    # Delivered on the observer thread, never on an executor.
    assert seen.threads == {"sqla_queue-observers"}
    stats = worker.stats
    assert (stats.claimed, stats.done, stats.retried, stats.failed) == (4, 2, 1, 1)
    worker.stop(grace=1)
    assert seen.closed


def test_a_handed_back_job_is_released_and_a_swept_one_swept(
    engine: Engine, Sessions: sessionmaker[QueueSession], start_worker: Callable[..., Any], tmp_path: Any
) -> None:
    seen = Recorder()
    started = tmp_path / "started"
    [slow] = add(Sessions, "work", sleep=30, started=str(started))
    worker = start_worker(observers=[seen], shutdown_grace=0)
    wait_for(started.exists, what="the handler's start")
    worker.stop(grace=0)
    assert seen.outcomes(slow) == [(1, JobOutcome.RELEASED)]
    # A lease that expired (its worker gone): the sweeper of another worker returns it.
    with engine.begin() as conn:
        conn.execute(text("UPDATE tasks SET status = 'running', attempts = 1, lease_owner = 'gone:1/0.0', "
                          "lease_expires_at = now() - interval '1 minute' WHERE id = :id"), {"id": slow})
    sweeping = Recorder()
    start_worker(observers=[sweeping], queues=["elsewhere"], sweep_interval=0.05)
    [swept] = wait_for(lambda: sweeping.of("finished", slow), what="the sweep's event")
    assert (swept.outcome, swept.attempt, swept.queue, swept.task) == (JobOutcome.SWEPT, 1, "default", "work")
    assert swept.started_at is None and swept.run_time is None


def test_a_lost_lease_is_an_event(
    engine: Engine, Sessions: sessionmaker[QueueSession], start_worker: Callable[..., Any], tmp_path: Any
) -> None:
    seen = Recorder()
    started = tmp_path / "started"
    [slow] = add(Sessions, "work", sleep=1.0, started=str(started))
    worker = start_worker(observers=[seen], lease=3, heartbeat_interval=0.1)
    wait_for(started.exists, what="the handler's start")
    with engine.begin() as conn:  # someone else has it now
        conn.execute(text("UPDATE tasks SET lease_owner = 'thief' WHERE id = :id"), {"id": slow})
    [lost] = wait_for(lambda: seen.of("finished", slow), what="the loss")
    assert lost.outcome is JobOutcome.LOST and lost.attempt == 1
    wait_for(lambda: worker.stats.lost == 1, what="the counter")


class Slow(WorkerObserver):
    """Blocks on every event until released: a stuck metrics backend."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def finished(self, event: JobEvent) -> None:
        self.calls += 1
        self.release.wait(30)


class Raising(WorkerObserver):
    def claimed(self, event: JobEvent) -> None:
        raise RuntimeError("observer broken")

    def finished(self, event: JobEvent) -> None:
        raise ValueError("observer broken")


def test_a_slow_observer_never_slows_processing(
    engine: Engine, Sessions: sessionmaker[QueueSession], start_worker: Callable[..., Any]
) -> None:
    """The observer blocks on its first event until the test lets it go: every job is
    done meanwhile, and the events past the queue's bound are dropped and counted."""
    slow = Slow()
    ids = add(Sessions, "work", 40)
    worker = start_worker(observers=[slow], observer_queue_size=5)
    try:
        wait_for(lambda: all(_status(engine, i) == "done" for i in ids), what="every job done")
        assert slow.calls == 1  # still blocked on the first one
        wait_for(lambda: worker.stats.done == 40, what="the counter")
        assert worker.stats.hook_dropped >= 40 - 5 - 1
    finally:
        slow.release.set()


def test_a_failing_observer_never_breaks_processing(
    engine: Engine, Sessions: sessionmaker[QueueSession], start_worker: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen = Recorder()
    ids = add(Sessions, "work", 10)
    worker = start_worker(observers=[Raising(), seen])
    wait_for(lambda: all(_status(engine, i) == "done" for i in ids), what="every job done")
    wait_for(lambda: len(seen.of("finished")) == 10, what="the next observer's events")
    wait_for_counts(worker, done=10)
    wait_for(lambda: worker.stats.hook_errors == 20, what="each error counted")
    assert "observer Raising.finished raised ValueError: observer broken" in caplog.text


def test_observers_must_be_observers(engine: Engine, make_worker: Callable[..., Any]) -> None:
    with pytest.raises(TypeError, match="WorkerObserver"):
        make_worker(engine, Task, Tasks(), observers=[object()])


def test_one_observer_passed_alone_and_several(
    engine: Engine, Sessions: sessionmaker[QueueSession], start_worker: Callable[..., Any]
) -> None:
    one, two = Recorder(), Recorder()
    [first] = add(Sessions, "work", queue="one")
    start_worker(observers=one, queues=["one"])
    wait_for(lambda: one.of("finished", first), what="the lone observer's event")
    [second] = add(Sessions, "work", queue="other")
    start_worker(observers=[one, two], queues=["other"])
    wait_for(lambda: one.of("finished", second) and two.of("finished", second), what="both observers' events")


def test_with_options_keeps_the_observers(engine: Engine, make_worker: Callable[..., Any]) -> None:
    seen = Recorder()
    worker = make_worker(engine, Task, Tasks(), observers=[seen])
    assert worker.with_options(concurrency=2).observers == (seen,)


def test_one_debug_line_per_finished_job_with_structured_fields(
    engine: Engine, Sessions: sessionmaker[QueueSession], start_worker: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="sqla_queue.worker.jobs")
    [done] = add(Sessions, "work", queue="mail")
    [flaky] = add(Sessions, "flaky", succeed_on=2)
    start_worker()
    wait_for(lambda: _status(engine, done) == "done" and _status(engine, flaky) == "done", what="both done")
    wait_for(lambda: len([r for r in caplog.records if r.name == "sqla_queue.worker.jobs"]) >= 3, what="3 lines")
    lines = [r for r in caplog.records if r.name == "sqla_queue.worker.jobs"]
    by_job: dict[Any, list[logging.LogRecord]] = {}
    for r in lines:
        by_job.setdefault(r.__dict__["job_id"], []).append(r)
    [line] = by_job[done]
    assert line.levelno == logging.DEBUG and line.getMessage().startswith(f"job {done} attempt 1 done in ")
    fields = {k: line.__dict__[k] for k in ("table", "queue", "task", "attempt", "outcome")}
    assert fields == {"table": "tasks", "queue": "mail", "task": "work", "attempt": 1, "outcome": "done"}
    assert line.__dict__["run_time"] >= 0 and line.__dict__["pickup_latency"] is not None
    assert [(r.levelno, r.__dict__["outcome"]) for r in by_job[flaky]] == [
        (logging.WARNING, "retried"), (logging.DEBUG, "done"),
    ]


def test_without_debug_done_jobs_log_nothing(
    engine: Engine, Sessions: sessionmaker[QueueSession], start_worker: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sqla_queue.worker")
    ids = add(Sessions, "work", 3)
    start_worker()
    wait_for(lambda: all(_status(engine, i) == "done" for i in ids), what="every job done")
    assert not [r for r in caplog.records if r.name == "sqla_queue.worker.jobs"]


def test_a_snooze_is_an_outcome(
    engine: Engine, Sessions: sessionmaker[QueueSession], start_worker: Callable[..., Any]
) -> None:
    from sqla_queue import Snooze

    def handler(job: Any) -> None:
        if not job.payload.get("snoozed"):
            with Sessions() as session:  # the next run sees it
                session.execute(text("UPDATE tasks SET payload = '{\"snoozed\": true}' WHERE id = :id"),
                                {"id": job.id})
                session.commit()
            raise Snooze(0.1, "not ready")

    seen = Recorder()
    tasks = Tasks()
    tasks.register("later", handler)
    [snoozed] = add(Sessions, "later")
    worker = start_worker(tasks, observers=[seen])
    wait_for(lambda: len(seen.of("finished", snoozed)) == 2, what="the snooze and the run")
    first, second = seen.of("finished", snoozed)
    assert first.outcome is JobOutcome.SNOOZED and first.delay == pytest.approx(0.1)
    assert second.outcome is JobOutcome.DONE
    wait_for(lambda: worker.stats.snoozed == 1, what="the counter")
