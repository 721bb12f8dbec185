"""``raise Snooze(seconds)``: the job runs again later without spending an attempt, logged
at INFO; a transactional handler's writes are rolled back with it. Both runtimes, real
PostgreSQL."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from sqla_queue import Snooze, Tasks

from .helpers import wait_for, wait_for_counts
from .models import Effect
from .workers import add, effects, job


class Runs:
    """(attempt, wall time) of every run of each job."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: dict[int, list[tuple[int, float]]] = {}

    def __call__(self, job: Any) -> int:
        with self.lock:
            runs = self.seen.setdefault(job.id, [])
            runs.append((job.attempts, time.monotonic()))
            return len(runs)


def test_snooze_runs_the_job_again_later_without_spending_an_attempt(
    engine: Engine, Sessions: Any, start_worker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sqla_queue.worker")
    runs = Runs()
    tasks = Tasks()
    delay = 0.3

    @tasks.task
    def poll(job: Any) -> None:
        if runs(job) <= 3:
            raise Snooze(timedelta(seconds=delay) if job.payload.get("as_timedelta") else delay, "not ready yet")

    worker = start_worker(tasks)
    # max_attempts=1: a snooze that spent the attempt would dead-letter the job at once.
    ids = add(Sessions, "poll", max_attempts=1) + add(Sessions, "poll", max_attempts=1, as_timedelta=True)
    wait_for(lambda: all(job(engine, i).status == "done" for i in ids), timeout=30, what="both jobs done")
    for job_id in ids:
        seen = runs.seen[job_id]
        # Every run has an attempt number of its own (a token names one claim), and
        # none is counted: max_attempts grew by one per snooze.
        assert [attempt for attempt, _ in seen] == [1, 2, 3, 4]
        for (_, began), (_, again) in itertools.pairwise(seen):
            assert again - began >= delay - 0.05, f"ran again after {again - began:.3f}s, snoozed {delay}s"
        row = job(engine, job_id)
        assert (row.attempts, row.max_attempts, row.last_error) == (4, 4, None)
    wait_for(lambda: worker.stats.snoozed == 6, what="six snoozes counted")
    wait_for_counts(worker, retried=0, failed=0, done=2)
    snoozes = [r for r in caplog.records if "snoozed" in r.getMessage()]
    assert len(snoozes) == 6 and {r.levelno for r in snoozes} == {logging.INFO}
    assert "not ready yet" in snoozes[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == "sqla_queue.worker"]


def test_a_snoozed_transactional_handler_leaves_none_of_its_writes(
    engine: Engine, Sessions: Any, start_worker: Any
) -> None:
    """Like any exception it raises, a Snooze rolls the handler's writes back: only the
    run that completes leaves its row, committed with the completion."""
    runs = Runs()
    tasks = Tasks()

    @tasks.task
    def poll(job: Any, session: Session) -> None:
        n = runs(job)
        session.add(Effect(job_id=job.id, worker="w", note=f"run {n}"))
        session.flush()  # written to the database, then rolled back by the snooze
        if n <= 2:
            raise Snooze(0.05)

    worker = start_worker(tasks)
    (job_id,) = add(Sessions, "poll", max_attempts=1)
    wait_for(lambda: job(engine, job_id).status == "done", timeout=30, what="the job done")
    assert [e.note for e in effects(engine)] == ["run 3"]
    row = job(engine, job_id)
    assert (row.attempts, row.max_attempts) == (3, 3)
    wait_for_counts(worker, snoozed=2)


def test_snooze_delays_must_be_non_negative() -> None:
    for bad in (-1, float("nan"), timedelta(seconds=-1)):
        with pytest.raises(ValueError, match="Snooze delay"):
            Snooze(bad)
    assert Snooze(2).delay == timedelta(seconds=2) and Snooze(2).reason == "snoozed"
