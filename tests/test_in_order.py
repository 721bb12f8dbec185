"""Sequences (``InOrder`` in ``__queue_flow__``): the jobs of one key run one at a time, in
enqueue order, through retries, snoozes, cancels and a worker killed mid-job.

``OrderedJob``: ordered per account, a dead letter blocks its account.
``SkippingOrderedJob``: the same, a dead letter lets the next job run.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict
from typing import Any

import pytest
from sqlalchemy import Engine, func, insert, select, update

from sqla_queue import InOrder, RetryLater, Snooze, cancel
from sqla_queue import sql as q

from .helpers import run_until_done, table_of, wait_for
from .models import FlowRun, OrderedJob, SkippingOrderedJob

ORDERED = table_of(OrderedJob)
SKIPPING = table_of(SkippingOrderedJob)


def add(engine: Engine, table: Any, rows: list[dict[str, Any]]) -> list[int]:
    with engine.begin() as conn:
        return list(conn.scalars(insert(table).returning(table.c.id), rows))


def claim(engine: Engine, model: Any, owner: str = "w", limit: int = 20) -> list[Any]:
    with engine.begin() as conn:
        return [row.id for row in conn.execute(q.claim(model, owner=owner, limit=limit))]


def set_status(engine: Engine, table: Any, ids: list[int], status: str) -> None:
    with engine.begin() as conn:
        conn.execute(update(table).where(table.c.id.in_(ids)).values(status=status, finished_at=func.now()))


def test_in_order_is_a_checked_value() -> None:
    with pytest.raises(ValueError, match="on_dead_letter"):
        InOrder(key="a", on_dead_letter="retry")
    with pytest.raises(TypeError, match="InOrder key"):
        InOrder(key="")


def test_a_claim_takes_only_the_head_of_each_key(engine: Engine) -> None:
    a1, b1, a2, b2, none1, none2 = add(engine, ORDERED, [
        {"account": "a"}, {"account": "b"}, {"account": "a"}, {"account": "b"}, {"account": None},
        {"account": None}])
    assert sorted(claim(engine, OrderedJob)) == [a1, b1, none1, none2]  # NULL keys are not ordered
    assert claim(engine, OrderedJob) == []  # the heads run: the rest wait
    set_status(engine, ORDERED, [a1], "done")
    assert claim(engine, OrderedJob) == [a2]
    set_status(engine, ORDERED, [b1], "cancelled")  # a cancelled head never blocks
    assert claim(engine, OrderedJob) == [b2]


def test_a_waiting_head_holds_its_key_back(engine: Engine) -> None:
    """A head whose retry waits out its backoff (pending, not due) is still the head."""
    (a1, a2) = add(engine, ORDERED, [{"account": "a"}, {"account": "a"}])
    with engine.begin() as conn:
        conn.execute(update(ORDERED).where(ORDERED.c.id == a1).values(run_after=func.now() + func.make_interval(0, 0, 0,
                                                                                                                 1)))
    assert claim(engine, OrderedJob) == []
    with engine.begin() as conn:
        conn.execute(update(ORDERED).where(ORDERED.c.id == a1).values(run_after=func.now()))
    assert claim(engine, OrderedJob) == [a1]
    assert a2 not in claim(engine, OrderedJob)


@pytest.mark.parametrize(("model", "blocks"), [(OrderedJob, True), (SkippingOrderedJob, False)],
                         ids=["block", "skip"])
def test_a_dead_letter_blocks_its_key_or_not_as_declared(engine: Engine, model: Any, blocks: bool) -> None:
    table = table_of(model)
    (a1, a2) = add(engine, table, [{"account": "a"}, {"account": "a"}])
    assert claim(engine, model) == [a1]
    set_status(engine, table, [a1], "failed")
    assert claim(engine, model) == ([] if blocks else [a2])
    if blocks:  # requeued, the dead letter is the head again; deleted, it frees the key
        with engine.begin() as conn:
            assert len(conn.execute(q.requeue_failed(model, ids=[a1])).all()) == 1
        assert claim(engine, model) == [a1]


def test_the_claim_never_slides_past_a_locked_head(engine: Engine) -> None:
    """A head another transaction holds (its claim not committed yet) is skipped, and so
    is everything after it in its key."""
    (a1, a2) = add(engine, ORDERED, [{"account": "a"}, {"account": "a"}])
    with engine.begin() as holder:
        holder.execute(select(ORDERED.c.id).where(ORDERED.c.id == a1).with_for_update())
        assert claim(engine, OrderedJob) == []
    assert claim(engine, OrderedJob) == [a1]
    assert a2


class Runs:
    """The order in which the handlers ran each account's jobs, and how often at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.order: dict[str, list[int]] = defaultdict(list)
        self.now: dict[str, int] = defaultdict(int)
        self.most = 0
        self.snoozed: set[int] = set()
        self.done: set[int] = set()

    def handler(self, job: Any) -> None:
        with self.lock:
            self.now[job.account] += 1
            self.most = max(self.most, self.now[job.account])
        try:
            time.sleep(0.005)  # the job's work: runs of one account would overlap
            if job.id % 7 == 3 and job.attempts == 1:
                raise RetryLater(0.05)  # a retry keeps its place
            if job.id % 11 == 5 and job.id not in self.snoozed:
                self.snoozed.add(job.id)
                raise Snooze(0.05)  # and so does a snooze
            with self.lock:
                self.order[job.account].append(job.id)
        finally:
            with self.lock:
                self.now[job.account] -= 1


