"""The asyncio worker: a handler's cancellation is that handler's failure, and a handler
that blocks the event loop costs no other job its lease.

Async handlers run inside their executor's task, so anything that cancels "the current
task" cancels the executor's. Only the worker's own stop (or the loop shutting down) may
end an executor; a handler's cancellation is retried like any failure, and the executor
goes on with the next jobs.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine

from sqla_queue import AsyncWorker, Backoff, Tasks, Worker

from .helpers import Server, wait_for
from .models import Effect, Task
from .test_async_worker import OPTIONS, all_done, run, started, tasks_noop, until
from .workers import add, effects, job

#: How the handlers below cancel themselves, by payload ``how``.
CANCELS = ["cancel_and_await", "cancel_and_return", "watchdog", "timeout_expires", "raise_cancelled"]


def _cancelling_tasks(runs: Counter[int]) -> Tasks:
    tasks = Tasks()

    @tasks.task
    async def cancels(job: Any) -> None:
        """Cancels its own task on attempts up to ``payload["until"]``, as ``how`` says."""
        runs[job.id] += 1
        if job.attempts > int(job.payload.get("until", 1)):
            return
        how = job.payload["how"]
        task = asyncio.current_task()
        assert task is not None
        if how == "cancel_and_await":  # CancelledError at the next await, not caught
            task.cancel()
            await asyncio.sleep(10)
        elif how == "cancel_and_return":  # requested, never awaited: still pending on return
            task.cancel()
        elif how == "watchdog":  # a per-job watchdog cancels "the job's task"
            watchdog = asyncio.get_running_loop().call_later(0.05, task.cancel)
            try:
                await asyncio.sleep(10)
            finally:
                watchdog.cancel()
        elif how == "timeout_expires":
            async with asyncio.timeout(0.05):
                await asyncio.sleep(10)
        elif how == "raise_cancelled":
            raise asyncio.CancelledError("raised by the handler")
        elif how == "swallowed":  # cancelled and caught: the request is never uncancelled
            task.cancel()
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass

    @tasks.task
    async def quick(job: Any) -> None:
        runs[job.id] += 1

    @tasks.task
    async def boom(job: Any) -> None:
        runs[job.id] += 1
        raise ValueError("this job always fails")

    @tasks.task
    async def forever(job: Any) -> None:
        runs[job.id] += 1
        await asyncio.Event().wait()

    return tasks


async def _stops_promptly(worker: AsyncWorker, engine: Engine, Sessions: Any) -> None:
    """The executor still claims (a job that never ends starts), and stop() cancels it
    within the grace plus a little."""
    (forever,) = add(Sessions, "forever")
    await until(lambda: job(engine, forever).status == "running", what="the endless job to start")
    began = time.monotonic()
    await worker.stop(grace=0.3)
    assert time.monotonic() - began < 3, "stop() did not cancel the endless job promptly"
    row = job(engine, forever)
    assert (row.status, row.lease_owner) == ("pending", None)


@pytest.mark.parametrize("how", CANCELS)
def test_a_handler_cancelling_its_own_task_fails_that_job_and_the_executor_goes_on(
    engine: Engine, Sessions: Any, how: str
) -> None:
    """One executor: the job whose first attempt cancels the task is retried (or, when the
    cancellation was never awaited, simply done); later jobs still run on that executor,
    and stop() still cancels promptly."""
    runs: Counter[int] = Counter()
    (first,) = add(Sessions, "cancels", how=how)

    async def main(async_engine: AsyncEngine) -> None:
        worker = AsyncWorker(async_engine, Task, _cancelling_tasks(runs), concurrency=1, **OPTIONS)
        await worker.start()
        try:
            await until(lambda: job(engine, first).status in ("done", "failed"), what="the cancelling job")
            later = add(Sessions, "quick", 5)
            await until(all_done(engine, later), what="the jobs after it, on the same executor")
            await _stops_promptly(worker, engine, Sessions)
        finally:
            await worker.stop(grace=0)

    run(main, engine)
    row = job(engine, first)
    assert row.status == "done", row.last_error
    if how == "cancel_and_return":
        assert (row.attempts, runs[first]) == (1, 1)  # the cancellation never reached it
    else:
        assert (row.attempts, runs[first]) == (2, 2)
        assert ("TimeoutError" if how == "timeout_expires" else "CancelledError") in row.last_error


def test_a_handler_cancelling_its_task_on_every_attempt_ends_dead_lettered(engine: Engine, Sessions: Any) -> None:
    runs: Counter[int] = Counter()
    (doomed,) = add(Sessions, "cancels", how="cancel_and_await", until=99, max_attempts=3)

    async def main(async_engine: AsyncEngine) -> None:
        worker = AsyncWorker(async_engine, Task, _cancelling_tasks(runs), concurrency=1, **OPTIONS)
        await worker.start()
        try:
            await until(lambda: job(engine, doomed).status == "failed", what="the dead letter")
            later = add(Sessions, "quick", 5)
            await until(all_done(engine, later), what="the jobs after it, on the same executor")
            await _stops_promptly(worker, engine, Sessions)
        finally:
            await worker.stop(grace=0)

    run(main, engine)
    row = job(engine, doomed)
    assert (row.attempts, runs[doomed]) == (3, 3)
    assert "CancelledError" in row.last_error


def test_a_swallowed_cancellation_does_not_cost_batch_mates_their_outcome(engine: Engine, Sessions: Any) -> None:
    """One batch: a handler cancels its task and swallows the CancelledError (so the task
    stays "cancelling"), a batch-mate succeeds, another fails. The failure is that job's,
    not a reason to drop the batch: the successful job runs once and is done."""
    runs: Counter[int] = Counter()
    swallowed, ok, failing = (
        add(Sessions, "cancels", how="swallowed")[0],
        add(Sessions, "quick")[0],
        add(Sessions, "boom", max_attempts=2)[0],
    )

    async def main(async_engine: AsyncEngine) -> None:
        worker = AsyncWorker(async_engine, Task, _cancelling_tasks(runs), concurrency=1, batch_size=3,
                             **{**OPTIONS, "lease": 2, "heartbeat_interval": 0.5})
        async with started(worker, grace=0):
            await until(lambda: [job(engine, i).status for i in (swallowed, ok, failing)] == ["done", "done", "failed"],
                        what="the batch settled")
            assert worker.stats.lost == 0, worker.stats

    run(main, engine)
    assert (runs[swallowed], runs[ok], runs[failing]) == (1, 1, 2)


def test_the_loop_shutting_down_still_ends_an_executor_inside_a_handler(engine: Engine, Sessions: Any) -> None:
    """``asyncio.run()`` ending without ``stop()`` cancels every task: an executor whose
    handler gets that cancellation ends, it is not taken for the handler's own."""
    runs: Counter[int] = Counter()
    (endless,) = add(Sessions, "forever")
    made: list[AsyncWorker] = []

    async def main(async_engine: AsyncEngine) -> None:
        worker = AsyncWorker(async_engine, Task, _cancelling_tasks(runs), concurrency=1, **OPTIONS)
        made.append(worker)
        await worker.start()
        await until(lambda: runs[endless] == 1, what="the endless job to start")

    ended = threading.Event()

    def in_thread() -> None:
        run(main, engine)
        ended.set()

    thread = threading.Thread(target=in_thread, daemon=True)
    thread.start()
    try:
        wait_for(ended.is_set, timeout=15, what="asyncio.run() to return")
        assert made[0].executors.join(0), "the executor outlived its loop"
    finally:
        if made:
            made[0].heartbeat.stop(5)  # its own thread: not the loop's to end
    assert runs[endless] == 1


