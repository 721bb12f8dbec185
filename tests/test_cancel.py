"""Cancelling pending and running jobs: a fenced transition, on both runtimes.

Once ``cancel()`` commits, the attempt can no longer complete: its worker's statements
are fenced by ``status = 'running'``, so a transactional handler's writes roll back
whatever the handler does. The worker learns it from the cancel's NOTIFY, or by polling
its jobs' rows (``listen=False``), and tells the handler.
"""

from __future__ import annotations

import asyncio
import functools
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session, sessionmaker

from sqla_queue import AsyncWorker, JobCancelled, QueueSession, Worker, admin, cancel, current_job
from sqla_queue.cli import main

from .helpers import Server, wait_for
from .models import Effect, Task
from .workers import FAST, EventLoopThread, LoopWorker, Runtimes, async_engine_like, job

OPTIONS: dict[str, Any] = {"backoff": FAST, "poll_interval": 0.5, "sweep_interval": 0.2, "shutdown_grace": 2}


@pytest.fixture
def url(server: Server) -> str:
    return server.url.render_as_string(hide_password=False)


@pytest.fixture
def start(engine: Engine, runtime: Runtimes) -> Iterator[Callable[..., Any]]:
    """``start(handler, **options)``: a started worker of the test's runtime running
    ``handler`` as given (a plain handler stays plain on the asyncio worker too, which
    runs it in its thread pool)."""
    started: list[Any] = []

    def make(handler: Any, **options: Any) -> Any:
        options = {**OPTIONS, **options}
        if runtime.name == "thread":
            worker: Any = Worker(engine, Task, handler, **options)
        else:
            loop, async_engine = EventLoopThread(), async_engine_like(engine)
            runtime._made.append((loop, async_engine))
            worker = LoopWorker(AsyncWorker(async_engine, Task, handler, **options), loop)
        worker.start()
        started.append(worker)
        return worker

    yield make
    for worker in started:
        worker.stop(grace=1)


def enqueue(engine: Engine, n: int = 1, task: str = "work", **options: Any) -> list[int]:
    with sessionmaker(engine, class_=QueueSession)() as session:
        jobs = [session.enqueue(Task(task=task, payload={}), **options) for _ in range(n)]
        session.commit()
        return [j.id for j in jobs]


def cancel_now(engine: Engine, ids: list[int]) -> list[int]:
    with Session(engine) as session:
        cancelled = cancel(session, Task, ids=ids)
        session.commit()
    return cancelled


def effects_of(engine: Engine, job_id: int) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(Effect).where(Effect.job_id == job_id)) or 0)


def told(worker: Any) -> bool:
    return any(h.stopped == "cancelled" for h in worker.ledger.held())


def test_a_pending_job_cancelled_never_runs(engine: Engine, start: Callable[..., Any]) -> None:
    first, second = enqueue(engine, 2)
    with Session(engine) as session:  # nothing happens until the caller commits
        assert cancel(session, Task, ids=[first]) == [first]
        session.rollback()
    assert job(engine, first).status == "pending"
    assert cancel_now(engine, [first]) == [first]
    assert cancel_now(engine, [first]) == []  # finished already: not cancelled again
    ran: list[int] = []
    worker = start(lambda j: ran.append(j.id))
    wait_for(lambda: job(engine, second).status == "done")
    row = job(engine, first)
    assert (row.status, row.attempts, ran) == ("cancelled", 0, [second])
    assert row.finished_at is not None and worker.stats.cancelled == 0


def test_cancel_checks_its_arguments_before_writing(engine: Engine) -> None:
    (job_id,) = enqueue(engine)
    with Session(engine) as session:
        with pytest.raises(ValueError, match="needs ids, queues or workflow"):
            cancel(session, Task)
        with pytest.raises(TypeError, match="not a single string"):
            cancel(session, Task, ids="12")
        with pytest.raises(TypeError, match="Session or a Connection"):
            cancel(object(), Task, ids=[job_id])  # type: ignore[call-overload]
        assert cancel(session, Task, ids=[]) == []
        assert cancel(session, Task, queues=["elsewhere"]) == []
        assert cancel(session, Task, queues=["default"]) == [job_id]  # by queue
        session.commit()
    assert job(engine, job_id).status == "cancelled"


