"""The asyncio worker: the same runtime, its services as tasks on your event loop.

:class:`AsyncWorker` is a thin layer over the one runtime of :class:`~sqla_queue.Worker`,
as SQLAlchemy's ``AsyncSession`` is over ``Session``: the services (executors, sweeper,
listener) run as tasks on the loop that started the worker, their code in greenlets, and
every database call is awaited on psycopg's asyncio connections of your ``AsyncEngine``.
The heartbeat runs on a thread and event loop of its own, so a handler that blocks the
loop cannot cost the worker its leases. Same services, ledger, outcome path and fences;
only the driver (:class:`~sqla_queue.driver.AsyncDriver`) differs.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import replace
from functools import partial
from types import TracebackType
from typing import Any, Generic, TypeVar, overload

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session

from ..driver import AsyncDriver, Driver
from ..enqueue.session import AsyncQueueSession
from ..model import ClaimToken
from ..periodic import Schedule
from ..runtime import run_in_greenlet
from ..tasks import Handler, ResolvedHandler, TaskRegistry
from . import Worker
from .config import WorkerConfig, check_options
from .executor import ExecutorPool
from .heartbeat import Heartbeat
from .hooks import Hooks, WorkerObserver
from .ledger import Ledger
from .listener import Listener
from .pruner import Pruner
from .scheduler import Scheduler
from .service import Service
from .stats import WorkerStats
from .sweeper import Sweeper
from .watchdog import Watchdog
from .work_signal import WorkSignal

__all__ = ["AsyncWorker"]


class _Runtime(Worker):
    """The thread Worker's lifecycle, on an :class:`AsyncDriver`."""

    def _make_driver(self, engine: Any) -> Driver:
        return AsyncDriver(engine, threads=self.config.concurrency)

    def _default_sessions(self, engine: Any) -> Callable[[], Any]:
        return async_sessionmaker(engine, class_=AsyncQueueSession)

    def _check_handler(self, handler: ResolvedHandler) -> None:
        """Every kind runs: ``async def`` as tasks, plain functions in a thread pool."""

    def _check_job_context(self, job_context: Callable[[], Any]) -> None:
        """Plain and async context managers both: an async one is awaited."""


T = TypeVar("T")


class _Delegated(Generic[T]):
    """An attribute of the driven :class:`Worker`, read through: the AsyncWorker adds no
    state of its own to what the thread Worker offers."""

    def __set_name__(self, owner: type[Any], name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, objtype: type[Any] | None = None) -> _Delegated[T]: ...

    @overload
    def __get__(self, obj: AsyncWorker, objtype: type[Any] | None = None) -> T: ...

    def __get__(self, obj: AsyncWorker | None, objtype: type[Any] | None = None) -> T | _Delegated[T]:
        if obj is None:
            return self
        value: T = getattr(obj._runtime, self.name)
        return value