# -- a blocked loop ---------------------------------------------------------------------------------

SLOW_CLAIM = """
CREATE FUNCTION sqla_queue_test_slow_claim() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.payload ->> 'slow_claim' IS NOT NULL THEN
        PERFORM pg_sleep((NEW.payload ->> 'slow_claim')::float8);
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER sqla_queue_test_slow_claim BEFORE UPDATE ON tasks FOR EACH ROW
    WHEN (OLD.status = 'pending' AND NEW.status = 'running')
    EXECUTE FUNCTION sqla_queue_test_slow_claim();
"""


@pytest.fixture
def slow_claims(engine: Engine) -> Iterator[None]:
    """A claim of a job whose payload has ``slow_claim`` takes that many seconds on the
    server (a trigger of this test's, dropped after it): its answer arrives when the test
    wants it to."""
    with engine.begin() as conn:
        conn.execute(text(SLOW_CLAIM))
    try:
        yield
    finally:
        with engine.begin() as conn:
            conn.execute(text("DROP TRIGGER IF EXISTS sqla_queue_test_slow_claim ON tasks"))
            conn.execute(text("DROP FUNCTION IF EXISTS sqla_queue_test_slow_claim()"))


def _claim_sleeping(engine: Engine, app: str) -> bool:
    """A backend of this test's worker is inside a claim, sleeping in the trigger."""
    with engine.connect() as conn:
        return bool(
            conn.scalar(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND application_name = :app AND wait_event = 'PgSleep'"
                ),
                {"app": app},
            )
        )


