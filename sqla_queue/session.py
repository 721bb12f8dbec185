"""``enqueue()``: a job joins the caller's unit of work (the transactional outbox).

The job is an ordinary pending ORM object: it is inserted with the business rows beside
it and vanishes with them on rollback. Workers are woken by ``pg_notify`` issued inside
that same transaction, from the session's ``before_commit`` hook, so PostgreSQL delivers
the notification only if, and when, the transaction commits; never on rollback.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, Final, TypeVar

from sqlalchemy import JSON, event, func, select
from sqlalchemy.orm import Mapper, Session, object_mapper
from sqlalchemy.orm import attributes as orm_attributes
from sqlalchemy.orm.exc import UnmappedInstanceError

from .errors import EnqueueError, InvalidPayload, NotAQueueModel
from .model import JobStatus, QueueTable, queue_table

__all__ = ["QueueSession", "enqueue", "notify_on_commit"]

J = TypeVar("J")

_NOTIFY_KEY: Final = "sqla_queue.notify"
_HOOKED_KEY: Final = "sqla_queue.hooked"
#: Columns the queue manages; a job arriving with other values in them is a mistake.
_MANAGED_DEFAULTS: Final = {
    "status": (None, JobStatus.PENDING.value),
    "attempts": (None, 0),
    "lease_owner": (None,),
    "lease_expires_at": (None,),
    "finished_at": (None,),
}
_INT32 = 2**31


def enqueue(
    session: Any,
    job: J,
    *,
    queue: str | None = None,
    priority: int | None = None,
    delay: timedelta | float | None = None,
    run_at: datetime | None = None,
    max_attempts: int | None = None,
) -> J:
    """Add ``job`` to ``session`` so it commits, or rolls back, with the caller's writes.

    Options override the job's own values: ``queue``, ``priority`` (higher first),
    ``delay`` (seconds or timedelta, measured by the database clock) or ``run_at`` (an
    aware datetime), and ``max_attempts``. Every check happens here, before the job is
    added: a wrong input raises :class:`~sqla_queue.EnqueueError` (or
    :class:`~sqla_queue.NotAQueueModel`) and leaves the session untouched.

    Works with any ``Session`` (and ``AsyncSession``: nothing here does I/O). Returns
    ``job``; its ``id`` is known after the next flush.
    """
    sync = _sync_session(session)
    qt = _queue_table_of(job)
    if qt is None:
        raise NotAQueueModel(
            f"cannot enqueue {type(job).__qualname__}: not a model using sqla_queue.JobMixin"
        )
    state = orm_attributes.instance_state(job)
    if state.key is not None:
        raise EnqueueError(f"{_describe(job)} is already persistent; enqueue a new object")

    values: dict[str, Any] = {}
    if queue is not None:
        if not isinstance(queue, str) or not queue or len(queue) > 128:
            raise EnqueueError(f"queue must be a non-empty string of at most 128 characters, got {queue!r}")
        values["queue"] = queue
    if priority is not None:
        if not isinstance(priority, int) or isinstance(priority, bool) or not -_INT32 <= priority < _INT32:
            raise EnqueueError(f"priority must be a 32-bit integer, got {priority!r}")
        values["priority"] = priority
    if max_attempts is not None:
        if not isinstance(max_attempts, int) or isinstance(max_attempts, bool) or max_attempts < 1:
            raise EnqueueError(f"max_attempts must be an integer >= 1, got {max_attempts!r}")
        values["max_attempts"] = max_attempts
    if delay is not None and run_at is not None:
        raise EnqueueError("give either delay or run_at, not both")
    if delay is not None:
        values["run_after"] = func.now() + _delay(delay)
    if run_at is not None:
        if not isinstance(run_at, datetime) or run_at.tzinfo is None:
            raise EnqueueError(f"run_at must be a timezone-aware datetime, got {run_at!r}")
        values["run_after"] = run_at

    _check_managed_columns(job)
    _check_job_values(sync, qt, job)

    for key, value in values.items():
        setattr(job, key, value)
    install_hooks(sync)
    sync.add(job)
    return job


def notify_on_commit(session: Any, model: Any, queue: str) -> None:
    """Wake ``queue``'s workers when ``session`` commits.

    ``enqueue()`` and ``session.add()`` of queue objects do this by themselves; call it
    after inserting jobs some other way (Core ``insert()``, raw SQL) in the session.
    """
    sync = _sync_session(session)
    qt = queue_table(model)
    install_hooks(sync)
    _pending(sync).add((qt.table, qt.channel, queue))


class QueueSession(Session):
    """A ``Session`` with :meth:`enqueue`; use with ``sessionmaker(class_=QueueSession)``."""

    def enqueue(
        self,
        job: J,
        *,
        queue: str | None = None,
        priority: int | None = None,
        delay: timedelta | float | None = None,
        run_at: datetime | None = None,
        max_attempts: int | None = None,
    ) -> J:
        """Same as :func:`sqla_queue.enqueue` with this session."""
        return enqueue(
            self,
            job,
            queue=queue,
            priority=priority,
            delay=delay,
            run_at=run_at,
            max_attempts=max_attempts,
        )


# -- validation ---------------------------------------------------------------------------


def _sync_session(session: Any) -> Session:
    sync = getattr(session, "sync_session", session)  # AsyncSession wraps a Session
    if not isinstance(sync, Session):
        raise TypeError(f"expected a SQLAlchemy Session, got {type(session).__qualname__}")
    return sync


def _queue_table_of(obj: Any) -> QueueTable | None:
    try:
        mapper = object_mapper(obj)
    except UnmappedInstanceError:
        return None
    try:
        return queue_table(mapper.class_)
    except NotAQueueModel:
        return None


def _describe(job: Any) -> str:
    return f"{type(job).__qualname__} job"


def _delay(delay: timedelta | float) -> timedelta:
    if isinstance(delay, bool) or not isinstance(delay, (timedelta, int, float)):
        raise EnqueueError(f"delay must be seconds or a timedelta, got {delay!r}")
    seconds = delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
    if not math.isfinite(seconds) or seconds < 0:
        raise EnqueueError(f"delay must be a finite, non-negative duration, got {delay!r}")
    return timedelta(seconds=seconds)


def _check_managed_columns(job: Any) -> None:
    state = orm_attributes.instance_state(job)
    for key, allowed in _MANAGED_DEFAULTS.items():
        value = state.dict.get(key)
        if value not in allowed:
            raise EnqueueError(
                f"{_describe(job)} has {key}={value!r}; the queue manages {key}, leave it unset"
            )


def _json_serializer(session: Session, mapper: Mapper[Any]) -> Callable[[Any], str]:
    try:
        dialect = session.get_bind(mapper=mapper).dialect
    except Exception:  # unbound session: validate with the standard serializer
        dialect = None
    custom = getattr(dialect, "_json_serializer", None)
    if custom is not None:
        return custom  # type: ignore[no-any-return]
    return lambda value: json.dumps(value, allow_nan=False)


def _check_job_values(session: Session, qt: QueueTable, job: Any) -> None:
    """Values that would only fail at flush or commit fail here, naming the column."""
    mapper = object_mapper(job)
    state = orm_attributes.instance_state(job)
    if qt.is_task_table:
        task = state.dict.get("task")
        if not isinstance(task, str) or not task:
            raise EnqueueError(f"{_describe(job)} needs a task name (a non-empty string), got {task!r}")
    serializer: Callable[[Any], str] | None = None
    for prop in mapper.column_attrs:
        column = prop.columns[0]
        if not isinstance(column.type, JSON) or prop.key not in state.dict:
            continue
        serializer = serializer or _json_serializer(session, mapper)
        try:
            serializer(state.dict[prop.key])
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidPayload(
                f"{_describe(job)}: {prop.key} is not JSON-serialisable: {exc}"
            ) from exc


# -- NOTIFY on commit ---------------------------------------------------------------------


def _pending(session: Session) -> set[tuple[Any, str, str]]:
    pending: set[tuple[Any, str, str]] = session.info.setdefault(_NOTIFY_KEY, set())
    return pending


def _record_new_jobs(session: Session) -> None:
    for obj in session.new:
        qt = _queue_table_of(obj)
        if qt is not None:
            queue = orm_attributes.instance_state(obj).dict.get("queue")
            if queue is None:
                default = qt.c.queue.default
                queue = getattr(default, "arg", None) or "default"
            _pending(session).add((qt.table, qt.channel, queue))


def _before_flush(session: Session, flush_context: Any, instances: Any) -> None:
    _record_new_jobs(session)


def _before_commit(session: Session) -> None:
    # before_commit runs before commit's final flush: record the jobs about to flush.
    _record_new_jobs(session)
    pending = session.info.pop(_NOTIFY_KEY, None)
    if not pending:
        return
    by_bind: dict[Any, tuple[Any, set[tuple[str, str]]]] = {}
    for table, channel, queue in pending:
        bind = session.get_bind(clause=table)
        if bind.dialect.name == "postgresql":
            by_bind.setdefault(bind, (table, set()))[1].add((channel, queue))
    for table, pairs in by_bind.values():
        # One statement per database, whatever the number of jobs; on the connection,
        # not session.execute(), which would autoflush from inside before_commit.
        notifies = [func.pg_notify(channel, queue) for channel, queue in sorted(pairs)]
        session.connection(bind_arguments={"clause": table}).execute(select(*notifies))


def _after_transaction_end(session: Session, transaction: Any) -> None:
    if transaction.parent is None:
        session.info.pop(_NOTIFY_KEY, None)


def _listen(target: Any) -> None:
    event.listen(target, "before_flush", _before_flush)
    event.listen(target, "before_commit", _before_commit)
    event.listen(target, "after_transaction_end", _after_transaction_end)


_listen(QueueSession)


def install_hooks(session: Session) -> None:
    """Make ``session`` send NOTIFY on commit for the queue objects it inserts."""
    if isinstance(session, QueueSession) or session.info.get(_HOOKED_KEY):
        return
    _listen(session)
    session.info[_HOOKED_KEY] = True
