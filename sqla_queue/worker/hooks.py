"""The worker's one hook point: what happens to each job, as events, for observers.

Every claim, every handler run and every recorded end of a job (:class:`JobOutcome`)
becomes a :class:`JobEvent`. The worker's own users of them run inline, because they are
its own cheap code: the counters of :class:`~sqla_queue.WorkerStats` and the log lines.
The user's observers (:class:`WorkerObserver`: metrics, tracing, anything) run on a
thread of their own, fed by a bounded queue: a slow observer never slows the executors
(events beyond ``observer_queue_size`` waiting are dropped, and counted in
``WorkerStats.hook_dropped``), and one that raises is counted
(``WorkerStats.hook_errors``) and logged (once a minute per method and exception class),
never seen by job processing. That holds for any exception, ``SystemExit``,
``KeyboardInterrupt`` and ``CancelledError`` included: one observer must not end the
thread that feeds all of them, Prometheus and OpenTelemetry included. Events are built only when
something wants them: a worker without observers pays for none.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, cast

from .ledger import Held
from .stats import WorkerStats

__all__ = ["Hooks", "JobEvent", "JobOutcome", "WorkerObserver"]

log = logging.getLogger("sqla_queue.worker")
#: The finished jobs' log (one line per job: DEBUG when done, INFO or above otherwise).
job_log = logging.getLogger("sqla_queue.worker.jobs")


class JobOutcome(enum.StrEnum):
    """How a job's attempt ended in a worker; each value is also the name of the
    :class:`~sqla_queue.WorkerStats` counter it adds to."""

    #: Completed (by the worker's statement, or the handler's own transaction).
    DONE = "done"
    #: Failed, back to ``pending`` after the backoff.
    RETRIED = "retried"
    #: Dead-lettered: no attempts left, or :class:`~sqla_queue.DeadLetter` raised.
    FAILED = "failed"
    #: The lease was gone (re-claimed or swept): nothing of this run was recorded.
    LOST = "lost"
    #: Handed back to ``pending`` (shutdown, or the worker's connection was lost).
    RELEASED = "released"
    #: The handler asked to run again later (``Snooze``): ``delay`` says when; no
    #: attempt spent.
    SNOOZED = "snoozed"
    #: Cancelled while it ran (``sqla-queue cancel``, ``cancel_jobs``): nothing more recorded.
    CANCELLED = "cancelled"
    #: An expired lease of some worker, returned to ``pending`` (or dead-lettered) by
    #: this worker's sweeper: ``attempt`` is the one that expired, no run time.
    SWEPT = "swept"

    def __str__(self) -> str:
        return self.value


#: What a held job's event tells of it: its claim, its start, its end.
_CLAIMED, _STARTED, _ENDED = 0, 1, 2


class JobEvent:
    """One job's claim, run start or end, as a worker's observers see it.

    ``started_at`` is the wall-clock time (``time.time()``) its handler started, None
    before that or when it never ran; ``run_time`` the handler's seconds (None for a
    claim, a start, a sweep). ``outcome`` is None for a claim or a start.
    ``run_after`` and ``created_at`` are the row's (the database's clock), ``error`` the
    first line of the error recorded (retried, failed, released), ``delay`` a retry's
    seconds until the next attempt, ``trace_context`` the row's stored trace context
    (see the OpenTelemetry integration), ``worker`` the lease owner name.

    An event holds the job's fields, read once per job and shared by its events, never
    the job: otherwise every job would stay alive until the observers saw it, and the
    garbage collector's work on those objects would cost the executors more than the
    observers' calls.
    """

    __slots__ = ("_facts", "delay", "detail", "error", "outcome", "run_time", "started_at", "table")

    def __init__(
        self,
        table: str,
        queue: str | None,
        task: str | None,
        job_id: Any,
        attempt: int | None,
        outcome: JobOutcome | None = None,
        *,
        started_at: float | None = None,
        run_time: float | None = None,
        run_after: datetime | None = None,
        created_at: datetime | None = None,
        error: str = "",
        delay: float | None = None,
        trace_context: Any = None,
        worker: str = "",
        detail: str = "",
    ) -> None:
        self.table = table
        self.outcome = outcome
        self.error = error
        #: The whole error recorded (the exception and the end of its traceback), where
        #: ``error`` is its first line; "" for an end without one.
        self.detail = detail
        self.delay = delay
        self.started_at = started_at
        self.run_time = run_time
        self._facts: tuple[Any, ...] = (queue, task, job_id, attempt, run_after, created_at, trace_context, worker)

    @classmethod
    def _of(cls, table: str, held: Held, phase: int, outcome: JobOutcome | None = None, error: str = "",
            delay: float | None = None, detail: str = "") -> JobEvent:
        """The event of a held job, at its claim, start or end."""
        event = object.__new__(cls)
        event.table, event.outcome, event.error, event.delay, event.detail = table, outcome, error, delay, detail
        event.started_at = None if phase == _CLAIMED else held.started_at
        event.run_time = held.run_time if phase == _ENDED else None
        facts = held.facts
        if facts is None:
            job = held.job
            fields = job.__dict__ if job is not None else {}
            token = held.token
            facts = held.facts = (
                fields.get("queue"), fields.get("task"), token[0], token[1], fields.get("run_after"),
                fields.get("created_at"), fields.get("trace_context"), held.owner,
            )
        event._facts = facts
        return event

    @property
    def queue(self) -> str | None:
        return cast("str | None", self._facts[0])

    @property
    def task(self) -> str | None:
        return cast("str | None", self._facts[1])

    @property
    def job_id(self) -> Any:
        return self._facts[2]

    @property
    def attempt(self) -> int | None:
        return cast("int | None", self._facts[3])

    @property
    def run_after(self) -> datetime | None:
        return cast("datetime | None", self._facts[4])

    @property
    def created_at(self) -> datetime | None:
        return cast("datetime | None", self._facts[5])

    @property
    def trace_context(self) -> Any:
        return self._facts[6]

    @property
    def worker(self) -> str:
        return cast("str", self._facts[7])

    @property
    def pickup_latency(self) -> float | None:
        """Seconds from when the job could first run (``run_after``, else its enqueue)
        to its handler's start: how long it waited for a worker. None before a start.
        Measured across two clocks (the database's, this host's): skew shows in it."""
        if self.started_at is None:
            return None
        since = self.run_after or self.created_at
        if not isinstance(since, datetime):
            return None
        return self.started_at - since.timestamp()

    def __repr__(self) -> str:
        what = self.outcome.value if self.outcome is not None else ("started" if self.started_at else "claimed")
        return (f"JobEvent({what} {self.table} job={self.job_id!r} attempt={self.attempt} "
                f"queue={self.queue!r} task={self.task!r} run_time={self.run_time})")


class WorkerObserver:
    """Subclass and override what you need; pass instances as ``observers=[...]`` to a
    :class:`~sqla_queue.Worker` or :class:`~sqla_queue.AsyncWorker`.

    Every method is called on the worker's observer thread, one event at a time, in the
    order the worker saw them (per worker): never on an executor, so a slow method delays
    only the next events, and an exception is logged and counted, nothing more. A method
    not overridden costs nothing: its events are never built.
    """

    def claimed(self, event: JobEvent) -> None:
        """A job was claimed (leased to this worker)."""

    def started(self, event: JobEvent) -> None:
        """A job's handler is about to run (``started_at`` set)."""

    def finished(self, event: JobEvent) -> None:
        """A job's attempt ended: ``event.outcome`` says how."""

    def close(self) -> None:
        """The worker stopped: every event it delivered is in (flush here)."""


