"""The worker: services that claim jobs, run handlers and keep every lease honest.

A :class:`Worker` builds and supervises services that share one start/stop shape
(:mod:`.service`) and one :class:`~.ledger.Ledger` of held jobs, and talk to PostgreSQL
only through the :class:`~sqla_queue.driver.Driver`:

- the **executors** (``concurrency`` threads, :mod:`.executor`): each claims a batch on
  its own connection (:mod:`.producer`), runs the handlers, and hands every outcome to
  the **completer** (:mod:`.completer`), the one path by which results reach the table;
- the **heartbeat** (:mod:`.heartbeat`) extends the leases of every held job;
- the **sweeper** (:mod:`.sweeper`) returns the jobs of dead workers (expired leases, or
  ended sessions);
- the **listener** (:mod:`.listener`) turns NOTIFY into wake-ups and holds the worker's
  session lock (unless ``listen=False``);
- the **scheduler** (:mod:`.scheduler`) enqueues periodic jobs, each tick once across
  every worker (when the worker has schedules);
- the **pruner** (:mod:`.pruner`) deletes finished jobs past their ``retention`` (when set).

Services get one :class:`~.context.WorkerContext` (the config, the ledger, the driver,
the queue table's operations :class:`~sqla_queue.ops.QueueOps`, the signal, the
counters, the owner name), never the worker. No SQL is written or picked here:
the operations object runs the statements of :mod:`sqla_queue.sql`.
"""

from __future__ import annotations

import inspect
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from types import FrameType
from typing import Any, ClassVar, Protocol

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from ..driver import DbConnection, Driver, WorkerStartError
from ..enqueue.session import QueueSession
from ..enqueue.values import enqueue_values
from ..model import ClaimToken, QueueTable, flow_rules, queue_table
from ..ops import SESSION_MARK, QueueOps, RetentionOps, ScheduleOps
from ..periodic import Schedule, check_schedules
from ..rules import check_retention, rate_periods
from ..runtime import Event, is_async_callable
from ..tasks import Handler, ResolvedHandler, TaskRegistry, resolve_handler
from .completer import Completer
from .config import WorkerConfig, check_options
from .context import WorkerContext
from .executor import Executor, ExecutorPool, Lane
from .heartbeat import Heartbeat
from .hooks import Hooks, JobEvent, JobOutcome, WorkerObserver
from .ledger import Ledger
from .listener import Listener
from .producer import Producer
from .pruner import Pruner
from .scheduler import Scheduler
from .service import Service
from .stats import WorkerStats
from .sweeper import Sweeper
from .watchdog import Watchdog
from .work_signal import WorkSignal

__all__ = [
    "JobEvent", "JobOutcome", "Worker", "WorkerConfig", "WorkerObserver", "WorkerStartError", "WorkerStats",
]

log = logging.getLogger("sqla_queue.worker")


class MetricsExporter(Protocol):
    """What a worker's ``metrics_port`` sets up: an observer the worker adds to its own,
    and an exporter started with the worker."""

    observer: WorkerObserver

    def start(self) -> None: ...


#: How long stop() gives the hand-back of jobs, and then the services to end. Jobs are
#: handed back in chunks, each committed on its own within a deadline of its own (a
#: second, and a millisecond a job): a stalled server costs one chunk's deadline, while a
#: slow one that keeps up is not cut off half-way (ten thousand rows under the worst plan
#: take several seconds on a loaded machine).
_HAND_BACK_SECONDS = 1.0
#: The deadline of ``until_idle``'s look at the table before it returns.
_IDLE_CHECK_SECONDS = 2.0
_HAND_BACK_CHUNK = 1000
_HAND_BACK_PER_JOB = 0.001
_JOIN_SECONDS = 1.0
#: How long stop() waits for the handlers it cancelled after the grace to end (their
#: ``except`` and ``finally`` clauses), apart from the services' joins.
_CLEAN_UP_SECONDS = 1.0
#: How long stop() waits for claims already sent (a claim takes milliseconds; one that
#: hangs is cut by its deadline, and its executor gives back what it took).
_CLAIMS_IN_FLIGHT_SECONDS = 1.0