def test_a_worker_of_eight_executors_runs_each_key_in_order_through_retries_snoozes_and_cancels(
    engine: Engine, start_worker: Any
) -> None:
    ids = add(engine, ORDERED, [{"account": "abc"[i % 3]} for i in range(60)])
    cancelled = [i for i in ids if i % 13 == 0]
    with engine.begin() as conn:
        cancel(conn, OrderedJob, ids=cancelled)
    runs = Runs()
    start_worker(handler=runs.handler, model=OrderedJob, concurrency=8, batch_size=3)
    wanted = [i for i in ids if i not in cancelled]
    wait_for(lambda: sum(len(v) for v in runs.order.values()) == len(wanted), timeout=60, what="every job run")
    with engine.connect() as conn:
        accounts = dict(conn.execute(select(ORDERED.c.id, ORDERED.c.account)).all())
    for account, order in runs.order.items():
        assert order == [i for i in wanted if accounts[i] == account], account
    assert runs.most == 1
    assert runs.snoozed and any(i % 7 == 3 for i in wanted)


@pytest.mark.system
def test_a_worker_killed_mid_job_keeps_each_key_in_order(engine: Engine, worker_processes: Any,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Four worker processes; one job kills its process on its first attempt (restarted
    at once). Its key waits for it (swept back after its lease, run again), and every
    key's runs that finished did so in enqueue order, one at a time (a job whose
    completion the kill lost runs again before the next of its key)."""
    monkeypatch.setenv("SQLA_QUEUE_TEST_FLOW_MODEL", "OrderedJob")
    flags = ("--concurrency", "2", "--batch-size", "2", "--lease", "2s", "--heartbeat", "0.5s",
             "--sweep-interval", "0.5s", "--poll-interval", "0.5s")
    processes = [worker_processes(*flags, target="tests.flow_app:make_worker") for _ in range(4)]
    ids = add(engine, ORDERED, [{"account": "ab"[i % 2], "work_seconds": 0.02, "kill": i == 4} for i in range(30)])
    deaths = run_until_done(engine, ORDERED, ids, processes,
                            lambda: worker_processes(*flags, target="tests.flow_app:make_worker"), timeout=90)
    assert len(deaths) >= 1
    runs = table_of(FlowRun)
    with engine.connect() as conn:
        rows = conn.execute(select(runs.c.job_id, runs.c.account, runs.c.started_at, runs.c.ended_at)
                            .order_by(runs.c.started_at)).all()
    for account in "ab":
        finished = [r for r in rows if r.account == account and r.ended_at is not None]
        order = [r.job_id for r in finished]
        # At least once: a run whose completion the kill lost runs again, right after
        # itself (its key waits for it); never out of order.
        assert order == sorted(order), order
        assert list(dict.fromkeys(order)) == [i for n, i in enumerate(ids) if "ab"[n % 2] == account]
        for before, after in itertools.pairwise(finished):
            assert before.ended_at <= after.started_at  # one at a time
