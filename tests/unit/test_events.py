"""A worker's events: the job's fields, read once, without keeping the job alive; the
observers' bounded queue."""

from __future__ import annotations

import asyncio
import builtins
import gc
import weakref
from datetime import UTC, datetime
from typing import Any

import pytest

from sqla_queue import JobOutcome, WorkerObserver, WorkerStats
from sqla_queue.sql import ClaimToken
from sqla_queue.worker.hooks import _CLAIMED, _ENDED, _STARTED, Hooks, JobEvent
from sqla_queue.worker.ledger import Held

from ..helpers import wait_for

ENQUEUED = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


class Job:
    def __init__(self) -> None:
        self.queue = "mail"
        self.task = "send"
        self.run_after = ENQUEUED
        self.created_at = ENQUEUED
        self.trace_context = {"traceparent": "00-abc-def-01"}


def test_events_keep_the_jobs_fields_and_let_the_job_go() -> None:
    job = Job()
    held = Held(ClaimToken(7, 2), job, owner="w/0.1")
    claimed = JobEvent._of("jobs", held, _CLAIMED)
    held.started_at, held.run_time = 1_000.0, 0.25
    started = JobEvent._of("jobs", held, _STARTED)
    ended = JobEvent._of("jobs", held, _ENDED, JobOutcome.DONE)
    gone = weakref.ref(job)
    del job, held
    gc.collect()
    assert gone() is None  # an event waiting for the observers holds no job, no Held
    for event in (claimed, started, ended):
        assert (event.table, event.queue, event.task, event.job_id, event.attempt, event.worker) == (
            "jobs", "mail", "send", 7, 2, "w/0.1")
        assert (event.run_after, event.created_at) == (ENQUEUED, ENQUEUED)
        assert event.trace_context == {"traceparent": "00-abc-def-01"}
    assert (claimed.started_at, claimed.run_time, claimed.outcome) == (None, None, None)
    assert (started.started_at, started.run_time) == (1_000.0, None)
    assert (ended.started_at, ended.run_time, ended.outcome) == (1_000.0, 0.25, JobOutcome.DONE)


def test_a_job_that_could_not_be_loaded_has_its_token_and_no_fields() -> None:
    event = JobEvent._of("jobs", Held(ClaimToken(9, 1), None, load_error="bad row", owner="w/1.1"), _ENDED,
                         JobOutcome.FAILED, "bad row")
    assert (event.job_id, event.attempt, event.worker, event.queue, event.task) == (9, 1, "w/1.1", None, None)
    assert (event.error, event.pickup_latency) == ("bad row", None)


def test_an_event_made_by_hand_reads_as_given() -> None:
    event = JobEvent("jobs", "mail", None, 3, 1, JobOutcome.SWEPT, created_at=ENQUEUED, worker="w/2.1")
    assert (event.queue, event.task, event.job_id, event.attempt, event.outcome) == ("mail", None, 3, 1,
                                                                                    JobOutcome.SWEPT)
    assert (event.created_at, event.run_after, event.worker, event.run_time) == (ENQUEUED, None, "w/2.1", None)


class Recorder(WorkerObserver):
    def __init__(self) -> None:
        self.seen: list[Any] = []

    def finished(self, event: JobEvent) -> None:
        self.seen.append(event.job_id)


def _ended(job_id: int) -> JobEvent:
    return JobEvent("jobs", "mail", None, job_id, 1, JobOutcome.DONE)


def test_events_past_the_queue_size_are_dropped_and_counted_and_the_rest_delivered_in_order() -> None:
    stats = WorkerStats()
    recorder = Recorder()
    hooks = Hooks(stats, [recorder], queue_size=3, table="jobs")
    hooks.finished([_ended(1), _ended(2)])
    hooks.finished([_ended(3), _ended(4)])  # 4 waiting would pass the bound: dropped whole
    hooks.finished([_ended(5)])
    assert stats.hook_dropped == 2
    hooks.start()
    hooks.stop(timeout=30)
    assert recorder.seen == [1, 2, 5]
    hooks.finished([_ended(6)])  # stopped: nothing more is queued
    assert stats.hook_dropped == 3


class Exiting(WorkerObserver):
    """Raises what would end a thread: ``SystemExit``, ``KeyboardInterrupt``,
    ``CancelledError``, in turn, on every event and at the close."""

    RAISES: tuple[type[BaseException], ...] = (SystemExit, KeyboardInterrupt, asyncio.CancelledError)

    def __init__(self) -> None:
        self.calls = 0

    def finished(self, event: JobEvent) -> None:
        self.calls += 1
        raise self.RAISES[self.calls % 3]()

    def close(self) -> None:
        raise SystemExit(3)


@pytest.mark.parametrize("raised", ["SystemExit", "KeyboardInterrupt", "CancelledError"])
def test_an_observer_that_raises_what_ends_a_thread_ends_nothing(
    raised: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each event is delivered to the next observer and counted as an error, the close
    too; each kind of error is logged once, not once per event."""
    stats = WorkerStats()
    exiting, recorder = Exiting(), Recorder()
    exiting.RAISES = (getattr(builtins, raised, None) or asyncio.CancelledError,) * 3
    hooks = Hooks(stats, [exiting, recorder], table="jobs")
    hooks.start()
    for n in range(1, 31):
        hooks.finished([_ended(n)])
    hooks.stop(timeout=30)
    assert recorder.seen == list(range(1, 31))
    assert stats.hook_errors == 31  # 30 events and the close
    lines = [r.getMessage() for r in caplog.records if "observer Exiting" in r.getMessage()]
    assert len(lines) == 2, lines  # finished (its class once a minute) and close
    assert all(raised in line for line in lines[:1]) and "SystemExit" in lines[1]


def test_the_observer_thread_outlives_a_system_exit_and_keeps_delivering() -> None:
    """After a ``SystemExit`` (and the others), events still arrive: the thread lives."""
    stats = WorkerStats()
    exiting, recorder = Exiting(), Recorder()
    hooks = Hooks(stats, [exiting, recorder], table="jobs")
    hooks.start()
    hooks.finished([_ended(1), _ended(2), _ended(3)])
    wait_for(lambda: len(recorder.seen) == 3, timeout=30, what="the first events delivered")
    assert hooks._thread is not None and hooks._thread.is_alive()
    hooks.finished([_ended(4)])
    hooks.stop(timeout=30)
    assert recorder.seen == [1, 2, 3, 4]
    assert stats.hook_errors == 5