class Worker:
    """Run ``handler`` for the jobs of ``model``'s table.

    ``handler`` is a callable taking ``(job)`` or ``(job, session)``, or a
    :class:`~sqla_queue.Tasks` registry for a task table. ``job`` is an instance of
    ``model`` built from the claimed row (detached: ``session.add(job)`` to change it in a
    transactional handler).

    ``session_factory`` makes the sessions of transactional handlers (default: a
    :class:`~sqla_queue.QueueSession` on ``engine``, so handlers can enqueue follow-ups);
    they are joined to the worker's transaction on ``engine`` (see the handlers guide).
    ``job_context`` makes a context manager entered around every job in its thread
    (Flask's ``app.app_context``, a tracing span...); it sees what the handler raised,
    and a job whose exception it swallows has still failed. ``observers``
    (:class:`~sqla_queue.WorkerObserver`) see every claim, run and end of a job, on a
    thread of their own (see the monitoring guide). Every connection the worker uses is made by
    ``engine`` (its URL, ``connect_args`` and events) but kept out of its pool: one per
    executor thread, and one each for the heartbeat, the sweeper and the listener.
    """

    #: Makes the :class:`MetricsExporter` of the ``metrics_port`` option, from ``(port,
    #: engine, model)``. The worker knows no metrics library: the package sets this to
    #: the Prometheus plugin's (in ``sqla_queue/__init__.py``, importing
    #: :mod:`sqla_queue.prometheus` only when a worker asks for it). None: none can be served.
    metrics_exporter: ClassVar[Callable[[int, Any, Any], Any] | None] = None

    def __init__(
        self,
        engine: Engine,
        model: Any,
        handler: Handler | TaskRegistry,
        *,
        config: WorkerConfig | None = None,
        session_factory: Callable[[], Session] | None = None,
        job_context: Callable[[], AbstractContextManager[Any]] | None = None,
        observers: Sequence[WorkerObserver] = (),
        **options: Any,
    ) -> None:
        self.engine = engine
        self.model = model
        self.handler = handler
        if job_context is not None:
            self._check_job_context(job_context)
        self.job_context = job_context
        self.config = replace(config, **options) if config is not None else check_options(**options)
        self._qt: QueueTable = queue_table(model)
        if self._qt.mapped_class is None:
            raise TypeError(f"{type(self).__name__} needs a mapped model class, not a Table")
        resolved = self._resolve_handlers(handler)
        self._driver = self._make_driver(engine)
        self.session_factory = session_factory or self._default_sessions(engine)
        name = self.config.name or f"{socket.gethostname()}:{os.getpid()}"
        # A listening worker holds a session lock on its listener's connection, and says
        # so in its name: a sweep returns its jobs soon after that session ends.
        self.owner = f"{name}:{uuid.uuid4().hex[:8]}" + (SESSION_MARK if self.config.listen else "")
        self.stats = WorkerStats()
        self.ledger = Ledger()
        self.signal = WorkSignal(self.config.concurrency)
        self.observers = self._check_observers(observers)
        cfg, driver = self.config, self._driver
        table = self._qt.table
        every = list(self.observers)
        self._metrics: MetricsExporter | None = None
        if cfg.metrics_port is not None:
            make = Worker.metrics_exporter
            if make is None:
                raise RuntimeError("metrics_port: no metrics exporter is installed (sqla_queue sets one)")
            self._metrics = make(cfg.metrics_port, engine, self.model)
            every.append(self._metrics.observer)
        self._declare_labels(every, resolved)
        self.hooks = Hooks(
            self.stats, every, cfg.observer_queue_size, driver.table_name(table),
            has_task=self._qt.is_task_table, has_trace="trace_context" in table.c,
        )

        ops = self._ops = QueueOps(
            driver, self._qt.mapped_class, queues=cfg.queues, lease=cfg.lease, heartbeat=cfg.effective_heartbeat,
            statement_deadline=cfg.statement_deadline, timeout=cfg.timeout,
            task_timeouts=resolved.timeouts() if isinstance(resolved, TaskRegistry) else None,
        )
        ctx = self._context = WorkerContext(
            cfg, self.ledger, driver, ops, self.signal, self.stats, self.owner, self.hooks
        )
        self._producer = Producer(ctx)
        completer = self._completer = Completer(ctx)
        executor = Executor(ctx, resolved, self.session_factory, job_context)
        self.executors = ExecutorPool(ctx, self._producer, executor, completer)
        self.heartbeat = Heartbeat(ctx, completer)
        #: Tells handlers their attempt is over (deadlines; cancels when polling only).
        self.watchdog = Watchdog(ctx)
        executor.watchdog = self.watchdog
        self.sweeper = Sweeper(ctx, self._producer) if cfg.sweep_interval > 0 else None
        self.listener = Listener(ctx, on_swept=self._producer.look_for_isolated) if cfg.listen else None
        if self.sweeper is not None and ops.settles_edges:
            ops.on_owed = self.sweeper.wake  # children left to count: settle them now
        schedules = self.schedules
        self.scheduler = (
            Scheduler(ctx, ScheduleOps(self._qt.mapped_class, enqueue_values), schedules)
            if schedules and cfg.periodic
            else None
        )
        ages = cfg.retention_ages
        check_retention(self._qt.table.name, flow_rules(self._qt.table), ages)
        self.pruner = (
            Pruner(ctx, RetentionOps(driver, self._qt.mapped_class, ages, limit=cfg.retention_batch)) if ages else None
        )
        self._stopping = Event()
        self._hard_stop = Event()
        self._stopped = Event()
        self._started = False

    # -- what the asyncio worker changes -----------------------------------------------

    def _make_driver(self, engine: Any) -> Driver:
        return Driver(engine)

    def _default_sessions(self, engine: Any) -> Callable[[], Any]:
        return sessionmaker(engine, class_=QueueSession)

    def _check_job_context(self, job_context: Callable[[], Any]) -> None:
        if is_async_callable(job_context) or inspect.isasyncgenfunction(getattr(job_context, "__wrapped__", None)):
            raise TypeError(
                "job_context makes an async context manager: the thread Worker cannot enter it; "
                "run on sqla_queue.AsyncWorker, or pass a plain context manager factory"
            )

    def _declare_labels(self, observers: Sequence[WorkerObserver], resolved: Any) -> None:
        """Tell the observers that take label values (the Prometheus metrics': a
        ``declare_labels(tasks=, queues=)`` method) the task and queue names this worker
        registered or declared: the only ones they take (a row's names alone would grow
        the series without bound)."""
        found = [d for d in (getattr(o, "declare_labels", None) for o in observers) if callable(d)]
        if not found:
            return
        tasks = list(resolved) if isinstance(resolved, TaskRegistry) else []
        queues = [*(self.config.queues or ()), *(s.queue for s in self.schedules if s.queue is not None)]
        default = getattr(self._qt.c.queue.default, "arg", None) if "queue" in self._qt.c else None
        if isinstance(default, str):
            queues.append(default)
        for declare in found:
            declare(tasks=tasks, queues=queues)

    @staticmethod
    def _check_observers(observers: Sequence[WorkerObserver]) -> tuple[WorkerObserver, ...]:
        if isinstance(observers, WorkerObserver):
            observers = (observers,)
        found = tuple(observers)
        for observer in found:
            if not isinstance(observer, WorkerObserver):
                raise TypeError(f"observers must be sqla_queue.WorkerObserver instances, got {observer!r}")
        return found

    def _check_handler(self, handler: ResolvedHandler) -> None:
        if is_async_callable(handler.fn):
            raise TypeError(
                f"handler {handler.name!r} is a coroutine function: the thread Worker cannot await "
                f"it; run it on sqla_queue.AsyncWorker, or make it a plain function"
            )

    def _resolve_handlers(self, handler: Handler | TaskRegistry) -> ResolvedHandler | TaskRegistry:
        if isinstance(handler, TaskRegistry):
            if not self._qt.is_task_table:
                raise TypeError(f"a Tasks registry needs a TaskMixin model, {self.model!r} is not one")
            own = handler.model
            if own is not None and queue_table(own).table is not self._qt.table:
                # Its task functions enqueue into that table: this worker would never see their jobs.
                raise ValueError(
                    f"this Tasks registry enqueues into {queue_table(own).table.name!r}, not into "
                    f"{self._qt.table.name!r}, the table of this worker"
                )
            for name in handler:
                self._check_handler(handler.lookup(name))
            return handler
        resolved = resolve_handler(handler)
        self._check_handler(resolved)
        return resolved

    @staticmethod
    def check_options(**options: Any) -> None:
        """Raise now (TypeError, ValueError) for options a worker would refuse later."""
        check_options(**options)

    def with_options(self, **options: Any) -> Worker:
        """A new, unstarted worker like this one with some options changed."""
        if not options:
            return self
        return type(self)(
            self.engine,
            self.model,
            self.handler,
            config=replace(self.config, **options),
            session_factory=self.session_factory,
            job_context=self.job_context,
            observers=self.observers,
        )

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def schedules(self) -> tuple[Schedule, ...]:
        """The periodic schedules this worker runs: its ``schedules`` option and those of
        its Tasks registry (``@tasks.periodic``)."""
        own = self.handler.schedules if isinstance(self.handler, TaskRegistry) else ()
        return check_schedules([*own, *self.config.schedules])

    def services(self) -> list[Service]:
        found: list[Service | None] = [
            self.heartbeat, self.watchdog, self.sweeper, self.listener, self.scheduler, self.pruner, self.executors,
        ]
        return [s for s in found if s is not None]

    def start(self) -> None:
        """Check the database and the table, start every service, and return.

        Raises :class:`~sqla_queue.driver.WorkerStartError` (one clear line) when the
        database cannot be reached or the table is missing or lacks the queue columns.
        """
        if self._started:
            raise RuntimeError("worker already started")
        table = self._qt.table
        self._ops.check_table()
        if self.scheduler is not None:
            self.scheduler.check()
        self._started = True
        self.hooks.start()
        if self._metrics is not None:
            self._metrics.start()
        cfg = self.config
        log.info(
            "worker %s starting: table=%s queues=%s concurrency=%d lease=%.1fs",
            self.owner, self._driver.table_name(table), ",".join(cfg.queues) if cfg.queues else "*",
            cfg.concurrency, cfg.lease,
        )
        for service in self.services():
            service.start()

    def run(self, *, install_signal_handlers: bool = True, until_idle: bool = False) -> None:
        """Run until stopped (SIGTERM/SIGINT, :meth:`request_stop`), then shut down gracefully.

        The first signal stops claiming and lets running jobs finish within
        ``shutdown_grace``; a second one hands everything back at once.
        ``until_idle=True`` stops once no job is runnable, none is running, and none
        falls due within ``poll_interval`` (for scripts and tests).
        """
        previous: dict[signal.Signals, Any] = {}
        if install_signal_handlers and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, self._on_signal)
        try:
            self.start()
            self.wait(until_idle=until_idle)
            self.stop()
        finally:
            for sig, old_handler in previous.items():
                signal.signal(sig, old_handler)

    def wait(self, *, until_idle: bool = False) -> None:
        """Block until a stop is asked for (:meth:`request_stop`, :meth:`on_signal`) or,
        with ``until_idle``, until the worker is idle (see :meth:`idle`) for a moment.
        :meth:`run` is :meth:`start`, this, then :meth:`stop`."""
        quiet_since: float | None = None
        while not self._stopping.is_set():
            if until_idle:
                if self.idle():
                    quiet_since = quiet_since or time.monotonic()
                    if time.monotonic() - quiet_since >= 0.05:
                        if not self._due_soon():
                            return
                        self.signal.wake()
                        quiet_since = None
                else:
                    quiet_since = None
            self._stopping.wait(0.02 if until_idle else 1.0)

    def idle(self) -> bool:
        """No job held, every executor waiting for work, none due within the poll."""
        return not len(self.ledger) and self.signal.quiet(self.config.concurrency, self.config.poll_interval)

    def _due_soon(self) -> bool:
        """Whether the table holds a job of this worker's queues that fell due a moment
        ago or falls due within the poll: the last word before ``until_idle`` returns.
        The in-memory view (:meth:`idle`) keeps the client's estimate of a retry's due
        time, which can come before the server's ``run_after``; the row is what counts.
        A database that cannot answer counts as nothing due (the worker could not claim
        it either)."""
        answer = [False]

        # Jobs a rate limit holds back are due when its window frees a start: within
        # its period, which may be longer than the poll.
        horizon = max([self.config.poll_interval, *rate_periods(flow_rules(self._qt.table))])

        def check(conn: DbConnection) -> None:
            seconds = self._ops.next_due(conn)
            answer[0] = seconds is not None and seconds <= horizon

        failed = self._on_own_connection(check, "idle check", _IDLE_CHECK_SECONDS)
        if failed is not None:
            log.debug("worker %s: idle check failed (%s)", self.owner, failed)
        return answer[0]

    def _on_own_connection(
        self, work: Callable[[DbConnection], None], purpose: str, budget: float
    ) -> Exception | None:
        """Run ``work`` on a connection of its own, spawned on the runtime (a thread, or a
        task of the loop), within ``budget`` seconds; returns what it raised, if anything.
        The connection is closed after it."""
        lane = Lane(self._driver, f"sqla_queue {purpose}")
        done = Event()
        failure: list[Exception] = []

        def run() -> None:
            try:
                conn = lane.connect()
                with self._driver.deadline(conn, budget):
                    work(conn)
            except Exception as exc:  # noqa: BLE001 - the caller says what it means
                failure.append(exc)
            finally:
                lane.reset()
                done.set()

        self._driver.runtime.spawn(run, f"sqla_queue-{purpose.replace(' ', '-')}")
        done.wait(budget + 0.5)
        return failure[0] if failure else None

    def on_signal(self, signum: int) -> None:
        """What SIGTERM/SIGINT do to a running worker: the first asks for a graceful stop,
        a second for an :meth:`abort`. For code that installs its own handlers."""
        if self._stopping.is_set():
            log.warning("worker %s: second signal, stopping now", self.owner)
            self.abort()
        else:
            log.info("worker %s: %s received, finishing running jobs (grace %.1fs)",
                     self.owner, signal.Signals(signum).name, self.config.shutdown_grace)
        self._stopping.set()

    def abort(self) -> None:
        """Stop without waiting for running jobs: :meth:`stop` hands everything back at
        once (thread-safe, returns at once)."""
        self._hard_stop.set()
        self._stopping.set()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.on_signal(signum)

    def request_stop(self) -> None:
        """Ask :meth:`run` to stop gracefully (thread-safe, returns at once)."""
        self._stopping.set()

    def stop(self, grace: float | None = None) -> None:
        """Stop claiming, let running jobs finish within ``grace``, hand back the rest.

        Returns within ``grace`` plus a few seconds, whatever the database or the
        handlers are doing: every statement it runs has a deadline.
        """
        if self._stopped.is_set():
            return
        self._stopping.set()
        if not self._started:
            self._stopped.set()
            return
        self.executors.request_stop()
        for early in (self.scheduler, self.pruner):  # no new jobs, no deletes, while jobs finish
            if early is not None:
                early.request_stop()
        grace = self.config.shutdown_grace if grace is None else grace
        # A claim already sent lands its rows in the ledger before the hand-back below
        # looks, and none starts after it: a job handed back is not claimed again here.
        self.ledger.close_claims(_CLAIMS_IN_FLIGHT_SECONDS)
        waiting = self.ledger.take_unstarted()
        if waiting:
            self._hand_back(waiting, refund=True)
        for running in self.ledger.held():  # a handler that cannot finish in the grace may give up
            running.tell_stopping()
        self.ledger.wait_empty(grace, self._hard_stop)
        left = self.ledger.held()
        if left:
            log.warning("worker %s: %d job(s) still running after the grace period; handing them back",
                        self.owner, len(left))
            self._hand_back(left, refund=False)
            # Cancelled handlers run their clean-up before stop() returns (a budget of
            # its own: on a busy machine the services' joins below may eat theirs).
            self._driver.runtime.interrupt(_CLEAN_UP_SECONDS)
        # Every service is asked at once, then all are joined against one deadline; an
        # executor still inside a handler that outlived the grace is left to finish alone.
        others: list[Service] = [
            s for s in (self.heartbeat, self.watchdog, self.sweeper, self.listener, self.scheduler, self.pruner)
            if s is not None
        ]
        for service in others:
            service.request_stop()
        deadline = time.monotonic() + _JOIN_SECONDS
        for service in [*others, self.executors]:
            service.join(max(deadline - time.monotonic(), 0.0))
        if self._ops.records_workers:  # its row goes with it (a dead worker's is pruned later)
            failed = self._on_own_connection(lambda conn: self._ops.forget_worker(conn, self.owner), "forget", 2.0)
            if failed is not None:
                log.warning("worker %s: could not delete its row of the workers table (%s)", self.owner, failed)
        self._driver.runtime.close()
        self.hooks.stop()
        self._stopped.set()
        log.info("worker %s stopped: %s", self.owner, self.stats)

    def _hand_back(self, held: list[Any], *, refund: bool) -> None:
        """Release ``held`` on a connection of its own, in chunks of 1,000, each within
        a deadline of a second plus a millisecond a job (what is not handed back when one
        overruns returns after its lease)."""
        chunks = [held[first:first + _HAND_BACK_CHUNK] for first in range(0, len(held), _HAND_BACK_CHUNK)]
        deadlines = [_HAND_BACK_SECONDS + len(chunk) * _HAND_BACK_PER_JOB for chunk in chunks]
        left = [len(held)]

        def hand_back(conn: DbConnection) -> None:
            for chunk, seconds in zip(chunks, deadlines, strict=True):
                with self._driver.deadline(conn, seconds):
                    self._completer.release_now(conn, chunk, refund=refund)
                left[0] -= len(chunk)

        failed = self._on_own_connection(hand_back, "hand back", sum(deadlines))
        if failed is not None:  # their leases will expire instead
            log.warning("worker %s: could not hand back %d of %d job(s) (%s); they return after their lease",
                        self.owner, left[0], len(held), failed)
        self.ledger.lose(held)  # a handler still running must not complete after hand-back

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def held(self) -> list[ClaimToken]:
        """Tokens of the jobs this worker holds right now (for tests and introspection)."""
        return [h.token for h in self.ledger.held()]

