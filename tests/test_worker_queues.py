"""Workers configured as users configure them: every queue, one queue, several queues.

Each behaviour runs with ``queues=None``, ``("b",)`` and ``("b", "c", "d")`` on both
runtimes (the ``runtime`` fixture), and from the CLI with repeated ``--queue`` flags.
Jobs of a queue the worker does not serve get a higher priority, so a claim that ignored
the filter would take them first; they must stay pending.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, func, insert, select, text
from sqlalchemy.orm import sessionmaker

from sqla_queue import QueueSession

from .helpers import WorkerProcess, wait_for, wait_for_counts
from .models import Task
from .workers import TASKS, all_status, job, status_is

SERVED = [None, ("b",), ("b", "c", "d")]
IDS = ["all queues", "one queue", "three queues"]
OTHER = "x"


def _served(queues: tuple[str, ...] | None) -> tuple[str, ...]:
    return queues if queues is not None else ("b", OTHER)


def enqueue(engine: Engine, task: str, queue: str, n: int = 1, **options: Any) -> list[int]:
    payload = options.pop("payload", {})
    with sessionmaker(engine, class_=QueueSession)() as session:
        jobs = [session.enqueue(Task(task=task, payload=dict(payload)), queue=queue, **options) for _ in range(n)]
        session.commit()
        return [j.id for j in jobs]


def enqueue_unserved(engine: Engine, queues: tuple[str, ...] | None) -> list[int]:
    """Jobs the worker must not take: in a queue it does not serve, ahead in priority."""
    if queues is None:
        return []
    return enqueue(engine, "work", OTHER, 3, priority=10)


def still_pending(engine: Engine, ids: list[int]) -> bool:
    with engine.connect() as conn:
        found = conn.execute(select(TASKS.c.status, TASKS.c.attempts).where(TASKS.c.id.in_(ids))).all()
    return len(found) == len(ids) and all(row == ("pending", 0) for row in found)


@pytest.mark.parametrize("queues", SERVED, ids=IDS)
def test_jobs_of_the_served_queues_get_done_and_no_others(
    engine: Engine, start_worker: Any, queues: tuple[str, ...] | None
) -> None:
    other = enqueue_unserved(engine, queues)
    ids = [i for queue in _served(queues) for i in enqueue(engine, "work", queue, 3)]
    worker = start_worker(queues=queues)
    wait_for(all_status(engine, ids, "done"), what="the served queues' jobs done")
    # A second round, claimed while the unserved jobs wait at the head of the table.
    more = [i for queue in _served(queues) for i in enqueue(engine, "work", queue, 2)]
    wait_for(all_status(engine, more, "done"), what="the second round done")
    assert still_pending(engine, other)
    wait_for_counts(worker, done=len(ids) + len(more))


@pytest.mark.parametrize("queues", SERVED, ids=IDS)
def test_a_delayed_job_starts_at_its_time(engine: Engine, start_worker: Any, queues: tuple[str, ...] | None) -> None:
    other = enqueue_unserved(engine, queues)
    start_worker(queues=queues)
    (job_id,) = enqueue(engine, "work", _served(queues)[-1], delay=1.0)
    wait_for(status_is(engine, job_id, "done"), what="the delayed job done")
    row = job(engine, job_id)
    assert row.attempts == 1 and row.finished_at >= row.run_after
    assert still_pending(engine, other)


@pytest.mark.parametrize("queues", SERVED, ids=IDS)
def test_an_idle_worker_wakes_when_the_next_job_falls_due(
    engine: Engine, start_worker: Any, queues: tuple[str, ...] | None
) -> None:
    """Polling once a minute, the worker still runs a delayed job soon after it falls
    due: it asked when the next one is due (``next_run_after``) and woke then."""
    other = enqueue_unserved(engine, queues)
    start_worker(queues=queues, poll_interval=60.0)
    began = time.monotonic()
    (job_id,) = enqueue(engine, "work", _served(queues)[-1], delay=1.0)
    wait_for(status_is(engine, job_id, "done"), timeout=40, what="the delayed job done before the poll")
    assert time.monotonic() - began < 40
    assert still_pending(engine, other)


@pytest.mark.parametrize("queues", SERVED, ids=IDS)
def test_a_failed_attempt_is_retried(engine: Engine, start_worker: Any, queues: tuple[str, ...] | None) -> None:
    other = enqueue_unserved(engine, queues)
    worker = start_worker(queues=queues)
    ids = [i for queue in _served(queues) for i in enqueue(engine, "flaky", queue, payload={"succeed_on": 2})]
    wait_for(all_status(engine, ids, "done"), what="the flaky jobs done")
    assert {job(engine, i).attempts for i in ids} == {2}
    wait_for_counts(worker, retried=len(ids))
    assert still_pending(engine, other)


@pytest.mark.parametrize("queues", SERVED, ids=IDS)
def test_an_expired_lease_is_swept_and_run_again(
    engine: Engine, start_worker: Any, queues: tuple[str, ...] | None
) -> None:
    """The jobs of a dead worker: swept back (isolated) and re-run by this worker, but
    only in the queues it serves; the sweeper returns the others for their workers."""

    def dead_workers_job(queue: str) -> int:
        with engine.begin() as conn:
            job_id: int = conn.scalar(
                insert(TASKS)
                .values(task="work", payload={}, queue=queue, status="running", attempts=1, lease_owner="dead",
                        lease_expires_at=func.now() - text("interval '1 second'"))
                .returning(TASKS.c.id)
            )
        return job_id

    lost = [dead_workers_job(queue) for queue in _served(queues)]
    other = [dead_workers_job(OTHER)] if queues is not None else []
    worker = start_worker(queues=queues)
    wait_for(all_status(engine, lost, "done"), what="the swept jobs run again")
    assert {job(engine, i).attempts for i in lost} == {2}
    wait_for(lambda: worker.stats.swept >= len(lost), what="the sweeps counted")
    if other:
        wait_for(status_is(engine, other[0], "pending"), what="the other queue's job swept back")
        more = enqueue(engine, "work", _served(queues)[0])  # a later claim still leaves it alone
        wait_for(all_status(engine, more, "done"))
        row = job(engine, other[0])
        assert (row.status, row.attempts, row.isolated) == ("pending", 1, True)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("flags", [("--queue", "b"), ("--queue", "b", "--queue", "c", "--queue", "d")],
                         ids=["one --queue", "three --queue"])
def test_cli_worker_serves_the_queues_named_by_repeated_flags(
    engine: Engine, worker_processes: Callable[..., WorkerProcess], flags: tuple[str, ...]
) -> None:
    served = flags[1::2]
    other = enqueue(engine, "work", OTHER, 2, priority=10)
    ids = [i for queue in served for i in enqueue(engine, "record", queue, 2)]
    process = worker_processes(*flags, "--poll-interval", "0.5s", "--sweep-interval", "0.2s")
    try:
        wait_for(all_status(engine, ids, "done"), timeout=60, what="the served queues' jobs done")
    except AssertionError as failure:
        raise AssertionError(f"{failure}; the worker's log:\n{process.log()}") from None
    delayed = enqueue(engine, "work", served[-1], delay=0.5)
    wait_for(all_status(engine, delayed, "done"), timeout=60)
    assert still_pending(engine, other)
    assert "UndefinedColumn" not in process.log() and "does not exist" not in process.log()
