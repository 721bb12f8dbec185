"""The producer's idle path against the in-memory operations layer: when an idle worker
looks up the next due time."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from sqla_queue.worker import cursor as cursor_module
from sqla_queue.worker import producer as producer_module
from sqla_queue.worker.config import WorkerConfig
from sqla_queue.worker.context import WorkerContext
from sqla_queue.worker.cursor import ClaimCursor
from sqla_queue.worker.hooks import Hooks
from sqla_queue.worker.ledger import Ledger
from sqla_queue.worker.producer import Producer
from sqla_queue.worker.stats import WorkerStats
from sqla_queue.worker.work_signal import WorkSignal

from ..fakes import FakeConn, FakeDriver, FakeOps


class CountingOps(FakeOps):
    def __init__(self) -> None:
        super().__init__()
        self.lookups: list[float] = []

    def next_due(self, conn: Any) -> float | None:
        self.lookups.append(time.monotonic())
        return None


def _producer(ops: FakeOps, signal: WorkSignal, config: WorkerConfig) -> Producer:
    """A producer over the in-memory operations layer."""
    stats = WorkerStats()
    ctx = WorkerContext(config, Ledger(), FakeDriver(), ops, signal, stats, "w", Hooks(stats))  # type: ignore[arg-type]
    return Producer(ctx)


def _paused(
    monkeypatch: pytest.MonkeyPatch, pause: float, poll: float
) -> tuple[CountingOps, WorkSignal, Producer]:
    """A producer whose lookups of the next due time are ``pause`` apart, polling every
    ``poll`` seconds, over operations that count the lookups."""
    monkeypatch.setattr(producer_module, "NEXT_DUE_PAUSE", pause)
    monkeypatch.setattr(producer_module, "MAX_NEXT_DUE_PAUSE", pause)
    ops = CountingOps()
    signal = WorkSignal(1)
    return ops, signal, _producer(ops, signal, WorkerConfig(poll_interval=poll))


def test_the_wake_ups_of_one_pause_share_one_lookup_of_the_next_due_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each wake-up may bring a delayed job, whose due time the idle worker must learn;
    at hundreds of wake-ups a second, one lookup per pause serves them all, made at the
    pause's end for the wake-ups that came during it (not at the poll)."""
    pause = 1.0
    ops, signal, producer = _paused(monkeypatch, pause, poll=60.0)
    conn = FakeConn()

    signal.wake()
    producer.wait_for_work(conn)  # type: ignore[arg-type]
    assert len(ops.lookups) == 1
    for _ in range(5):  # more wake-ups within the pause: no lookup of their own
        signal.wake()
        producer.wait_for_work(conn)  # type: ignore[arg-type]
    assert len(ops.lookups) == 1
    # Nothing else wakes the worker now: the pause's end does, well before the poll...
    began = time.monotonic()
    producer.wait_for_work(conn)  # type: ignore[arg-type]
    assert time.monotonic() - began < 30.0, "only the poll woke the worker"
    assert len(ops.lookups) == 1
    # ... and the worker, woken, looks up then (its claim found nothing again).
    signal.wake()
    producer.wait_for_work(conn)  # type: ignore[arg-type]
    assert len(ops.lookups) == 2
    assert ops.lookups[1] - ops.lookups[0] >= pause


def test_polls_within_the_pause_schedule_no_lookup_so_an_idle_worker_stays_quiet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A poll brings no news of delayed jobs: within the pause it leaves no due time
    behind (a worker whose every poll did would never look idle to
    ``run(until_idle=True)``)."""
    ops, signal, producer = _paused(monkeypatch, 30.0, poll=0.01)
    signal.wake()
    producer.wait_for_work(FakeConn())  # type: ignore[arg-type]
    for _ in range(3):  # each ends at the poll
        producer.wait_for_work(FakeConn())  # type: ignore[arg-type]
    assert len(ops.lookups) == 1
    assert signal.next_due() is None  # nothing keeps an idle worker from looking idle


def test_a_due_time_whose_claim_found_nothing_looks_again_at_the_pause_s_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A retry's wake-up is the client's estimate of the server's ``run_after``; on a busy
    machine it can come a moment early, and its claim finds the job not due yet. Within the
    pause that must leave a lookup at the pause's end, not wait for the poll."""
    pause = 0.3
    ops, signal, producer = _paused(monkeypatch, pause, poll=60.0)
    signal.wake()
    producer.wait_for_work(FakeConn())  # type: ignore[arg-type]
    assert len(ops.lookups) == 1
    signal.wake_at(time.monotonic())  # the retry's due time, a moment early
    producer.wait_for_work(FakeConn())  # type: ignore[arg-type]  # woken by it; the claim found nothing
    assert len(ops.lookups) == 1  # within the pause: no lookup of its own...
    began = time.monotonic()
    producer.wait_for_work(FakeConn())  # type: ignore[arg-type]
    assert time.monotonic() - began < 30.0, "only the poll woke the worker"  # ... one at its end,
    signal.wake()  # (and the next wake-up ends the wait after it)
    producer.wait_for_work(FakeConn())  # type: ignore[arg-type]
    assert len(ops.lookups) == 2  # made then