class AsyncWorker:
    """Run ``handler`` for the jobs of ``model``'s table, on the running event loop.

    ``handler`` takes ``(job)`` or ``(job, session)`` and may be ``async def`` or a plain
    function, or it is a :class:`~sqla_queue.Tasks` registry of either kind. A
    transactional ``async def handler(job, session)`` gets an ``AsyncSession`` (default:
    an :class:`~sqla_queue.AsyncQueueSession` on ``engine``) joined to the worker's
    transaction: its writes commit with the job's completion, exactly once. Plain
    handlers run in a thread pool of ``concurrency`` threads; a plain transactional one
    runs on the loop with a synchronous session, as ``AsyncSession.run_sync`` does.

    ``concurrency`` is the number of jobs run at once, each by a task with its own
    connection. Start, stop and run it from one event loop. ``job_context`` is the
    thread Worker's, and may also make an async context manager, awaited in the job's
    task (an ``@asynccontextmanager`` function, for example). ``observers`` are the
    thread Worker's: plain objects, called on a thread of their own, never on the loop.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        model: Any,
        handler: Handler | TaskRegistry,
        *,
        config: WorkerConfig | None = None,
        session_factory: Callable[[], AsyncSession | Session] | None = None,
        job_context: Callable[[], AbstractContextManager[Any] | AbstractAsyncContextManager[Any]] | None = None,
        observers: Sequence[WorkerObserver] = (),
        **options: Any,
    ) -> None:
        self._runtime = _Runtime(
            engine,  # type: ignore[arg-type]
            model,
            handler,
            config=config,
            session_factory=session_factory,  # type: ignore[arg-type]  # AsyncDriver takes both kinds
            job_context=job_context,  # type: ignore[arg-type]  # the async kind too
            observers=observers,
            **options,
        )

    # -- what the thread Worker offers too ---------------------------------------------

    engine: _Delegated[AsyncEngine] = _Delegated()
    model: _Delegated[Any] = _Delegated()
    handler: _Delegated[Handler | TaskRegistry] = _Delegated()
    config: _Delegated[WorkerConfig] = _Delegated()
    session_factory: _Delegated[Callable[[], Any]] = _Delegated()
    owner: _Delegated[str] = _Delegated()
    stats: _Delegated[WorkerStats] = _Delegated()
    ledger: _Delegated[Ledger] = _Delegated()
    signal: _Delegated[WorkSignal] = _Delegated()
    executors: _Delegated[ExecutorPool] = _Delegated()
    heartbeat: _Delegated[Heartbeat] = _Delegated()
    watchdog: _Delegated[Watchdog] = _Delegated()
    sweeper: _Delegated[Sweeper | None] = _Delegated()
    listener: _Delegated[Listener | None] = _Delegated()
    scheduler: _Delegated[Scheduler | None] = _Delegated()
    pruner: _Delegated[Pruner | None] = _Delegated()
    schedules: _Delegated[tuple[Schedule, ...]] = _Delegated()
    stopped: _Delegated[bool] = _Delegated()
    observers: _Delegated[tuple[WorkerObserver, ...]] = _Delegated()
    hooks: _Delegated[Hooks] = _Delegated()

    @property
    def worker(self) -> Worker:
        """The thread :class:`~sqla_queue.Worker` whose services this one runs as tasks."""
        return self._runtime

    def services(self) -> list[Service]:
        return self._runtime.services()

    def held(self) -> list[ClaimToken]:
        """Tokens of the jobs this worker holds right now."""
        return self._runtime.held()

    def idle(self) -> bool:
        """No job held, every executor waiting for work, none due within the poll."""
        return self._runtime.idle()

    def request_stop(self) -> None:
        """Ask :meth:`run` to stop gracefully (from any thread; returns at once)."""
        self._runtime.request_stop()

    def abort(self) -> None:
        """Stop without waiting for running jobs: :meth:`stop` hands everything back at
        once and cancels their tasks (from any thread; returns at once)."""
        self._runtime.abort()

    def on_signal(self, signum: int) -> None:
        """What SIGTERM/SIGINT do to a running worker: the first asks for a graceful stop,
        a second for an :meth:`abort`. For code that installs its own handlers."""
        self._runtime.on_signal(signum)

    @staticmethod
    def check_options(**options: Any) -> None:
        """Raise now (TypeError, ValueError) for options a worker would refuse later."""
        check_options(**options)

    def with_options(self, **options: Any) -> AsyncWorker:
        """A new, unstarted worker like this one with some options changed."""
        if not options:
            return self
        return AsyncWorker(
            self.engine,
            self.model,
            self.handler,
            config=replace(self.config, **options),
            session_factory=self.session_factory,
            job_context=self._runtime.job_context,
            observers=self.observers,
        )

    # -- lifecycle, awaited ------------------------------------------------------------

    async def start(self) -> None:
        """Check the database and the table, start every service, and return.

        Raises :class:`~sqla_queue.WorkerStartError` (one clear line) when the database
        cannot be reached or the table is missing or lacks the queue columns.
        """
        await run_in_greenlet(self._runtime.start)

    async def stop(self, grace: float | None = None) -> None:
        """Stop claiming, let running jobs finish within ``grace``, hand back the rest
        and cancel their tasks. Returns within ``grace`` plus a few seconds."""
        await run_in_greenlet(self._runtime.stop, grace)

    async def wait(self, *, until_idle: bool = False) -> None:
        """Until a stop is asked for (:meth:`request_stop`, a signal) or, with
        ``until_idle``, until no job is runnable, none is running, and none falls due
        within ``poll_interval``. :meth:`run` is :meth:`start`, this, then :meth:`stop`."""
        await run_in_greenlet(partial(self._runtime.wait, until_idle=until_idle))

    async def run(self, *, install_signal_handlers: bool = True, until_idle: bool = False) -> None:
        """Run until stopped (SIGTERM/SIGINT, :meth:`request_stop`), then stop gracefully.

        The first signal stops claiming and lets running jobs finish within
        ``shutdown_grace``; a second one hands everything back at once. Cancelling the
        task that awaits ``run()`` is that second signal: everything is handed back, the
        handlers' tasks are cancelled, and ``CancelledError`` propagates.
        """
        loop = asyncio.get_running_loop()
        installed: list[signal.Signals] = []
        if install_signal_handlers and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._runtime.on_signal, sig)
                installed.append(sig)
        try:
            await self.start()
            try:
                await self.wait(until_idle=until_idle)
            except asyncio.CancelledError:
                self._runtime.abort()
                await self.stop(grace=0)
                raise
            await self.stop()
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    async def __aenter__(self) -> AsyncWorker:
        await self.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
