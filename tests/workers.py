"""Fixtures and helpers for tests that run workers in this process (a pytest plugin).

Worker tests run against both runtimes, as one suite: the ``runtime`` fixture is
``thread`` (:class:`~sqla_queue.Worker`) or ``asyncio`` (:class:`~sqla_queue.AsyncWorker`,
on an event loop in a thread of its own, driven from the test through
:class:`LoopWorker`, with the registry's handlers turned into ``async def`` ones). A test
for one runtime only says so with ``@pytest.mark.parametrize("runtime", [...],
indirect=True)``.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest
from sqlalchemy import Engine, create_engine, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import sessionmaker

from sqla_queue import AsyncWorker, Backoff, QueueSession, Tasks, Worker
from sqla_queue.tasks import resolve_handler

from .helpers import table_of
from .models import Effect, Task
from .worker_app import tasks as app_tasks

#: Retries within a fraction of a second, so tests never wait on a real backoff.
FAST = Backoff(base=0.05, factor=2, cap=0.2, jitter=0)
TASKS = table_of(Task)


@pytest.fixture
def Sessions(engine: Engine) -> sessionmaker[QueueSession]:
    return sessionmaker(engine, class_=QueueSession)


T = TypeVar("T")

RUNTIMES = ["thread", "asyncio"]


class EventLoopThread:
    """An event loop running in a daemon thread, for sync tests of async code."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class LoopWorker:
    """An :class:`AsyncWorker` on an :class:`EventLoopThread`, with the thread Worker's
    blocking ``start``/``stop``/``run``; everything else is the async worker's own."""

    def __init__(self, worker: AsyncWorker, loop: EventLoopThread) -> None:
        self.worker = worker
        self._loop = loop

    def start(self) -> None:
        self._loop.run(self.worker.start())

    def stop(self, grace: float | None = None) -> None:
        self._loop.run(self.worker.stop(grace))

    def run(self, *, install_signal_handlers: bool = False, until_idle: bool = False) -> None:
        self._loop.run(self.worker.run(install_signal_handlers=False, until_idle=until_idle), timeout=None)

    def wait(self, *, until_idle: bool = False) -> None:
        self._loop.run(self.worker.wait(until_idle=until_idle), timeout=None)

    def with_options(self, **options: Any) -> LoopWorker:
        return LoopWorker(self.worker.with_options(**options), self._loop)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


def asyncified(handler: Any) -> Any:
    """The same handler as ``async def``: a plain one awaits a thread running it; a
    transactional one gets an ``AsyncSession`` and runs through ``run_sync``."""
    if isinstance(handler, Tasks):
        tasks = Tasks()
        for name in handler:
            tasks.register(name, asyncified(handler.lookup(name).fn))
        for schedule in handler.schedules:
            tasks.schedule(schedule)
        return tasks
    if asyncio.iscoroutinefunction(handler):
        return handler
    fn = handler
    if resolve_handler(fn).transactional:

        async def transactional(job: Any, session: AsyncSession) -> Any:
            return await session.run_sync(lambda sync: fn(job, sync))

        return transactional

    async def plain(job: Any) -> Any:
        return await asyncio.to_thread(fn, job)

    return plain


_CONNECT_ARGS: weakref.WeakKeyDictionary[Engine, dict[str, Any]] = weakref.WeakKeyDictionary()


def engine_with(url: Any, **connect_args: Any) -> Engine:
    """``create_engine(url, connect_args=...)``, remembered for :func:`async_engine_like`."""
    engine = create_engine(url, connect_args=connect_args)
    _CONNECT_ARGS[engine] = connect_args
    return engine


def async_engine_like(engine: Engine) -> AsyncEngine:
    """An asyncio engine on the same URL, with the same ``connect_args`` when the engine
    came from :func:`engine_with`, and the same execution options (a
    ``schema_translate_map``, say)."""
    made = create_async_engine(engine.url, connect_args=_CONNECT_ARGS.get(engine, {}))
    options = engine.get_execution_options()
    return made.execution_options(**options) if options else made


class Runtimes:
    """Builds workers of one runtime; disposes of what it made. Each asyncio worker gets
    an event loop (and an engine) of its own, as if it ran in a process of its own."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._made: list[tuple[EventLoopThread, AsyncEngine]] = []

    def worker(self, engine: Engine, model: Any, handler: Any, **options: Any) -> Any:
        """A ``Worker``, or a :class:`LoopWorker`, not started."""
        if self.name == "thread":
            return Worker(engine, model, handler, **options)
        loop, async_engine = EventLoopThread(), async_engine_like(engine)
        self._made.append((loop, async_engine))
        return LoopWorker(AsyncWorker(async_engine, model, asyncified(handler), **options), loop)

    def close(self) -> None:
        for loop, async_engine in self._made:
            loop.run(async_engine.dispose())
            loop.close()


@pytest.fixture(params=RUNTIMES)
def runtime(request: pytest.FixtureRequest) -> Iterator[Runtimes]:
    """The runtime a worker test runs on: ``thread`` or ``asyncio``."""
    runtimes = Runtimes(request.param)
    yield runtimes
    runtimes.close()


@pytest.fixture
def make_worker(runtime: Runtimes) -> Callable[..., Any]:
    """``make_worker(engine, model, handler, **options)``: an unstarted worker of the
    test's runtime (stopping it is the test's business)."""
    return runtime.worker


@pytest.fixture
def start_worker(engine: Engine, runtime: Runtimes) -> Iterator[Callable[..., Any]]:
    """``start_worker(handler=app_tasks, model=Task, **options)``: a started worker with
    test-friendly timings; every worker started is stopped after the test."""
    started: list[Any] = []

    def start(handler: Any = app_tasks, model: Any = Task, **options: Any) -> Any:
        options.setdefault("backoff", FAST)
        options.setdefault("poll_interval", 0.5)
        options.setdefault("sweep_interval", 0.2)
        options.setdefault("shutdown_grace", 5)
        worker = runtime.worker(engine, model, handler, **options)
        worker.start()
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop(grace=1)


def add(Sessions: sessionmaker[QueueSession], task: str, n: int = 1, **payload: Any) -> list[int]:
    """Enqueue ``n`` tasks named ``task`` with ``payload``; options are taken from it."""
    options = {k: payload.pop(k) for k in ("max_attempts", "queue", "priority") if k in payload}
    with Sessions() as session:
        jobs = [session.enqueue(Task(task=task, payload=dict(payload)), **options) for _ in range(n)]
        session.commit()
        return [job.id for job in jobs]


def job(engine: Engine, job_id: int) -> Any:
    with engine.connect() as conn:
        return conn.execute(select(TASKS).where(TASKS.c.id == job_id)).one()


def status_is(engine: Engine, job_id: int, *statuses: str) -> Callable[[], bool]:
    return lambda: job(engine, job_id).status in statuses


def all_status(engine: Engine, ids: list[int], *statuses: str) -> Callable[[], bool]:
    def check() -> bool:
        with engine.connect() as conn:
            found = conn.execute(select(TASKS.c.status).where(TASKS.c.id.in_(ids))).scalars().all()
        return len(found) == len(ids) and all(s in statuses for s in found)

    return check


def claimed_by(lease_owner: str | None, worker: Any) -> bool:
    """Whether ``lease_owner`` names one of ``worker``'s executors (each claims under a
    name of its own, ``{worker.owner}/{executor}.{n}``)."""
    return lease_owner is not None and lease_owner.startswith(f"{worker.owner}/")


def effects(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(Effect).order_by(Effect.id)))
