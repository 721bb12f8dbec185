"""The worker: claims jobs, runs handlers on threads, and keeps every lease honest.

Threads, each a :class:`~sqla_queue._loops.BackgroundLoop` with the same start/stop shape:

- the **claim loop** claims batches (one SKIP LOCKED statement) while handler threads are
  free, and waits for a NOTIFY, a free thread or the poll timer otherwise;
- ``concurrency`` **handler threads** run the handlers, so synchronous code works as is;
- the **heartbeat** extends the leases of every job this worker holds, in one statement,
  on a connection of its own; a job it could not extend has lost its lease;
- the **completer** marks finished jobs ``done`` in batches;
- the **sweeper** returns expired leases of dead workers to ``pending``;
- the **listener** turns NOTIFY into wake-ups (unless ``listen=False``).

The worker never holds SQL: every statement comes from :mod:`sqla_queue.sql`.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from types import FrameType
from typing import Any, Final, TypeVar

from sqlalchemy import Connection, Engine, event, select
from sqlalchemy.orm import Session, sessionmaker

from . import sql as q
from ._loops import ERROR_BACKOFF, BackgroundLoop
from .errors import DeadLetter, LeaseLost, RetryLater, UnknownTask
from .listener import Listener, close_dedicated, dedicated_connection
from .model import QueueTable, queue_table
from .session import QueueSession
from .sql import Backoff, ClaimToken
from .tasks import Handler, ResolvedHandler, Tasks, resolve_handler

__all__ = ["Worker", "WorkerConfig", "WorkerStats"]

log = logging.getLogger("sqla_queue.worker")

_COMPLETION_KEY: Final = "sqla_queue.complete"
#: Most jobs the completer marks done with one statement.
_COMPLETE_CHUNK: Final = 128
T = TypeVar("T")


@dataclass(frozen=True)
class WorkerConfig:
    """Timing and sizing of a worker. Durations are in seconds.

    The lease must comfortably exceed the heartbeat interval: a worker that misses
    ``lease / heartbeat_interval`` beats in a row loses its jobs to the sweeper.
    """

    concurrency: int = 4
    #: Most jobs taken by one claim; above ``concurrency`` the extra jobs wait (prefetch).
    batch_size: int | None = None
    lease: float = 60.0
    #: Default: a third of the lease.
    heartbeat_interval: float | None = None
    #: 0 turns the sweeper off (run ``sqla-queue sweep`` elsewhere then).
    sweep_interval: float = 15.0
    #: The claim loop polls at least this often, NOTIFY or not.
    poll_interval: float = 5.0
    shutdown_grace: float = 30.0
    queues: tuple[str, ...] | None = None
    #: False: poll only (PgBouncer in transaction pooling mode cannot LISTEN).
    listen: bool = True
    backoff: Backoff = field(default_factory=Backoff)
    #: ``last_error`` keeps the exception and the end of its traceback, up to this size.
    max_error_length: int = 4000
    #: Prefix of the lease owner name; default: host name and process id.
    name: str | None = None

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if self.lease <= 0 or self.poll_interval <= 0:
            raise ValueError("lease and poll_interval must be positive")
        if self.sweep_interval < 0 or self.shutdown_grace < 0:
            raise ValueError("sweep_interval and shutdown_grace must not be negative")
        if self.effective_heartbeat >= self.lease:
            raise ValueError(
                f"heartbeat_interval ({self.effective_heartbeat}s) must be shorter than the "
                f"lease ({self.lease}s)"
            )
        if self.queues is not None and (isinstance(self.queues, str) or not self.queues):
            raise ValueError("queues must be a non-empty tuple of queue names, or None for all")

    @property
    def effective_batch_size(self) -> int:
        return self.batch_size or self.concurrency

    @property
    def effective_heartbeat(self) -> float:
        return self.heartbeat_interval if self.heartbeat_interval is not None else self.lease / 3


@dataclass
class WorkerStats:
    """Counters since the worker started (read them any time; they only grow)."""

    claimed: int = 0
    done: int = 0
    retried: int = 0
    failed: int = 0
    lost: int = 0
    released: int = 0
    swept: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, counter: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, counter, getattr(self, counter) + n)


@dataclass(eq=False)
class _Held:
    """A job this worker holds a lease on, from claim to its final statement."""

    job: Any
    token: ClaimToken
    handler: ResolvedHandler | None = None
    started: float | None = None
    #: Set once the lease is known lost or the job was handed back: it must not complete.
    lost: bool = False


class Worker:
    """Run ``handler`` for the jobs of ``model``'s table.

    ``handler`` is a callable taking ``(job)`` or ``(job, session)``, or a
    :class:`~sqla_queue.Tasks` registry for a task table. ``job`` is an instance of
    ``model`` loaded from the claim (detached: ``session.add(job)`` to change it in a
    transactional handler).

    ``session_factory`` makes the sessions of transactional handlers (default: a
    :class:`~sqla_queue.QueueSession` on ``engine``, so handlers can enqueue follow-ups).
    ``job_context`` is entered around every job in its handler thread (Flask's
    ``app.app_context``, a tracing span...).
    Every connection comes from ``engine``: its pool for claims and handlers, and two
    dedicated connections made with the same URL and options for the heartbeat and the
    listener. Size the pool for ``concurrency`` + 3.
    """

    def __init__(
        self,
        engine: Engine,
        model: Any,
        handler: Handler | Tasks,
        *,
        config: WorkerConfig | None = None,
        session_factory: Callable[[], Session] | None = None,
        job_context: Callable[[], AbstractContextManager[Any]] | None = None,
        **options: Any,
    ) -> None:
        self.engine = engine
        self.job_context = job_context
        self.model = model
        self.handler = handler
        self.config = replace(config or WorkerConfig(), **options)
        self.session_factory = session_factory or sessionmaker(engine, class_=QueueSession)
        self._qt: QueueTable = queue_table(model)
        if self._qt.mapped_class is None:
            raise TypeError("Worker needs a mapped model class, not a Table")
        self._model_class: type[Any] = self._qt.mapped_class
        if isinstance(handler, Tasks):
            if not self._qt.is_task_table:
                raise TypeError(f"a Tasks registry needs a TaskMixin model, {model!r} is not one")
            self._tasks: Tasks | None = handler
            self._single: ResolvedHandler | None = None
        else:
            self._tasks = None
            self._single = resolve_handler(handler)
        name = self.config.name or f"{socket.gethostname()}:{os.getpid()}"
        self.owner = f"{name}:{uuid.uuid4().hex[:8]}"
        self.stats = WorkerStats()

        self._lock = threading.Lock()
        self._held: dict[Any, _Held] = {}
        self._running = 0
        self._assigned = 0  # claimed jobs whose handler has not returned yet
        self._forget_count = 0  # bumps when a job leaves; see _ClaimLoop.went_idle
        self._jobs: queue.SimpleQueue[_Held | None] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._hard_stop = threading.Event()
        self._started = False
        self._handler_threads: list[threading.Thread] = []
        #: (limit, isolated) -> claim statement; at most batch_size + 1 entries.
        self._claim_statements: dict[tuple[int, bool], Any] = {}
        # Built once: owner and tokens are bound at execution (see sql.complete_template).
        self._complete_many = q.complete_template(model)
        self._complete_one = q.complete_template(model, single=True)

        cfg = self.config
        self._claimer = _ClaimLoop(self)
        self._heartbeat = _HeartbeatLoop(self)
        self._completer = _CompleterLoop(self)
        self._sweeper = _SweepLoop(self) if cfg.sweep_interval > 0 else None
        self._listener = (
            Listener(engine, self._qt.channel, self._claimer.wake, queues=cfg.queues)
            if cfg.listen
            else None
        )

    @staticmethod
    def check_options(**options: Any) -> None:
        """Raise now (TypeError, ValueError) for options a worker would refuse later."""
        replace(WorkerConfig(), **options)

    def with_options(self, **options: Any) -> Worker:
        """A new, unstarted worker like this one with some options changed."""
        if not options:
            return self
        return Worker(
            self.engine,
            self.model,
            self.handler,
            config=replace(self.config, **options),
            session_factory=self.session_factory,
            job_context=self.job_context,
        )

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Start every loop in background threads and return."""
        if self._started:
            raise RuntimeError("worker already started")
        self._started = True
        log.info(
            "worker %s starting: table=%s queues=%s concurrency=%d batch=%d lease=%.1fs",
            self.owner,
            self._qt.table.fullname,
            ",".join(self.config.queues) if self.config.queues else "*",
            self.config.concurrency,
            self.config.effective_batch_size,
            self.config.lease,
        )
        for n in range(self.config.concurrency):
            thread = threading.Thread(
                target=self._handler_thread, name=f"sqla_queue-handler-{n}", daemon=True
            )
            thread.start()
            self._handler_threads.append(thread)
        for loop in self._loops():
            loop.start()

    def run(self, *, install_signal_handlers: bool = True, until_idle: bool = False) -> None:
        """Run until stopped (SIGTERM/SIGINT, :meth:`stop`), then shut down gracefully.

        The first signal stops claiming and lets running jobs finish within
        ``shutdown_grace``; a second one hands everything back at once.
        ``until_idle=True`` stops once no job is runnable, none is running, and no retry
        this worker scheduled falls due within ``poll_interval`` (for scripts and tests).
        """
        previous: dict[signal.Signals, Any] = {}
        if install_signal_handlers and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, self._on_signal)
        try:
            self.start()
            while not self._stopping.is_set():
                if until_idle and self._claimer.went_idle():
                    break
                self._stopping.wait(0.05 if until_idle else 1.0)
            self.stop()
        finally:
            for sig, old_handler in previous.items():
                signal.signal(sig, old_handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._stopping.is_set():
            log.warning("worker %s: second signal, stopping now", self.owner)
            self._hard_stop.set()
        else:
            log.info(
                "worker %s: %s received, finishing running jobs (grace %.1fs)",
                self.owner,
                signal.Signals(signum).name,
                self.config.shutdown_grace,
            )
        self._stopping.set()

    def request_stop(self) -> None:
        """Ask :meth:`run` to stop gracefully (thread-safe, returns at once)."""
        self._stopping.set()

    def stop(self, grace: float | None = None) -> None:
        """Stop claiming, let running jobs finish within ``grace``, hand back the rest."""
        if self._stopped.is_set():
            return
        self._stopping.set()
        if not self._started:
            self._stopped.set()
            return
        self._claimer.stop()
        self._release_waiting_jobs()
        deadline = time.monotonic() + (self.config.shutdown_grace if grace is None else grace)
        while time.monotonic() < deadline and not self._hard_stop.is_set():
            with self._lock:
                if not self._held:
                    break
            self._completer.wake()
            self._hard_stop.wait(0.02)
        self._completer.stop()
        self._release_running_jobs()
        for _ in self._handler_threads:
            self._jobs.put(None)
        for loop in (self._heartbeat, self._sweeper, self._listener):
            if loop is not None:
                loop.stop(timeout=5)
        self._stopped.set()
        log.info("worker %s stopped: %s", self.owner, self.stats)

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def _loops(self) -> Iterator[BackgroundLoop]:
        yield self._heartbeat
        yield self._completer
        if self._sweeper is not None:
            yield self._sweeper
        if self._listener is not None:
            yield self._listener
        yield self._claimer

    # -- bookkeeping -------------------------------------------------------------------

    def _is_idle(self) -> bool:
        with self._lock:
            return not self._held and self._running == 0

    def _free_slots(self) -> int:
        """How many jobs to claim now: none while every handler thread has work."""
        cfg = self.config
        capacity = max(cfg.concurrency, cfg.effective_batch_size)
        with self._lock:
            if self._assigned >= cfg.concurrency:
                return 0
            return min(cfg.effective_batch_size, capacity - self._assigned)

    def _forget(self, held: _Held) -> None:
        with self._lock:
            self._held.pop(held.token.job_id, None)
            self._forget_count += 1
        self._claimer.wake()

    def _mark_lost(self, held: _Held, why: str) -> None:
        with self._lock:
            first, held.lost = not held.lost, True
        if first:
            self.stats.add("lost")
            log.warning(
                "job %s attempt %d: lease lost (%s); its result will not be recorded",
                held.token.job_id,
                held.token.attempt,
                why,
            )
        self._forget(held)

    # -- claiming ----------------------------------------------------------------------

    def _claim_statement(self, limit: int, isolated: bool) -> Any:
        """The ORM claim of ``limit`` jobs, built once per limit and then reused.

        Owner, lease and queues never change for a worker, so the statement does not
        either; reusing the object also reuses its memoized cache key. Building the
        statement and its cache key anew cost more than the claim's round trip.
        """
        key = (limit, isolated)
        stmt = self._claim_statements.get(key)
        if stmt is None:
            claim = q.claim(
                self.model,
                owner=self.owner,
                limit=limit,
                lease=self.config.lease,
                queues=self.config.queues,
                isolated=isolated,
            )
            mapped: type[Any] = self._model_class
            stmt = self._claim_statements[key] = select(mapped).from_statement(claim)
        return stmt

    def _claim(self, limit: int, *, isolated: bool = False) -> list[_Held]:
        stmt = self._claim_statement(limit, isolated)
        with Session(self.engine, expire_on_commit=False) as session:
            jobs = session.scalars(stmt).all()
            session.commit()
            session.expunge_all()
        held = [_Held(job, ClaimToken(job.id, job.attempts)) for job in jobs]
        if held:
            with self._lock:
                for h in held:
                    self._held[h.token.job_id] = h
                self._assigned += len(held)
            self.stats.add("claimed", len(held))
            for h in held:
                self._jobs.put(h)
        return held

    def _isolated_waiting(self) -> bool:
        with self.engine.connect() as conn:
            return bool(conn.scalar(q.isolated_waiting(self.model, queues=self.config.queues)))

    def _release_waiting_jobs(self) -> None:
        """Jobs claimed but never started go back with their attempt refunded."""
        waiting: list[_Held] = []
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                waiting.append(item)
        with self._lock:
            self._assigned -= len(waiting)
        self._release(waiting, refund=True)

    def _release_running_jobs(self) -> None:
        with self._lock:
            running = list(self._held.values())
        if running:
            log.warning(
                "worker %s: %d job(s) still running after the grace period; handing them back",
                self.owner,
                len(running),
            )
        self._release(running, refund=False)

    def _release(self, held: Sequence[_Held], *, refund: bool) -> None:
        if not held:
            return
        stmt = q.release_if_owner(
            self.model, owner=self.owner, tokens=[h.token for h in held], refund_attempt=refund
        )
        try:
            released = self._in_transaction(
                "releasing jobs", 5, lambda conn: set(conn.scalars(stmt).all())
            )
        except Exception:  # noqa: BLE001 - the sweeper will return them after the lease
            log.warning("worker %s: could not release %d job(s); they return after their lease", self.owner, len(held))
            released = set()
        for h in held:
            h.lost = True  # a handler still running must not complete after hand-back
            with self._lock:
                self._held.pop(h.token.job_id, None)
        self.stats.add("released", len(released))
        if released:
            log.info("worker %s: released %d job(s)", self.owner, len(released))

    def _in_transaction(self, what: str, attempts: int, work: Callable[[Connection], T]) -> T:
        """Run ``work`` in a transaction, again on connection errors (it must be fenced)."""
        for n in range(1, attempts + 1):
            try:
                with self.engine.begin() as conn:
                    return work(conn)
            except Exception as exc:  # noqa: BLE001
                if n == attempts or not _is_connection_error(exc):
                    raise
                delay = ERROR_BACKOFF.delay(n).total_seconds()
                log.warning("%s failed (%s); retrying in %.2fs", what, type(exc).__name__, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    # -- running jobs ------------------------------------------------------------------

    def _handler_thread(self) -> None:
        while True:
            held = self._jobs.get()
            if held is None or self._stopped.is_set():
                return
            if held.lost:  # handed back before it started
                with self._lock:
                    self._assigned -= 1
                continue
            with self._lock:
                self._running += 1
            try:
                if self.job_context is None:
                    self._run_job(held)
                else:
                    with self.job_context():
                        self._run_job(held)
            except Exception:  # noqa: BLE001 - never let a handler thread die
                log.exception("job %s: unexpected error in the worker", held.token.job_id)
            finally:
                with self._lock:
                    self._running -= 1
                    self._assigned -= 1
                    thread_free = self._assigned < self.config.concurrency
                if thread_free:  # else the prefetched jobs keep every thread busy
                    self._claimer.wake()

    def _resolve(self, job: Any) -> ResolvedHandler:
        if self._tasks is not None:
            return self._tasks.lookup(job.task)
        assert self._single is not None
        return self._single

    def _describe(self, held: _Held) -> str:
        task = getattr(held.job, "task", None)
        label = f"job {held.token.job_id}" + (f" ({task})" if task else "")
        return f"{label} attempt {held.token.attempt}/{held.job.max_attempts}"

    def _run_job(self, held: _Held) -> None:
        held.started = time.monotonic()
        try:
            held.handler = handler = self._resolve(held.job)
            if handler.transactional:
                self._run_transactional(held, handler)  # completes inside its transaction
                self._finished(held, "done")
            else:
                handler.fn(held.job)
                self._completer.add(held)  # completed in the next batch
        except LeaseLost as exc:
            self._mark_lost(held, str(exc))
        except UnknownTask as exc:
            self._dead_letter(held, str(exc))
        except DeadLetter as exc:
            self._dead_letter(held, f"DeadLetter: {exc.reason}")
        except RetryLater as exc:
            self._retry(held, f"RetryLater: {exc.reason}", exc.delay)
        except Exception as exc:  # noqa: BLE001 - the handler's failure is the job's
            delay = self.config.backoff.delay(held.token.attempt)
            self._retry(held, self._format_error(exc), delay)

    def _run_transactional(self, held: _Held, handler: ResolvedHandler) -> None:
        """The handler's writes and the fenced completion commit in one transaction."""
        session = self.session_factory()
        _hook_session_class(type(session))
        try:
            session.info[_COMPLETION_KEY] = lambda s: self._complete_in(s, held)
            handler.fn(held.job, session)
            session.commit()  # runs the fenced completion first; LeaseLost rolls back
        except BaseException:
            session.rollback()
            raise
        finally:
            session.info.pop(_COMPLETION_KEY, None)
            session.close()

    def _complete_in(self, session: Session, held: _Held) -> None:
        if held.lost:
            raise LeaseLost(f"job {held.token.job_id}: lease lost while running")
        params = {
            q.OWNER_PARAM: self.owner,
            q.JOB_PARAM: held.token.job_id,
            q.ATTEMPT_PARAM: held.token.attempt,
        }
        conn = session.connection(bind_arguments={"clause": self._qt.table})
        if conn.execute(self._complete_one, params).first() is None:
            raise LeaseLost(
                f"job {held.token.job_id} attempt {held.token.attempt}: no longer leased to "
                f"{self.owner}; rolling back the handler's writes"
            )

    def _finished(self, held: _Held, outcome: str) -> None:
        """Bookkeeping after the job's final statement committed."""
        if outcome == "done":
            self.stats.add("done")
        self._log_outcome(held, outcome, time.monotonic())
        self._forget(held)

    def _finished_many(self, done: Sequence[_Held]) -> None:
        """:meth:`_finished` for a completed batch: one lock and one wake-up, not one per job."""
        if not done:
            return
        self.stats.add("done", len(done))
        now = time.monotonic()
        for held in done:
            self._log_outcome(held, "done", now)
        with self._lock:
            for held in done:
                self._held.pop(held.token.job_id, None)
            self._forget_count += len(done)
        self._claimer.wake()

    def _log_outcome(self, held: _Held, outcome: str, now: float) -> None:
        if log.isEnabledFor(logging.INFO):  # spares formatting per job when not logged
            took = (now - held.started) * 1000 if held.started else 0.0
            log.info("%s %s in %.1f ms", self._describe(held), outcome, took)

    def _format_error(self, exc: BaseException) -> str:
        head = f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        limit = self.config.max_error_length
        text = f"{head}\n\n{tb}"
        if len(text) > limit:
            keep = max(limit - len(head) - 40, 0)
            text = f"{head}\n\n... (traceback truncated) ...\n{tb[-keep:]}" if keep else head[:limit]
        return text[:limit]

    def _retry(self, held: _Held, error: str, delay: timedelta) -> None:
        stmt = q.retry_if_owner(self.model, owner=self.owner, token=held.token, error=error, delay=delay)
        self._final_statement(held, stmt, lambda row: self._after_retry(held, row[1], delay, error))

    def _after_retry(self, held: _Held, status: str, delay: timedelta, error: str) -> None:
        first_line = error.splitlines()[0] if error else ""
        if status == "pending":
            self._claimer.wake_at(time.monotonic() + delay.total_seconds())
        if status == "failed":
            self.stats.add("failed")
            log.error("%s failed for good (dead letter): %s", self._describe(held), first_line)
        else:
            self.stats.add("retried")
            log.warning(
                "%s failed: %s; retrying in %.1fs", self._describe(held), first_line, delay.total_seconds()
            )
        self._forget(held)

    def _dead_letter(self, held: _Held, error: str) -> None:
        stmt = q.fail_if_owner(self.model, owner=self.owner, token=held.token, error=error)

        def after(row: Any) -> None:
            self.stats.add("failed")
            log.error("%s dead-lettered: %s", self._describe(held), error)
            self._forget(held)

        self._final_statement(held, stmt, after)

    def _final_statement(self, held: _Held, stmt: Any, after: Callable[[Any], None]) -> None:
        """Run a fenced retry/fail; a lost lease or a dead database is not the job's fault."""
        if held.lost:
            self._mark_lost(held, "lease lost while running")
            return
        try:
            row = self._in_transaction(
                f"recording job {held.token.job_id}", 8, lambda conn: conn.execute(stmt).first()
            )
        except Exception as exc:  # noqa: BLE001 - the lease will expire and the job return
            log.error("job %s: could not record the outcome (%s)", held.token.job_id, exc)
            self._forget(held)
            return
        if row is None:
            self._mark_lost(held, "re-claimed or swept meanwhile")
        else:
            after(row)


def _complete_before_commit(session: Session) -> None:
    """Whoever commits a handler's session (the worker, or the handler itself) commits
    the fenced completion with it; sessions that are not a handler's carry no key."""
    complete = session.info.pop(_COMPLETION_KEY, None)
    if complete is not None:
        complete(session)


_hooked_classes: set[type[Session]] = set()
_hook_lock = threading.Lock()


def _hook_session_class(cls: type[Session]) -> None:
    with _hook_lock:
        if cls not in _hooked_classes:
            event.listen(cls, "before_commit", _complete_before_commit)
            _hooked_classes.add(cls)


def _is_connection_error(exc: BaseException) -> bool:
    from sqlalchemy.exc import DBAPIError, OperationalError

    import psycopg

    if isinstance(exc, DBAPIError):
        return bool(exc.connection_invalidated) or isinstance(exc, OperationalError)
    return isinstance(exc, (psycopg.OperationalError, ConnectionError))


# -- the loops -----------------------------------------------------------------------------


class _ClaimLoop(BackgroundLoop):
    """Claim while handler threads are free; otherwise wait for a wake-up or the poll.

    Isolated jobs (their last attempt's lease expired: perhaps they kill their worker)
    are claimed one at a time and only when this worker holds nothing else, so a crash
    they cause costs no other job an attempt. The check for them is a cheap indexed
    ``EXISTS``, made when the worker runs short of work and at least every poll interval.
    """

    name = "claimer"

    def __init__(self, worker: Worker) -> None:
        super().__init__(interval=worker.config.poll_interval)
        self.worker = worker
        self._next_isolated_check = 0.0
        self._draining = False
        self._idle_at: int | None = None  # the worker's forget count at the last empty claim
        self._due_at: float | None = None  # when a job this worker retried becomes runnable

    def wake_for_isolated(self) -> None:
        self._next_isolated_check = 0.0
        self.wake()

    def wake_at(self, when: float) -> None:
        """Claim again at ``when`` (monotonic), when a job this worker retried is due."""
        with self.worker._lock:
            if self._due_at is None or when < self._due_at:
                self._due_at = when
        self.wake()

    def went_idle(self) -> bool:
        """True when the last claim found nothing, no job came or went since, and no
        job this worker retried falls due within the poll interval."""
        worker = self.worker
        with worker._lock:
            retry_soon = self._due_at is not None and self._due_at - time.monotonic() <= self.interval
            return self._idle_at == worker._forget_count and not worker._held and not retry_soon

    def _wait_when_idle(self) -> float | None:
        """Sleep until the poll, or sooner if a job this worker retried falls due before."""
        with self.worker._lock:
            due = self._due_at
        if due is None:
            return None
        return min(max(due - time.monotonic(), 0.0), self.interval)

    def tick(self) -> float | None:
        worker = self.worker
        if worker._stopping.is_set():
            return None
        if not self._draining and time.monotonic() >= self._next_isolated_check:
            self._check_isolated()
        if self._draining:
            if not worker._is_idle():
                return None  # woken again when a job leaves
            self._draining = False
            got = worker._claim(1, isolated=True)
            if got:
                log.info("%s: last lease expired; running it alone", worker._describe(got[0]))
                self._draining = True  # claim nothing else until it is finished
                self._next_isolated_check = 0.0
                return None
        slots = worker._free_slots()
        if slots == 0:
            return None
        with worker._lock:
            forget_count = worker._forget_count
        claim_started = time.monotonic()
        got = worker._claim(slots)
        with worker._lock:
            if self._due_at is not None and self._due_at <= claim_started:
                self._due_at = None  # this claim is the one that retry was waiting for
        if len(got) == slots:
            return 0.0  # there may be more: claim again as soon as threads are free
        if not got and self._check_isolated():
            return 0.0
        if not got:
            with worker._lock:
                self._idle_at = forget_count
        return self._wait_when_idle()  # short of work: wait for NOTIFY, a retry or the poll

    def _check_isolated(self) -> bool:
        worker = self.worker
        self._next_isolated_check = time.monotonic() + worker.config.poll_interval
        self._draining = worker._isolated_waiting()
        return self._draining


class _HeartbeatLoop(BackgroundLoop):
    """Extend every held lease in one statement, on a connection of its own."""

    name = "heartbeat"

    def __init__(self, worker: Worker) -> None:
        super().__init__(interval=worker.config.effective_heartbeat)
        self.worker = worker
        self._conn: Connection | None = None

    def tick(self) -> None:
        worker = self.worker
        with worker._lock:
            held = list(worker._held.values())
        if not held:
            return None
        if self._conn is None:
            self._conn = dedicated_connection(worker.engine)
        stmt = q.extend_leases_if_owner(
            worker.model, owner=worker.owner, tokens=[h.token for h in held], lease=worker.config.lease
        )
        with self._conn.begin():
            extended = set(self._conn.scalars(stmt).all())
        for h in held:
            if h.token.job_id not in extended:
                worker._mark_lost(h, "the heartbeat found it re-claimed or swept")
        return None

    def on_error(self, exc: BaseException) -> None:
        self.close()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            close_dedicated(conn)


class _CompleterLoop(BackgroundLoop):
    """Mark finished jobs ``done`` in batches: one statement for all that are ready."""

    name = "completer"

    def __init__(self, worker: Worker) -> None:
        super().__init__(interval=0.5)
        self.worker = worker
        self._pending: list[_Held] = []
        self._pending_lock = threading.Lock()

    def add(self, held: _Held) -> None:
        with self._pending_lock:
            self._pending.append(held)
        self.wake()

    def tick(self) -> float | None:
        with self._pending_lock:
            batch, self._pending = self._pending, []
        if not batch:
            return None
        worker = self.worker
        live = [h for h in batch if not h.lost]
        for h in batch:
            if h.lost:
                worker._mark_lost(h, "lease lost while running")
        if not live:
            return 0.0
        done: set[Any] = set()
        try:
            with worker.engine.begin() as conn:
                # Chunks keep each statement's work per row (a lookup in the token
                # arrays) bounded, whatever the backlog.
                for start in range(0, len(live), _COMPLETE_CHUNK):
                    chunk = live[start : start + _COMPLETE_CHUNK]
                    params = {
                        q.OWNER_PARAM: worker.owner,
                        q.IDS_PARAM: [h.token.job_id for h in chunk],
                        q.ATTEMPTS_PARAM: [h.token.attempt for h in chunk],
                    }
                    done.update(conn.scalars(worker._complete_many, params).all())
        except BaseException:
            with self._pending_lock:
                self._pending[:0] = live  # try again after the back-off
            raise
        worker._finished_many([h for h in live if h.token.job_id in done])
        for h in live:
            if h.token.job_id not in done:
                worker._mark_lost(h, "re-claimed or swept before completion")
        return 0.0

    def close(self) -> None:
        # A final flush, so a graceful stop records what finished during the grace period.
        try:
            self.tick()
        except Exception as exc:  # noqa: BLE001
            log.warning("completer: final flush failed (%s); those jobs will run again", exc)


class _SweepLoop(BackgroundLoop):
    """Return expired leases (dead workers' jobs) to ``pending``, or ``failed``."""

    name = "sweeper"

    def __init__(self, worker: Worker) -> None:
        super().__init__(interval=worker.config.sweep_interval)
        self.worker = worker

    def tick(self) -> float | None:
        worker = self.worker
        limit = 1000
        with worker.engine.begin() as conn:
            swept = conn.execute(q.sweep_expired(worker.model, limit=limit)).all()
        if swept:
            worker.stats.add("swept", len(swept))
            back = [row[0] for row in swept if row[1] == "pending"]
            dead = [row[0] for row in swept if row[1] == "failed"]
            log.warning(
                "sweeper: %d expired lease(s): %d back to pending (isolated), %d dead-lettered %s",
                len(swept),
                len(back),
                len(dead),
                dead[:20] if dead else "",
            )
            worker._claimer.wake_for_isolated()
        return 0.0 if len(swept) == limit else None