#: How long stop() lets the observer thread deliver what is queued.
DRAIN_SECONDS = 2.0
#: Seconds the observer thread lets events gather once woken, before delivering them: it
#: then wakes at most this often, not once per batch or per job, and the interpreter lock
#: is handed to it that much less. Observers see an event this much later, at most.
GATHER_SECONDS = 0.01
#: Seconds between two logs of the same observer method raising the same exception class
#: (every error is counted; a broken observer would otherwise log once per event).
_ERROR_LOG_SECONDS = 60.0
#: Distinct (method, exception class) pairs remembered for that, at most.
_MAX_ERROR_KEYS = 256


def _overrides(observer: WorkerObserver, name: str) -> bool:
    return getattr(type(observer), name, None) is not getattr(WorkerObserver, name)


class Hooks:
    """The worker's events: the inline users (counters, logs) and the observers' queue."""

    def __init__(self, stats: WorkerStats, observers: Sequence[WorkerObserver] = (), queue_size: int = 10_000,
                 table: str = "", *, has_task: bool = False, has_trace: bool = False) -> None:
        self.stats = stats
        #: The queue table's name (schema-qualified if it has a schema), on every event.
        self.table = table
        self.has_task = has_task
        self.has_trace = has_trace
        self.observers = tuple(observers)
        self.queue_size = queue_size
        self.wants_claimed = any(_overrides(o, "claimed") for o in self.observers)
        self.wants_started = any(_overrides(o, "started") for o in self.observers)
        self.wants_finished = any(_overrides(o, "finished") for o in self.observers)
        #: The overridden methods of each kind, in the observers' order.
        self._methods: dict[str, list[Any]] = {
            kind: [getattr(o, kind) for o in self.observers if _overrides(o, kind)]
            for kind in ("claimed", "started", "finished")
        }
        self._queue: deque[tuple[str, Sequence[JobEvent]]] = deque()
        #: Events queued ever (by the producers, under the lock) and delivered ever (by the
        #: observer thread alone, so it takes no lock): the difference is what waits, and
        #: a put never waits for the observer thread.
        self._added = 0
        self._taken = 0
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        #: (observer method, exception class) -> monotonic time it was last logged.
        self._error_logs: dict[tuple[str, str], float] = {}

    # -- the producers' side (executors, completer, heartbeat, sweeper) -------------------

    def claimed(self, held: Sequence[Held]) -> None:
        self.stats.add("claimed", len(held))
        if self.wants_claimed:
            table, of = self.table, JobEvent._of
            self._put("claimed", [of(table, h, _CLAIMED) for h in held])

    def started(self, held: Held) -> None:
        """``held``'s handler starts now (only called when :attr:`wants_started`)."""
        self._put("started", (JobEvent._of(self.table, held, _STARTED),))

    def count(self, counts: dict[str, int]) -> None:
        stats = self.stats
        for status, n in counts.items():
            stats.add(status, n)

    def wants_every_end(self) -> bool:
        """Whether every job's end needs its event (an observer, or DEBUG logs); else
        only those that log above DEBUG (retried, failed, lost) do."""
        return self.wants_finished or job_log.isEnabledFor(logging.DEBUG)

    def finished(self, events: Sequence[JobEvent], *, count: bool = False) -> None:
        """Jobs' ends: logged and handed to the observers; ``count``: counted too
        (else the caller counted them, :meth:`count`)."""
        if not events:
            return
        if count:
            counts: dict[str, int] = {}
            for e in events:
                status = e.outcome.value if e.outcome is not None else "lost"
                counts[status] = counts.get(status, 0) + 1
            self.count(counts)
        _log_finished(events)
        if self.wants_finished:
            self._put("finished", events)

    def event(self, held: Held, outcome: JobOutcome | None = None, error: str = "",
              delay: float | None = None, detail: str = "") -> JobEvent:
        """The event of ``held``'s end (with ``outcome``), else of its claim."""
        return JobEvent._of(self.table, held, _CLAIMED if outcome is None else _ENDED, outcome, error, delay, detail)

    def _put(self, kind: str, events: Sequence[JobEvent]) -> None:
        n = len(events)
        with self._lock:  # among producers only, for an addition and a comparison
            if self._added - self._taken + n > self.queue_size or self._stop:
                dropped = True
            else:
                dropped = False
                self._added += n
                self._queue.append((kind, events))
        if dropped:
            self.stats.add("hook_dropped", n)
        elif not self._ready.is_set():
            self._ready.set()

    # -- the observer thread ---------------------------------------------------------------

    def start(self) -> None:
        if self.observers and self._thread is None:
            self._thread = threading.Thread(target=self._deliver_loop, name="sqla_queue-observers", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = DRAIN_SECONDS) -> None:
        """Deliver what is queued (within ``timeout``), then close the observers."""
        thread = self._thread
        if thread is None:
            return
        self._stop = True
        self._ready.set()
        thread.join(timeout)
        if thread.is_alive():
            left = self._added - self._taken
            log.warning("observers: %d event(s) not delivered within %.1fs of the stop", left, timeout)
        self._thread = None

    def _deliver_loop(self) -> None:
        queue = self._queue
        while True:
            if self._ready.wait(1.0) and not self._stop:
                time.sleep(GATHER_SECONDS)
            self._ready.clear()
            while queue:
                kind, events = queue.popleft()
                self._taken += len(events)
                self._deliver(kind, events)
            if self._stop and not queue:
                break
        for observer in self.observers:
            self._call(observer.close)

    def _deliver(self, kind: str, events: Iterable[JobEvent]) -> None:
        for method in self._methods[kind]:
            for event in events:
                try:
                    method(event)
                except BaseException as exc:  # noqa: BLE001 - an observer's error is never the worker's
                    self._failed(method, exc)

    def _call(self, method: Any) -> None:
        try:
            method()
        except BaseException as exc:  # noqa: BLE001 - an observer's error is never the worker's
            self._failed(method, exc)

    def _failed(self, method: Any, exc: BaseException) -> None:
        """Count it; log it unless the same method raised the same class within a minute.
        Any exception, ``SystemExit`` and ``KeyboardInterrupt`` included: raised on this
        thread, they are the observer's own (a signal's ``KeyboardInterrupt`` goes to the
        main thread), and letting them through would end the thread every observer needs."""
        self.stats.add("hook_errors")
        owner = type(getattr(method, "__self__", method)).__name__
        name = getattr(method, "__name__", "?")
        key = (f"{owner}.{name}", type(exc).__qualname__)
        now = time.monotonic()
        logs = self._error_logs
        last = logs.get(key)
        if last is not None and now - last < _ERROR_LOG_SECONDS:
            return
        if last is None and len(logs) >= _MAX_ERROR_KEYS:
            logs.pop(next(iter(logs)))
        logs[key] = now
        log.warning("observer %s.%s raised %s: %s (logged once a minute; WorkerStats.hook_errors counts each)",
                    owner, name, type(exc).__name__, exc, exc_info=(type(exc), exc, exc.__traceback__))


