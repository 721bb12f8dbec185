"""What only the asyncio worker has: native async handlers and sessions, sync handlers in
its thread pool, cancellation at shutdown, and a heartbeat a blocked loop cannot stop.

Everything the two runtimes share (fencing, exactly-once effects, poison rows, recovery,
timers, fail-fast start, graceful stop) is tested once for both, in the worker suites.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import sqla_queue.worker as worker_module
from sqla_queue import AsyncWorker, Tasks, Worker, WorkerStartError
from sqla_queue.model import DEFAULT_MAX_ATTEMPTS

from .models import Effect, Task
from .workers import FAST, TASKS, add, effects, job

T = TypeVar("T")


def run(main: Callable[[AsyncEngine], Awaitable[T]], engine: Engine) -> T:
    async def wrapper() -> T:
        async_engine = create_async_engine(engine.url)
        try:
            return await main(async_engine)
        finally:
            await async_engine.dispose()

    return asyncio.run(wrapper())


async def until(predicate: Callable[[], bool], *, timeout: float = 20.0, what: str = "") -> None:
    """Poll ``predicate`` (a cheap check, or a query in a thread) until true, or fail."""
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(predicate):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        await asyncio.sleep(0.02)


def statuses(engine: Engine, ids: list[int]) -> list[str]:
    with engine.connect() as conn:
        rows = conn.execute(select(TASKS.c.id, TASKS.c.status).where(TASKS.c.id.in_(ids))).all()
    return [status for _, status in sorted(rows)]


def all_done(engine: Engine, ids: list[int]) -> Callable[[], bool]:
    return lambda: statuses(engine, ids) == ["done"] * len(ids)


@asynccontextmanager
async def started(worker: AsyncWorker, grace: float = 1) -> AsyncIterator[AsyncWorker]:
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop(grace)


OPTIONS: dict[str, Any] = {"backoff": FAST, "poll_interval": 0.5, "sweep_interval": 0.2}


def test_an_async_transactional_handler_commits_its_savepoints_once_with_the_job(
    engine: Engine, Sessions: Any
) -> None:
    tasks = Tasks()

    @tasks.task
    async def shapes(job: Any, session: AsyncSession) -> None:
        session.add(Effect(job_id=job.id, worker="async", note="first"))
        await session.commit()  # a savepoint of the worker's transaction
        try:
            async with session.begin_nested():
                session.add(Effect(job_id=job.id, worker="async", note="rolled back"))
                raise LookupError("undo this part")
        except LookupError:
            pass
        async with session.begin_nested():
            session.add(Effect(job_id=job.id, worker="async", note="nested"))
        await asyncio.sleep(0)

    ids = add(Sessions, "shapes", 5)

    async def main(async_engine: AsyncEngine) -> None:
        async with started(AsyncWorker(async_engine, Task, tasks, concurrency=3, **OPTIONS)) as worker:
            await until(all_done(engine, ids), what="the jobs")
            await until(lambda: worker.stats.done == 5, what="the worker to count the five")

    run(main, engine)
    notes = sorted((e.job_id, e.note) for e in effects(engine))
    assert notes == sorted([(i, "first") for i in ids] + [(i, "nested") for i in ids])


def test_plain_handlers_run_at_once_in_the_thread_pool(engine: Engine, Sessions: Any) -> None:
    """Two blocking plain handlers meet at a barrier: they run at the same time, on the
    pool's threads, while the loop stays free."""
    barrier = threading.Barrier(2, timeout=10)
    threads: list[str] = []
    tasks = Tasks()

    @tasks.task
    def blocking(job: Any) -> None:
        threads.append(threading.current_thread().name)
        barrier.wait()

    ids = add(Sessions, "blocking", 2)

    async def main(async_engine: AsyncEngine) -> None:
        worker = AsyncWorker(async_engine, Task, tasks, concurrency=2, batch_size=1, **OPTIONS)
        async with started(worker):
            await until(all_done(engine, ids), what="both jobs")

    run(main, engine)
    assert len(threads) == 2 and all(name.startswith("sqla_queue-sync") for name in threads)


