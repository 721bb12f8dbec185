"""The running job's context: what a handler asks to learn that its attempt is over.

A thread cannot be killed safely in Python, so a synchronous handler is *told*: when its
job is cancelled (:func:`sqla_queue.cancel`) or runs past its deadline (a timeout), the
flag of its :class:`JobContext` is set, and the handler checks it at safe points
(``current_job().check()`` raises :class:`~sqla_queue.JobCancelled`; ``wait()`` sleeps
until it is set). An ``async def`` handler is also cancelled (``CancelledError`` at its
next ``await``). Either way the attempt can no longer complete: the database refuses its
completion, so a transactional handler's writes roll back whatever it does.

``handler(job)`` and ``handler(job, session)`` stay as they are: the context is found,
not passed (a context variable, set around every handler, copied into the thread that
runs a plain handler of an asyncio worker).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar, Token
from typing import Any, Final, Protocol, TypeVar

from .errors import JobCancelled
from .model import ClaimToken, JobStatus
from .runtime import Event

__all__ = ["CANCELLED", "STOPPING", "TIMED_OUT", "JobContext", "JobLogFilter", "current_job"]

T = TypeVar("T")

#: Guards the lazy creation of a context's flag.
_MAKING: Final = threading.Lock()

#: Why an attempt was told to stop: its row says ``cancelled`` (the status itself, so
#: that a reason and a row's status compare equal), or its deadline passed.
CANCELLED: Final = JobStatus.CANCELLED
TIMED_OUT: Final = "timed out"
#: The worker is stopping (SIGTERM, ``stop()``): the attempt may still complete within
#: the grace; past it, the job is handed back. Unlike the two above, it does not void the
#: attempt, and a cancel or a timeout can still follow it.
STOPPING: Final = "stopping"


def timeout_text(seconds: float) -> str:
    """``last_error`` of an attempt that ran past its deadline (the sweeper writes the same)."""
    return f"timed out after {round(seconds, 3):g} s"


class JobContext:
    """The job a handler runs, and whether its attempt is over (cancelled or timed out).

    ``current_job()`` gives it inside a handler (any runtime, any handler shape).
    """

    # One is made for every job a worker runs: slots keep that cheap.
    __slots__ = (
        "_active", "_encode_progress", "_flag", "_message", "_reason", "_task", "deadline", "job", "progress_text",
        "timeout", "token",
    )

    def __init__(
        self, job: Any, token: ClaimToken, timeout: float | None, deadline: float | None,
        encode_progress: Callable[[Any], str | None] | None = None,
    ) -> None:
        self.job = job
        self.token = token
        #: Seconds this attempt may run (None: no deadline).
        self.timeout = timeout
        #: ``time.monotonic()`` at the deadline, in this process (None: none).
        self.deadline = deadline
        #: Made on first use (most handlers never wait on it): one per job is a cost.
        self._flag: Event | None = None
        self._reason: str | None = None
        self._message = ""
        #: The task awaiting an ``async def`` handler, cancelled when the job stops.
        self._task: asyncio.Task[Any] | None = None
        self._active = False
        self._encode_progress = encode_progress
        #: The last progress recorded, as the JSON text the worker writes (None: none).
        self.progress_text: str | None = None

    @property
    def stop_reason(self) -> str | None:
        """``"cancelled"``, ``"timed out"``, ``"stopping"`` (the worker is), or None while
        nothing asks the handler to stop."""
        return self._reason

    @property
    def cancelled(self) -> bool:
        """The job was cancelled (:func:`sqla_queue.cancel`)."""
        return self._reason == CANCELLED

    @property
    def timed_out(self) -> bool:
        """The attempt ran past its deadline."""
        return self._reason == TIMED_OUT

    @property
    def stopping(self) -> bool:
        """The worker is stopping (SIGTERM, ``stop()``). The attempt can still complete
        within the shutdown grace; past it, the job is handed back and the work of this
        run is lost. A handler that cannot finish in time gives up at a safe point:
        ``check()`` raises, and the job is handed back at once for another worker.

        Unlike a cancel or a timeout, a stop does not wake :meth:`wait` and does not set
        :attr:`should_stop`: both say the attempt is void, and a handler that returns
        normally when told so would, on a stop, have its unfinished job recorded done."""
        return self._reason == STOPPING

    @property
    def should_stop(self) -> bool:
        """Cancelled or timed out: nothing this attempt does can complete it any more."""
        reason = self._reason
        return reason is not None and reason != STOPPING

    @property
    def running(self) -> bool:
        """Its handler is running right now."""
        return self._active

    def remaining(self) -> float | None:
        """Seconds left before the deadline (None: no deadline; 0 past it)."""
        if self.deadline is None:
            return None
        return max(self.deadline - time.monotonic(), 0.0)

    def check(self) -> None:
        """Raise :class:`~sqla_queue.JobCancelled` if the attempt is over, or if the
        worker is stopping (its ``reason`` says which): call it at the handler's safe
        points."""
        if self._reason is not None:
            raise JobCancelled(self._reason, self._message or self._reason)

    def progress(self, value: Any) -> None:
        """Record ``value`` (a small JSON value: a dict, a number, a text) as the job's
        progress. It reaches the job's row with the next heartbeat, and with the
        attempt's outcome, whatever it is; a later call replaces it. It stays after the
        attempt: a retry finds it in the job's progress column and may resume from it.

        Raises :class:`~sqla_queue.ResultNotStorable` for a value that is not JSON or is
        longer than 8,192 characters of it, and ``TypeError`` on a table that keeps no
        progress (see :class:`~sqla_queue.ResultMixin`)."""
        encode = self._encode_progress
        if encode is None:
            raise TypeError(
                "this job's table keeps no progress: mix sqla_queue.ResultMixin into its model "
                "(or name a JSON column in __queue_progress__)"
            )
        self.progress_text = encode(value)

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep up to ``timeout`` seconds, waking at once when the attempt is told to
        stop; True if it was. An interruptible ``time.sleep``."""
        return self._event().wait(timeout)

    def _event(self) -> Event:
        flag = self._flag
        if flag is None:
            with _MAKING:
                flag = self._flag
                if flag is None:
                    flag = self._flag = Event()
                    if self._reason is not None and self._reason != STOPPING:
                        flag.set()
        return flag

    # -- the worker's side -------------------------------------------------------------

    def job_context(self) -> JobContext:
        """Itself: a context is its own :class:`ContextSource`."""
        return self

    def stop(self, reason: str, message: str = "") -> bool:
        """Tell the handler its attempt is over (or, :data:`STOPPING`, that the worker
        is); True the first time. Cancels the task of an ``async def`` handler still
        running (from any thread), except for a stopping worker: that one is cancelled
        at the end of the grace, by the worker. A cancel or a timeout after
        :data:`STOPPING` still tells (and cancels)."""
        current = self._reason
        if current is not None and not (current == STOPPING and reason != STOPPING):
            return False
        self._message = message
        self._reason = reason
        if reason == STOPPING:
            return True  # no wake-up, no cancel: see ``stopping``
        self._event().set()
        task = self._task
        if task is not None:
            task.get_loop().call_soon_threadsafe(self._cancel_task, task)
        return True

    def _cancel_task(self, task: asyncio.Task[Any]) -> None:
        # On the loop: only while the handler runs (the executor clears _active on the
        # loop once it returned, so a late call cannot reach the next job's handler).
        if self._active and self._task is task:
            task.cancel(f"sqla_queue: job {self.token.job_id} {self._reason}")

    def enter(self, task: asyncio.Task[Any] | None) -> None:
        """The handler starts; ``task``: the one to cancel (an ``async def`` handler's)."""
        self._task = task
        self._active = True
        if task is not None and self._reason is not None and self._reason != STOPPING:
            self._cancel_task(task)

    def leave(self) -> None:
        self._active = False
        self._task = None