def test_the_async_form_joins_the_callers_transaction(engine: Engine) -> None:
    first, second = enqueue(engine, 2)
    async_engine = async_engine_like(engine)

    async def scenario() -> None:
        async with AsyncSession(async_engine) as session:
            assert await cancel(session, Task, ids=[first]) == [first]
            await session.rollback()
            assert await cancel(session, Task, ids=[first, second]) == [first, second]
            await session.commit()
        async with async_engine.begin() as conn:  # an AsyncConnection too
            assert await cancel(conn, Task, ids=[first]) == []
        await async_engine.dispose()

    asyncio.run(scenario())
    assert job(engine, first).status == job(engine, second).status == "cancelled"


@pytest.mark.parametrize("runtime", ["asyncio"], indirect=True)
def test_a_running_async_handler_is_cancelled(engine: Engine, start: Callable[..., Any]) -> None:
    started = threading.Event()
    seen: list[tuple[bool, float]] = []

    async def handler(j: Any) -> None:
        started.set()
        try:
            await asyncio.Event().wait()  # never set: only the cancel ends it
        except asyncio.CancelledError:
            seen.append((current_job().cancelled, time.monotonic()))
            raise

    worker = start(handler)
    (job_id,) = enqueue(engine)
    assert started.wait(20)
    assert cancel_now(engine, [job_id]) == [job_id]
    wait_for(lambda: worker.stats.cancelled == 1, what="the cancelled attempt settled")
    assert [s[0] for s in seen] == [True]
    row = job(engine, job_id)
    assert (row.status, row.attempts, worker.stats.done, worker.stats.retried, worker.stats.lost) == (
        "cancelled", 1, 0, 0, 0)


@pytest.mark.parametrize("listen", [True, False], ids=["listen", "poll-only"])
def test_a_running_sync_handler_sees_the_flag(engine: Engine, start: Callable[..., Any], listen: bool) -> None:
    """A plain handler checks ``current_job()`` at its safe points; on a poll-only worker
    it is told within a poll interval (the heartbeat, a beat every 20 s here, is not
    what tells it)."""
    started = threading.Event()
    seen: list[tuple[bool, float]] = []

    def handler(j: Any) -> None:
        started.set()
        context = current_job()
        assert context.job.id == j.id and not context.should_stop
        context.wait(60)  # an interruptible sleep
        seen.append((context.cancelled, time.monotonic()))
        context.check()  # raises JobCancelled

    poll = 1.0
    worker = start(handler, listen=listen, poll_interval=poll, lease=60)
    (job_id,) = enqueue(engine)
    assert started.wait(20)
    committed = time.monotonic()
    assert cancel_now(engine, [job_id]) == [job_id]
    wait_for(lambda: worker.stats.cancelled == 1, what="the cancelled attempt settled")
    ((cancelled, noticed),) = seen
    assert cancelled
    # Well within the heartbeat's 20 s: the NOTIFY, or the watchdog's poll of the rows.
    assert noticed - committed < (5.0 if listen else poll + 5.0)
    assert job(engine, job_id).status == "cancelled" and worker.stats.lost == 0
    with pytest.raises(RuntimeError, match="only available inside"):
        current_job()
    assert issubclass(JobCancelled, Exception)


@pytest.mark.parametrize("when", ["told", "before-told"])
def test_a_transactional_handler_that_ignores_the_cancel_commits_nothing(
    engine: Engine, start: Callable[..., Any], runtime: Runtimes, when: str
) -> None:
    """Its writes roll back whatever it does: returning normally after the worker was
    told, or before the worker knew (the database's fence refuses the completion)."""
    started, release = threading.Event(), threading.Event()

    def handler(j: Any, session: Session) -> None:
        session.add(Effect(job_id=j.id, worker="w"))
        session.flush()
        started.set()
        release.wait(60)  # ignores the flag

    async def async_handler(j: Any, session: AsyncSession) -> None:
        session.add(Effect(job_id=j.id, worker="w"))
        await session.flush()
        started.set()
        while not release.is_set():  # ignores the flag; only the task's cancel stops it
            await asyncio.sleep(0.01)

    chosen = async_handler if runtime.name == "asyncio" else handler
    # Told: the NOTIFY tells the worker. Before told: nothing tells it for long (no
    # LISTEN, a poll every 60 s), and the handler returns right after the cancel.
    options = {} if when == "told" else {"listen": False, "poll_interval": 60, "lease": 120}
    (job_id,) = enqueue(engine)  # before the start: a worker that does not listen polls every minute
    worker = start(chosen, **options)
    try:
        assert started.wait(20)
        assert cancel_now(engine, [job_id]) == [job_id]
        if when == "told":
            wait_for(lambda: told(worker) or worker.stats.cancelled, what="the worker told of the cancel")
    finally:
        release.set()
    wait_for(lambda: worker.stats.cancelled + worker.stats.lost == 1, what="the attempt settled")
    assert effects_of(engine, job_id) == 0
    row = job(engine, job_id)
    assert (row.status, row.attempts) == ("cancelled", 1)
    # Refused by the cancel, not by another worker: counted as the cancel guide says.
    assert (worker.stats.done, worker.stats.cancelled, worker.stats.lost) == (0, 1, 0)