def test_a_wake_up_after_a_quiet_pause_looks_up_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(producer_module, "NEXT_DUE_PAUSE", 0.0)
    monkeypatch.setattr(cursor_module, "COST_RATIO", 0.0)
    ops = CountingOps()
    signal = WorkSignal(1)
    producer = _producer(ops, signal, WorkerConfig(poll_interval=60.0))
    for n in range(1, 4):
        signal.wake()
        producer.wait_for_work(FakeConn())  # type: ignore[arg-type]
        assert len(ops.lookups) == n


class SlowOps(CountingOps):
    """Lookups that take ``took`` seconds of the fake clock each."""

    def __init__(self, clock: list[float], took: float) -> None:
        super().__init__()
        self.clock, self.took = clock, took

    def next_due(self, conn: Any) -> float | None:
        self.lookups.append(self.clock[0])
        self.clock[0] += self.took
        return None


@pytest.mark.parametrize(("took", "pause"), [(0.0005, 0.05), (0.005, 0.2), (0.1, 0.5)])
def test_the_pause_after_a_slow_lookup_is_in_proportion_to_its_cost(
    monkeypatch: pytest.MonkeyPatch, took: float, pause: float
) -> None:
    """Beside a held snapshot the lookup reads every dead entry of the pending index: the
    lookups are spaced forty times as far apart as one took (at least the pause, at most
    half a second), so they cost the worker a bounded share of its time."""
    clock = [1000.0]
    monkeypatch.setattr(producer_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    ops = SlowOps(clock, took)
    signal = WorkSignal(1)
    producer = _producer(ops, signal, WorkerConfig(poll_interval=60.0))

    def woken_at(when: float) -> None:
        clock[0] = when
        signal.wake()
        producer.wait_for_work(FakeConn())  # type: ignore[arg-type]

    woken_at(1000.0)
    assert ops.lookups == [1000.0]
    woken_at(1000.0 + pause - 0.001)
    assert len(ops.lookups) == 1
    woken_at(1000.0 + pause)
    assert ops.lookups == [1000.0, 1000.0 + pause]


def test_a_row_another_executor_passes_over_is_still_dead_lettered_where_rows_claim() -> None:
    """Two executors hit the same unclaimable row: the one that found no other row to
    claim passes over it (a claim broken for every row must fail none); the one whose
    claim did take other rows must still dead-letter it, or it stays pending."""
    ops = FakeOps()
    (bad,) = ops.add(1)
    producer = _producer(ops, WorkSignal(1), WorkerConfig())
    error = RuntimeError("job 1 is frozen by policy")
    producer._pass_over(FakeConn(), bad, error, dead_letter=False)  # type: ignore[arg-type]
    assert ops.jobs[bad].status == "pending" and producer._skipped() == [bad]
    producer._pass_over(FakeConn(), bad, error, dead_letter=True)  # type: ignore[arg-type]
    assert ops.jobs[bad].status == "failed"
    assert "frozen by policy" in (ops.jobs[bad].last_error or "")
    assert producer._skipped() is None


def test_the_ordinary_claims_start_after_the_cursor_where_the_operations_can() -> None:
    """The producer owns the cursor: its ordinary claims start after the last job claimed
    (the operations only take the start); with operations that cannot start after a
    key, it keeps none."""
    assert _producer(FakeOps(), WorkSignal(1), WorkerConfig()).cursor is None
    ops = FakeOps(claims_after=True)
    first, second, third = ops.add(3)
    producer = _producer(ops, WorkSignal(1), WorkerConfig())
    assert producer.cursor is not None
    producer.cursor = cursor = ClaimCursor(60.0)  # no rescan within the test
    head = producer.claim(FakeConn(), 1, "w/0.0")  # type: ignore[arg-type]
    assert [h.token.job_id for h in head] == [first]
    urgent = ops.add(1, priority=5)[0]  # sorts before the cursor: found from the head only
    request = producer.request(5, "w/0.0")
    assert request is not None and request.from_cursor
    producer.unclaimed(request)
    after = producer.claim(FakeConn(), 5, "w/0.0")  # type: ignore[arg-type]
    assert [h.token.job_id for h in after] == [second, third]
    assert ops.jobs[urgent].status == "pending"
    assert producer.claim(FakeConn(), 5, "w/0.0") == []  # type: ignore[arg-type]
    assert cursor.head_claim_at() is not None  # the cursor claim found nothing: one from the head is owed
