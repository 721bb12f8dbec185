"""``enqueue()``: a job joins the caller's unit of work (the transactional outbox).

The job is an ordinary pending ORM object: it is inserted with the business rows beside
it and vanishes with them on rollback. Workers are woken by ``pg_notify`` issued inside
that same transaction, from the session's ``before_commit`` hook, so PostgreSQL delivers
the notification only if, and when, the transaction commits; never on rollback.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any, Final, Literal, TypeVar

from sqlalchemy import JSON, Select, String, bindparam, event, func, select
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

    values, delay_by = validate_options(
        queue=queue, priority=priority, delay=delay, run_at=run_at, max_attempts=max_attempts
    )
    if delay_by is not None:
        values["run_after"] = func.now() + delay_by

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

    def enqueue_many(
        self,
        model: Any,
        rows: Iterable[Any],
        *,
        queue: str | None = None,
        priority: int | None = None,
        delay: timedelta | float | None = None,
        run_at: datetime | None = None,
        max_attempts: int | None = None,
        batch_size: int | None = None,
        method: Literal["auto", "copy", "insert"] = "auto",
    ) -> int:
        """Same as :func:`sqla_queue.enqueue_many` with this session (COPY on psycopg)."""
        from .bulk import DEFAULT_BATCH_SIZE, enqueue_many  # bulk imports this module

        return enqueue_many(
            self,
            model,
            rows,
            queue=queue,
            priority=priority,
            delay=delay,
            run_at=run_at,
            max_attempts=max_attempts,
            batch_size=DEFAULT_BATCH_SIZE if batch_size is None else batch_size,
            method=method,
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


# Checks of the queue's own columns, shared by the enqueue options and by the rows of
# ``enqueue_many`` (which names the column, hence ``name``).


def check_queue(value: Any, name: str = "queue") -> None:
    if not isinstance(value, str) or not value or len(value) > 128:
        raise EnqueueError(f"{name} must be a non-empty string of at most 128 characters, got {value!r}")


def check_priority(value: Any, name: str = "priority") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not -_INT32 <= value < _INT32:
        raise EnqueueError(f"{name} must be a 32-bit integer, got {value!r}")


def check_max_attempts(value: Any, name: str = "max_attempts") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise EnqueueError(f"{name} must be an integer >= 1, got {value!r}")


def check_run_at(value: Any, name: str = "run_at") -> None:
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise EnqueueError(f"{name} must be a timezone-aware datetime, got {value!r}")


def check_task_name(value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise EnqueueError(f"needs a task name (a non-empty string), got {value!r}")


def validate_options(
    *,
    queue: str | None,
    priority: int | None,
    delay: timedelta | float | None,
    run_at: datetime | None,
    max_attempts: int | None,
) -> tuple[dict[str, Any], timedelta | None]:
    """The column values the enqueue options ask for, and the delay, checked.

    The delay is returned apart, not as a ``run_after`` value: it is measured from the
    database clock, which only the caller's connection can read.
    """
    values: dict[str, Any] = {}
    if queue is not None:
        check_queue(queue)
        values["queue"] = queue
    if priority is not None:
        check_priority(priority)
        values["priority"] = priority
    if max_attempts is not None:
        check_max_attempts(max_attempts)
        values["max_attempts"] = max_attempts
    if delay is not None and run_at is not None:
        raise EnqueueError("give either delay or run_at, not both")
    delay_by = _delay(delay) if delay is not None else None
    if run_at is not None:
        check_run_at(run_at)
        values["run_after"] = run_at
    return values, delay_by


def managed_violation(values: Any) -> tuple[str, Any] | None:
    """The first queue-managed column ``values`` (a mapping) sets, with its value, or None."""
    for key, allowed in _MANAGED_DEFAULTS.items():
        value = values.get(key)
        if value not in allowed:
            return key, value
    return None


def _check_managed_columns(job: Any) -> None:
    violation = managed_violation(orm_attributes.instance_state(job).dict)
    if violation is not None:
        key, value = violation
        raise EnqueueError(
            f"{_describe(job)} has {key}={value!r}; the queue manages {key}, leave it unset"
        )


def dialect_json_serializer(dialect: Any) -> Callable[[Any], str]:
    """The engine's ``json_serializer`` if it has one, else strict ``json.dumps``.

    Strict (``allow_nan=False``) because PostgreSQL rejects the ``NaN`` that the
    standard ``json.dumps`` writes; better to fail on the Python side, naming the column.
    """
    custom = getattr(dialect, "_json_serializer", None)
    if custom is not None:
        return custom  # type: ignore[no-any-return]
    return _strict_dumps


#: ``json.dumps(value, allow_nan=False)``, without building an encoder per call.
_strict_dumps: Final[Callable[[Any], str]] = json.JSONEncoder(allow_nan=False).encode


def _json_serializer(session: Session, mapper: Mapper[Any]) -> Callable[[Any], str]:
    try:
        dialect = session.get_bind(mapper=mapper).dialect
    except Exception:  # noqa: BLE001 - unbound session: validate with the standard serializer
        dialect = None
    return dialect_json_serializer(dialect)


def _check_job_values(session: Session, qt: QueueTable, job: Any) -> None:
    """Values that would only fail at flush or commit fail here, naming the column."""
    mapper = object_mapper(job)
    state = orm_attributes.instance_state(job)
    if qt.is_task_table:
        try:
            check_task_name(state.dict.get("task"))
        except EnqueueError as exc:
            raise EnqueueError(f"{_describe(job)} {exc}") from None
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
        params: dict[str, str] = {}
        for n, (channel, queue) in enumerate(sorted(pairs)):
            params[f"sqla_queue_channel_{n}"] = channel
            params[f"sqla_queue_queue_{n}"] = queue
        statement = _notify_statement(len(pairs))
        session.connection(bind_arguments={"clause": table}).execute(statement, params)


@lru_cache(maxsize=16)
def _notify_statement(count: int) -> Select[Any]:
    """``SELECT pg_notify(:channel_0, :queue_0), …`` for ``count`` pairs, built once.

    Reusing the statement object (and its cache key) saves more Python time per
    one-job transaction than the NOTIFY's round trip takes on a nearby server.
    """
    return select(
        *(
            func.pg_notify(
                bindparam(f"sqla_queue_channel_{n}", type_=String()),
                bindparam(f"sqla_queue_queue_{n}", type_=String()),
            )
            for n in range(count)
        )
    )


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