# -- the logs: one line per finished job ---------------------------------------------------

_LEVELS = {
    JobOutcome.DONE: logging.DEBUG,
    JobOutcome.RELEASED: logging.DEBUG,
    JobOutcome.RETRIED: logging.WARNING,
    JobOutcome.FAILED: logging.ERROR,
    JobOutcome.LOST: logging.WARNING,
    JobOutcome.SWEPT: logging.INFO,
    JobOutcome.SNOOZED: logging.INFO,
    JobOutcome.CANCELLED: logging.INFO,
}


def _log_finished(events: Sequence[JobEvent]) -> None:
    """One line per job on ``sqla_queue.worker.jobs``, with structured fields in ``extra``
    (``job_id``, ``table``, ``queue``, ``task``, ``attempt``, ``outcome``, ``run_time``,
    ``pickup_latency``, ``error``). Done jobs log at DEBUG, so the check of the level is
    all they cost unless it is on."""
    enabled = job_log.isEnabledFor
    debug = enabled(logging.DEBUG)
    for e in events:
        outcome = e.outcome if e.outcome is not None else JobOutcome.LOST
        level = _LEVELS.get(outcome, logging.INFO)
        if level == logging.DEBUG and not debug:
            continue
        if not enabled(level):
            continue
        extra = {
            "job_id": e.job_id, "table": e.table, "queue": e.queue, "task": e.task, "attempt": e.attempt,
            "outcome": outcome.value, "run_time": e.run_time, "pickup_latency": e.pickup_latency,
            "error": e.error,
        }
        if outcome is JobOutcome.DONE:
            job_log.log(level, "job %s attempt %s done in %.3fs", e.job_id, e.attempt, e.run_time or 0.0, extra=extra)
        elif outcome is JobOutcome.RETRIED:
            job_log.log(level, "job %s attempt %s failed: %s; retrying in %.1fs", e.job_id, e.attempt, e.error,
                        e.delay or 0.0, extra=extra)
        elif outcome is JobOutcome.FAILED:
            job_log.log(level, "job %s attempt %s dead-lettered: %s", e.job_id, e.attempt, e.error, extra=extra)
        elif outcome is JobOutcome.LOST:
            job_log.log(level, "job %s attempt %s: %s; its result was not recorded", e.job_id, e.attempt,
                        e.error or "lease lost", extra=extra)
        elif outcome is JobOutcome.SNOOZED:  # the handler's plan, not a failure: INFO
            job_log.log(level, "job %s attempt %s snoozed for %.1fs: %s", e.job_id, e.attempt, e.delay or 0.0,
                        e.error, extra=extra)
        elif outcome is JobOutcome.SWEPT:
            job_log.log(level, "job %s attempt %s: lease expired, swept", e.job_id, e.attempt, extra=extra)
        else:
            job_log.log(level, "job %s attempt %s %s", e.job_id, e.attempt, outcome.value, extra=extra)