class ContextSource(Protocol):
    """What is current while a handler runs: a :class:`JobContext`, or the worker's
    record of the job, which makes the context on first use (most handlers never ask:
    one per job would be a cost). Both have the job and its token."""

    job: Any
    token: ClaimToken

    def job_context(self) -> JobContext: ...


_current: ContextVar[ContextSource | None] = ContextVar("sqla_queue_current_job", default=None)


def current_job() -> JobContext:
    """The :class:`JobContext` of the job the calling handler runs.

    Raises ``RuntimeError`` outside a handler."""
    found = _current.get()
    if found is None:
        raise RuntimeError("sqla_queue.current_job() is only available inside a job's handler")
    return found.job_context()


class JobLogFilter(logging.Filter):
    """A logging filter that gives every record made inside a handler the running job's
    ``job_id``, ``job_attempt``, ``job_task`` (a task table's task name), ``job_queue``
    and ``job_table``; ``"-"`` for each outside a handler, so one format serves every
    record::

        handler = logging.StreamHandler()
        handler.addFilter(sqla_queue.JobLogFilter())
        handler.setFormatter(logging.Formatter("%(levelname)s job=%(job_id)s/%(job_attempt)s %(message)s"))

    Add it to a *handler* (a logger's filters see only the records logged on that very
    logger). It reads the job from the context variable the worker sets around each
    handler, which a plain handler of the asyncio worker also sees in its thread. It
    never fails a record: a job without one of the fields gets ``"-"`` for it.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        source = _current.get()
        if source is None:
            record.job_id = record.job_attempt = record.job_task = record.job_queue = record.job_table = "-"
            return True
        job = source.job
        token = source.token
        record.job_id = token[0]
        record.job_attempt = token[1]
        record.job_task = _field(job, "task")
        record.job_queue = _field(job, "queue")
        record.job_table = getattr(type(job), "__tablename__", None) or "-"
        return True


def _field(job: Any, name: str) -> Any:
    try:
        found = job.__dict__.get(name)  # loaded columns only: never a lazy load from a log call
    except AttributeError:
        return "-"
    return "-" if found is None else found


#: Make a source current here (``token = bind(source)``), once per job: the variable's
#: own method, no call of ours around it. :func:`unbind` with the token undoes it.
bind: Final[Callable[[ContextSource | None], Token[ContextSource | None]]] = _current.set

#: Undo a :func:`bind` (``unbind(token)``).
unbind: Final = _current.reset


async def in_context(context: JobContext, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` with ``context`` current (a coroutine runs in the awaiting
    task's context, not where it was made)."""
    token = _current.set(context)
    try:
        return await awaitable
    finally:
        _current.reset(token)