def test_a_plain_transactional_handler_gets_a_sync_session_on_the_loop(engine: Engine, Sessions: Any) -> None:
    seen: list[type[Any]] = []
    tasks = Tasks()

    @tasks.task
    def writes(job: Any, session: Session) -> None:
        seen.append(type(session))
        session.add(Effect(job_id=job.id, worker="sync", note="written"))
        session.commit()

    ids = add(Sessions, "writes", 3)

    async def main(async_engine: AsyncEngine) -> None:
        async with started(AsyncWorker(async_engine, Task, tasks, **OPTIONS)):
            await until(all_done(engine, ids), what="the jobs")

    run(main, engine)
    assert all(issubclass(kind, Session) for kind in seen) and len(seen) == 3
    assert sorted(e.job_id for e in effects(engine)) == ids


async def _until(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Poll ``predicate`` on the loop until it holds, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        await asyncio.sleep(0.02)


def _forever(cancelled: list[int], entered: asyncio.Event | None = None, clean_up: float = 0.0) -> Tasks:
    tasks = Tasks()

    @tasks.task
    async def forever(job: Any, session: AsyncSession) -> None:
        session.add(Effect(job_id=job.id, worker="async", note="must not commit"))
        await session.flush()
        if entered is not None:
            entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if clean_up:
                await asyncio.shield(asyncio.sleep(clean_up))  # clean-up that awaits
            cancelled.append(job.id)
            raise

    return tasks


def test_stop_cancels_the_handlers_still_running_after_the_grace(engine: Engine, Sessions: Any) -> None:
    """stop() returns once the cancelled handler has run its ``except`` clause, an
    awaiting one included. The test waits for the handler itself, not the row's
    ``running`` (set by the claim: a stop before the handler starts hands the job back
    unstarted, and nothing is cancelled)."""
    cancelled: list[int] = []
    (job_id,) = add(Sessions, "forever")

    async def main(async_engine: AsyncEngine) -> None:
        entered = asyncio.Event()
        worker = AsyncWorker(async_engine, Task, _forever(cancelled, entered, clean_up=0.2), **OPTIONS)
        await worker.start()
        await asyncio.wait_for(entered.wait(), 20)
        began = time.monotonic()
        await worker.stop(grace=0.3)
        assert cancelled == [job_id], "stop() returned before the handler's except clause ran"
        assert time.monotonic() - began < 3
        assert worker.stopped

    run(main, engine)
    assert cancelled == [job_id]
    row = job(engine, job_id)
    assert (row.status, row.lease_owner, row.attempts) == ("pending", None, 1)
    assert effects(engine) == []


def test_stop_waits_for_the_cancelled_handlers_clean_up_apart_from_the_services(
    engine: Engine, Sessions: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a busy machine the other services' joins can use up the time stop() gives them
    all, leaving none to the cancelled handler's executor (as a join budget near zero
    does here): its ``except`` clause still runs before stop() returns."""
    monkeypatch.setattr(worker_module, "_JOIN_SECONDS", 0.01)
    cancelled: list[int] = []
    (job_id,) = add(Sessions, "forever")

    async def main(async_engine: AsyncEngine) -> None:
        entered = asyncio.Event()
        worker = AsyncWorker(async_engine, Task, _forever(cancelled, entered, clean_up=0.2), **OPTIONS)
        await worker.start()
        await asyncio.wait_for(entered.wait(), 20)
        await worker.stop(grace=0.1)
        assert cancelled == [job_id], "stop() returned before the handler's except clause ran"

    run(main, engine)
    row = job(engine, job_id)
    assert (row.status, row.lease_owner, row.attempts) == ("pending", None, 1)


def test_stop_does_not_wait_for_a_plain_handler_past_the_grace(engine: Engine, Sessions: Any) -> None:
    """A plain handler blocks its pool thread past the grace: stop() hands the job back
    and returns; the thread ends alone later and its outcome is not recorded."""
    entered, release = threading.Event(), threading.Event()
    tasks = Tasks()

    @tasks.task
    def stuck(job: Any) -> None:
        entered.set()
        release.wait(30)

    (job_id,) = add(Sessions, "stuck")

    async def main(async_engine: AsyncEngine) -> AsyncWorker:
        worker = AsyncWorker(async_engine, Task, tasks, **OPTIONS)
        await worker.start()
        assert await asyncio.to_thread(entered.wait, 20)
        began = time.monotonic()
        await worker.stop(grace=0.3)
        assert time.monotonic() - began < 3
        assert worker.executors.join(0), "an executor still waits for the stuck thread"
        return worker

    try:
        worker = run(main, engine)
    finally:
        release.set()
    assert worker.stopped
    row = job(engine, job_id)
    assert (row.status, row.lease_owner, row.attempts) == ("pending", None, 1)


def test_cancelling_run_hands_back_and_cancels_at_once(engine: Engine, Sessions: Any) -> None:
    cancelled: list[int] = []
    # Quick jobs first: a task claims one job at a time until it has measured its
    # handlers, then batches (here of 3) once they proved fast.
    warm_up = add(Sessions, "quick", 20)
    ids: list[int] = []

    async def main(async_engine: AsyncEngine) -> None:
        entered = asyncio.Event()
        tasks = _forever(cancelled, entered)

        @tasks.task
        async def quick(job: Any) -> None:
            pass

        worker = AsyncWorker(async_engine, Task, tasks, concurrency=1, batch_size=3, shutdown_grace=30, **OPTIONS)
        running = asyncio.create_task(worker.run(install_signal_handlers=False))
        await _until(lambda: worker.stats.done == len(warm_up), "the warm-up jobs")
        ids.extend(await asyncio.to_thread(add, Sessions, "forever", 3))
        await asyncio.wait_for(entered.wait(), 20)
        await _until(lambda: worker.stats.claimed == len(warm_up) + 3, "the three jobs claimed")
        began = time.monotonic()
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert time.monotonic() - began < 3, "cancelling run() waited for the grace"
        assert worker.stopped

    run(main, engine)
    assert len(cancelled) == 1
    rows = sorted((job(engine, i) for i in ids), key=lambda r: -r.max_attempts)
    assert all(r.status == "pending" and r.lease_owner is None for r in rows)
    # The two never started are not counted: max_attempts grew (attempts is never given back).
    assert [(r.attempts, r.max_attempts) for r in rows] == [
        (1, DEFAULT_MAX_ATTEMPTS + 1), (1, DEFAULT_MAX_ATTEMPTS + 1), (1, DEFAULT_MAX_ATTEMPTS)]
    assert effects(engine) == []


def test_a_handler_blocking_the_loop_does_not_cost_its_lease(engine: Engine, Sessions: Any) -> None:
    """An ``async def`` handler that blocks the event loop for three leases: the heartbeat,
    on its own thread and loop, keeps extending the lease meanwhile."""
    tasks = Tasks()
    leases: list[Any] = []

    @tasks.task
    async def blocks(job: Any) -> None:
        first = _lease(engine, job.id)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:  # no await: the loop is stuck here
            leases.append(_lease(engine, job.id))
            time.sleep(0.1)
        leases.insert(0, first)

    (job_id,) = add(Sessions, "blocks")

    async def main(async_engine: AsyncEngine) -> None:
        worker = AsyncWorker(async_engine, Task, tasks, lease=1, heartbeat_interval=0.2, **OPTIONS)
        async with started(worker):
            await until(all_done(engine, [job_id]), what="the job")
            # The row is done once the completion commits; the worker counts it after.
            await until(lambda: worker.stats.done + worker.stats.lost > 0, what="the job counted")
            assert (worker.stats.lost, worker.stats.done) == (0, 1)

    # A second worker's sweeper would take the job if its lease ran out.
    sweeper = Worker(engine, Task, tasks_noop(), sweep_interval=0.1, poll_interval=60, queues=["nothing"])
    sweeper.start()
    try:
        run(main, engine)
    finally:
        sweeper.stop(grace=0)
    assert sweeper.stats.swept == 0
    assert max(leases) - leases[0] > 2, "the lease was not extended while the loop was blocked"
    assert job(engine, job_id).attempts == 1


def tasks_noop() -> Tasks:
    tasks = Tasks()
    tasks.register("noop", lambda job: None)
    return tasks


def _lease(engine: Engine, job_id: int) -> Any:
    with engine.connect() as conn:
        lease = conn.scalar(select(TASKS.c.lease_expires_at).where(TASKS.c.id == job_id))
        assert lease is not None
        return lease.timestamp()


def test_async_with_starts_and_stops_it(engine: Engine, Sessions: Any) -> None:
    done: list[int] = []
    tasks = Tasks()

    @tasks.task
    async def note(job: Any) -> None:
        done.append(job.id)

    ids = add(Sessions, "note", 4)

    async def main(async_engine: AsyncEngine) -> AsyncWorker:
        async with AsyncWorker(async_engine, Task, tasks, **OPTIONS) as worker:
            await until(all_done(engine, ids), what="the jobs")
        return worker

    worker = run(main, engine)
    assert worker.stopped and sorted(done) == ids


def test_the_async_worker_needs_an_async_psycopg_engine(engine: Engine) -> None:
    with pytest.raises(WorkerStartError, match="create_async_engine"):
        AsyncWorker(engine, Task, tasks_noop())  # type: ignore[arg-type]
    asyncpg = create_async_engine(engine.url.set(drivername="postgresql+asyncpg"))
    with pytest.raises(WorkerStartError, match="psycopg"):
        AsyncWorker(asyncpg, Task, tasks_noop())


def test_the_thread_worker_names_the_async_one_for_async_handlers(engine: Engine) -> None:
    async def handler(job: Any) -> None:
        pass

    with pytest.raises(TypeError, match="AsyncWorker"):
        Worker(engine, Task, handler)
    assert AsyncWorker(create_async_engine(engine.url), Task, handler).handler is handler


def test_an_async_job_context_is_awaited_around_every_job(engine: Engine, Sessions: Any) -> None:
    """``@asynccontextmanager`` factories work as ``job_context``: entered and left in the
    job's task, around the handler, seeing what it raised."""
    seen: list[tuple[str, int, int]] = []
    inside: list[int] = []
    tasks = Tasks()

    @asynccontextmanager
    async def context() -> AsyncIterator[None]:
        await asyncio.sleep(0)  # really awaited
        inside.append(1)
        try:
            yield
        except ValueError:
            seen.append(("raised", 0, 0))
            raise
        finally:
            inside.pop()

    @tasks.task
    async def in_context(job: Any) -> None:
        seen.append(("ran", job.id, len(inside)))
        if job.attempts == 1:
            raise ValueError("first attempt fails")

    (job_id,) = add(Sessions, "in_context")

    async def main(async_engine: AsyncEngine) -> None:
        worker = AsyncWorker(async_engine, Task, tasks, job_context=context, concurrency=1, **OPTIONS)
        async with started(worker):
            await until(all_done(engine, [job_id]), what="the retry done")

    run(main, engine)
    assert seen == [("ran", job_id, 1), ("raised", 0, 0), ("ran", job_id, 1)]
    assert inside == []


def test_the_thread_worker_refuses_an_async_job_context(engine: Engine) -> None:
    @asynccontextmanager
    async def context() -> AsyncIterator[None]:
        yield

    with pytest.raises(TypeError, match="AsyncWorker"):
        Worker(engine, Task, tasks_noop(), job_context=context)  # type: ignore[arg-type]