def test_a_cancel_heard_after_the_handler_returned_counts_as_cancelled(
    engine: Engine, start: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Job A's handler has returned, its outcome waits for its batch-mate B; B cancels A
    and returns once the worker's poll told A's attempt (after A's handler returned).
    The row is cancelled, and the worker counts and logs a cancel, not a lost lease.

    A and B share a batch once the worker has measured its handlers fast; on a loaded
    machine it may take a few pairs (each pair that ran apart ends both done)."""
    workers: list[Any] = []
    ran: list[str] = []
    together: list[int] = []

    def handler(j: Any) -> None:
        ran.append(j.payload.get("name", "warm"))
        if j.payload.get("name") == "b":
            held = [h for h in workers[0].ledger.held() if h.token.job_id == j.payload["a"]]
            if not held:
                return  # A ran in a batch of its own: the next pair
            (a,) = held
            together.append(a.token.job_id)
            assert cancel_now(engine, [a.token.job_id]) == [a.token.job_id]
            wait_for(lambda: a.stopped == "cancelled", what="the poll told A's attempt")

    # One executor and no LISTEN: the watchdog's poll is what hears the cancel.
    worker = start(handler, concurrency=1, batch_size=2, listen=False, poll_interval=0.1, lease=60)
    workers.append(worker)
    enqueue(engine)  # measured fast: the next claim takes two jobs, one batch
    wait_for(lambda: worker.stats.done == 1, what="the warm-up job")
    pairs = 0
    with caplog.at_level("INFO", logger="sqla_queue"):
        while not together:
            assert pairs < 20, f"no pair of jobs ran in one batch: {ran}"
            with sessionmaker(engine, class_=QueueSession)() as session:
                a = session.enqueue(Task(task="work", payload={"name": "a"}))
                session.flush()
                b = session.enqueue(Task(task="work", payload={"name": "b", "a": a.id}))
                session.commit()
                a_id, b_id = a.id, b.id
            pairs += 1
            wait_for(functools.partial(_settled, worker, 1 + 2 * pairs), what="both settled")
    assert together == [a_id] and ran[-2:] == ["a", "b"]
    assert (job(engine, a_id).status, job(engine, b_id).status) == ("cancelled", "done")
    assert (worker.stats.done, worker.stats.cancelled, worker.stats.lost) == (2 * pairs, 1, 0)
    assert "lease lost" not in caplog.text and f"job {a_id} attempt 1 cancelled" in caplog.text


def _settled(worker: Any, n: int) -> bool:
    return bool(worker.stats.done + worker.stats.cancelled + worker.stats.lost == n)


def test_a_cancel_racing_the_completion_has_one_winner(engine: Engine, start: Callable[..., Any]) -> None:
    """Each job ends done with its business row, or cancelled without one; ``cancel()``
    reports exactly the jobs it cancelled."""

    def handler(j: Any, session: Session) -> None:
        current_job().wait(random.uniform(0, 0.02))  # a job of varying length
        session.add(Effect(job_id=j.id, worker="w"))

    worker = start(handler, concurrency=3)
    ids = enqueue(engine, 60)
    wait_for(lambda: worker.stats.done >= 5, what="some jobs done")
    cancelled: set[int] = set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with engine.connect() as conn:
            open_ = list(conn.scalars(select(Task.id).where(Task.id.in_(ids), Task.status.in_(["pending", "running"]))))
        if not open_:
            break
        cancelled.update(cancel_now(engine, open_[:3]))
    with engine.connect() as conn:
        rows = {r.id: r.status for r in conn.execute(select(Task.id, Task.status).where(Task.id.in_(ids)))}
        counts = {r[0]: r[1] for r in conn.execute(select(Effect.job_id, func.count()).group_by(Effect.job_id))}
    assert set(rows.values()) <= {"done", "cancelled"}
    for job_id, status in rows.items():
        assert (status == "cancelled") == (job_id in cancelled), job_id
        assert counts.get(job_id, 0) == (1 if status == "done" else 0), job_id
    assert cancelled and any(s == "done" for s in rows.values())
    wait_for(lambda: not worker.ledger.held(), what="the worker let every job go")
    assert worker.stats.done == sum(1 for s in rows.values() if s == "done")


def test_a_cancelled_job_is_requeued_by_requeue(engine: Engine, start: Callable[..., Any], url: str,
                                                capsys: Any) -> None:
    first, second = enqueue(engine, 2)
    assert admin.cancel(engine, Task, ids=[first]) == [first]
    assert main(["cancel", "tests.models:Task", "--url", url, "--id", str(second)]) == 0
    assert "cancelled 1 job(s)" in capsys.readouterr().out
    assert admin.requeue(engine, Task, ids=[first]) == 0  # dead letters only, by default
    assert admin.requeue(engine, Task, ids=[first], statuses=["cancelled"]) == 1
    assert main(["requeue", "tests.models:Task", "--url", url, "--status", "cancelled"]) == 0
    assert "requeued 1 cancelled job(s)" in capsys.readouterr().out
    row = job(engine, first)
    assert (row.status, row.attempts, row.finished_at) == ("pending", 0, None)
    ran: list[int] = []
    start(lambda j: ran.append(j.id))
    wait_for(lambda: job(engine, first).status == job(engine, second).status == "done")
    assert sorted(ran) == [first, second]


def test_a_stopping_worker_tells_its_handlers_and_hands_back_one_that_gives_up(
    engine: Engine, start: Callable[..., Any], runtime: Runtimes
) -> None:
    """On ``stop()`` a handler that checks its job learns the worker is stopping
    (``check()`` raises ``JobCancelled("stopping")``); giving up hands the job back at
    once, well within the grace, instead of at its end with the work lost. The attempt
    counts: the handler ran."""
    started = threading.Event()
    seen: list[tuple[str, bool, bool]] = []

    def note(context: Any, exc: JobCancelled) -> None:
        seen.append((exc.reason, context.stopping, context.should_stop))

    def handler(j: Any) -> None:
        context = current_job()
        started.set()
        deadline = time.monotonic() + 15  # never told: it ends done, and the test fails
        while time.monotonic() < deadline:
            try:
                context.check()
            except JobCancelled as exc:
                note(context, exc)
                raise
            time.sleep(0.01)

    async def async_handler(j: Any) -> None:
        context = current_job()
        started.set()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                context.check()
            except JobCancelled as exc:
                note(context, exc)
                raise
            await asyncio.sleep(0.01)

    worker = start(async_handler if runtime.name == "asyncio" else handler)
    (job_id,) = enqueue(engine)
    assert started.wait(20)
    began = time.monotonic()
    worker.stop(grace=30)
    assert time.monotonic() - began < 10, "stop() waited out the grace"
    assert seen == [("stopping", True, False)]
    row = job(engine, job_id)
    assert (row.status, row.lease_owner, row.attempts) == ("pending", None, 1)
    assert (worker.stats.released, worker.stats.retried, worker.stats.lost, worker.stats.done) == (1, 0, 0, 0)


def test_a_handler_told_the_worker_stops_may_still_finish(engine: Engine, start: Callable[..., Any]) -> None:
    """A stop does not void the attempt: a handler that sees ``stopping`` and finishes
    within the grace completes its job. ``wait()`` is not woken by it (a handler that
    breaks out of its sleep when told to stop would return, and be recorded done)."""
    started = threading.Event()
    seen: list[tuple[bool, bool, bool]] = []

    def handler(j: Any) -> None:  # plain: an AsyncWorker runs it in its thread pool
        context = current_job()
        started.set()
        deadline = time.monotonic() + 15
        while not context.stopping and time.monotonic() < deadline:
            time.sleep(0.01)
        seen.append((context.stopping, context.should_stop, context.wait(0.05)))

    worker = start(handler)
    (job_id,) = enqueue(engine)
    assert started.wait(20)
    began = time.monotonic()
    worker.stop(grace=30)
    assert time.monotonic() - began < 10
    assert seen == [(True, False, False)]
    assert (job(engine, job_id).status, worker.stats.done, worker.stats.released) == ("done", 1, 0)