def test_a_claim_answered_while_a_handler_blocks_the_loop_keeps_its_lease(
    engine: Engine, Sessions: Any, server: Server, slow_claims: None
) -> None:
    """One handler blocks the event loop for two leases just as another executor's claim
    is committing: the claim's rows wait unread in the socket, their tokens not yet in the
    ledger. The heartbeat (its own thread) must keep their leases all the same, or
    another worker's sweeper hands the job on and its handler runs twice."""
    lease, beat = 2.0, 0.5
    app = f"sqla_queue_blocked_{time.monotonic_ns()}"
    runs: Counter[int] = Counter()
    claim_in_flight = threading.Event()
    tasks = Tasks()

    @tasks.task
    async def blocker(job: Any) -> None:
        runs[job.id] += 1
        while not claim_in_flight.is_set():
            await asyncio.sleep(0.01)
        time.sleep(lease * 2)  # no await: the loop is stuck here

    @tasks.task
    async def effect(job: Any, session: AsyncSession) -> None:
        runs[job.id] += 1
        session.add(Effect(job_id=job.id, worker="async", note=f"attempt {job.attempts}"))

    (blocking,) = add(Sessions, "blocker", priority=10)

    async def main(async_engine: AsyncEngine) -> AsyncWorker:
        worker = AsyncWorker(async_engine, Task, tasks, concurrency=2, batch_size=1, lease=lease,
                             heartbeat_interval=beat, backoff=Backoff(base=60), poll_interval=0.5,
                             sweep_interval=0.2)
        async with started(worker, grace=1):
            await until(lambda: runs[blocking] == 1, what="the blocking handler to start")
            (slow,) = add(Sessions, "effect", slow_claim=0.5)  # within the claim deadline (lease / 2)
            await until(lambda: _claim_sleeping(engine, app), what="the other executor's claim")
            claim_in_flight.set()
            await until(all_done(engine, [blocking, slow]), timeout=30, what="both jobs")
            assert worker.stats.lost == 0, worker.stats
        return worker

    # Another worker's sweeper would hand the claimed job on if its lease ran out.
    sweeper = Worker(engine, Task, tasks_noop(), sweep_interval=0.1, poll_interval=60, queues=["nothing"])
    sweeper.start()

    async def tagged() -> None:
        async_engine = create_async_engine(server.url, connect_args={"application_name": app})
        try:
            await main(async_engine)
        finally:
            await async_engine.dispose()

    try:
        asyncio.run(tagged())
    finally:
        sweeper.stop(grace=0)
    slow_id = next(i for i in runs if i != blocking)
    assert sweeper.stats.swept == 0
    assert runs == Counter({blocking: 1, slow_id: 1}), "a job ran twice"
    assert Counter(e.job_id for e in effects(engine)) == Counter({slow_id: 1})
    assert job(engine, slow_id).attempts == 1

