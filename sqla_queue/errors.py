"""The exceptions sqla_queue raises, and the ones handlers raise to steer their job.

Every error the library raises derives from :class:`SqlaQueueError`, and also from the
built-in class a caller would expect (``TypeError`` for a wrong kind of object,
``ValueError`` for a wrong value), so ``except ValueError`` keeps working.
"""

from __future__ import annotations

from datetime import timedelta


class SqlaQueueError(Exception):
    """Base class of every exception raised by sqla_queue."""


class NotAQueueModel(SqlaQueueError, TypeError):
    """The object or class is not a model built on :class:`~sqla_queue.JobMixin`."""


class EnqueueError(SqlaQueueError, ValueError):
    """A job, one of its values or an enqueue option is invalid.

    Raised by ``enqueue()`` before anything is added to the session, so the caller's
    transaction is untouched and can still be committed or rolled back.
    """


class InvalidPayload(EnqueueError):
    """A JSON column of the job holds a value that cannot be stored as JSON."""


class BulkRowError(EnqueueError):
    """One row given to ``enqueue_many()`` is invalid.

    ``index`` is the row's 0-based position in the rows given (``rows[index]`` for a
    list) and the message starts with it: ``"row 41: unknown column 'recipent'"``. The
    underlying error, when there is one (e.g. :class:`InvalidPayload`), is chained as
    ``__cause__``. None of the call's rows remain in the transaction.
    """

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"row {index}: {reason}")
        self.index = index
        self.reason = reason

    def __reduce__(self) -> tuple[type[BulkRowError], tuple[int, str]]:
        return type(self), (self.index, self.reason)


class TaskArgumentError(EnqueueError, TypeError):
    """A task function was given arguments its function cannot take as the job's payload
    (``send_mail.enqueue(session, to=...)``): one missing, one it has no parameter for,
    a positional one. Raised before anything is added to the session, as a ``TypeError``
    (what a wrong call raises) and an :class:`EnqueueError` (what every refused enqueue
    raises)."""


class LeaseLost(SqlaQueueError):
    """The worker no longer owns the job: its lease expired and it was swept or re-claimed.

    Raised to transactional handlers when their fenced completion matches no row; the
    handler's transaction is rolled back, so its writes never land twice.
    """


class JobCancelled(SqlaQueueError):
    """Raised by :meth:`JobContext.check() <sqla_queue.JobContext.check>` in a handler
    whose job was cancelled or ran past its deadline: the attempt is over, and nothing
    it does now can complete it. ``reason``: ``"cancelled"`` or ``"timed out"``; or
    ``"stopping"``: the worker stops, and the job, left this way, is handed back at once."""

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(message or reason)
        self.reason = reason


class QueuesTableNotDeclared(SqlaQueueError, LookupError):
    """A pause or resume names a queue table without a declared
    :func:`~sqla_queue.queues_table`: its workers would not read the pause."""


class UnknownTask(SqlaQueueError, LookupError):
    """A task row names a task that is not registered with the worker's :class:`Tasks`."""


class ResultNotStorable(SqlaQueueError, ValueError):
    """A handler returned a value its table cannot keep as the job's result: not JSON, too
    large (``WorkerConfig.max_result_size``) or not of the result column's type. The
    attempt fails with this error, as if the handler had raised it (a transactional
    handler's writes roll back), and is retried with the backoff."""


class NoSuchJob(SqlaQueueError, LookupError):
    """No job has that id in the table (never enqueued, or pruned since it finished)."""

    def __init__(self, job_id: object, table: str) -> None:
        super().__init__(f"no job {job_id!r} in table {table!r}")
        self.job_id = job_id


class ResultNotReady(SqlaQueueError, LookupError):
    """:func:`~sqla_queue.result` asked for the result of a job that has not finished."""

    def __init__(self, job_id: object, status: str) -> None:
        super().__init__(f"job {job_id!r} is {status}: it has no result yet")
        self.job_id = job_id
        self.status = status


class JobNotDoneError(SqlaQueueError):
    """A job whose result was asked for ended without one: it failed (the dead letter)
    or was cancelled. ``status`` says which, ``last_error`` is the job's."""

    def __init__(self, job_id: object, status: str, last_error: str | None) -> None:
        first = (last_error or "").strip().splitlines()[:1]
        super().__init__(f"job {job_id!r} ended {status}" + (f": {first[0]}" if first else ""))
        self.job_id = job_id
        self.status = status
        self.last_error = last_error


class JobFailedError(JobNotDoneError):
    """The job ended ``failed``: its attempts were used up, or it was dead-lettered."""


class JobCancelledError(JobNotDoneError):
    """The job was cancelled before it completed."""


class ResultTimeout(SqlaQueueError, TimeoutError):
    """:func:`~sqla_queue.wait_for_result` gave up: the job had not finished in time."""

    def __init__(self, job_id: object, status: str, timeout: float) -> None:
        super().__init__(f"job {job_id!r} is still {status} after {timeout:g}s")
        self.job_id = job_id
        self.status = status


class RetryLater(Exception):
    """Raise from a handler to retry the job after ``delay`` instead of the backoff policy.

    The attempt still counts: a job that keeps asking for retries ends in ``failed``
    once ``max_attempts`` is used up.
    """

    def __init__(self, delay: timedelta | float, reason: str = "retry requested") -> None:
        seconds = delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
        if seconds < 0:
            raise ValueError(f"RetryLater delay must not be negative, got {seconds}s")
        super().__init__(reason)
        self.delay = timedelta(seconds=seconds)
        self.reason = reason


class Snooze(Exception):
    """Raise from a handler to run the job again after ``delay``, **without** spending an
    attempt: for a job that waits on something outside (an export still being made, a
    payment not settled yet) and would otherwise use up ``max_attempts`` polling.

    The job goes back to ``pending`` with the attempt its claim counted given back (a
    fenced transition, like every other), ``last_error`` untouched, logged at INFO. A
    transactional handler's writes are rolled back, as for any exception it raises.
    """

    def __init__(self, delay: timedelta | float, reason: str = "snoozed") -> None:
        seconds = delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
        if not seconds >= 0:  # NaN too
            raise ValueError(f"Snooze delay must be a number of seconds >= 0, got {delay!r}")
        super().__init__(reason)
        self.delay = timedelta(seconds=seconds)
        self.reason = reason


class DeadLetter(Exception):
    """Raise from a handler to move the job to ``failed`` at once, whatever attempts remain.

    For errors that retrying cannot fix (bad input, a deleted account).
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
