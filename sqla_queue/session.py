"""``enqueue()``: a job joins the caller's unit of work (the transactional outbox).

The job is an ordinary pending ORM object: it is inserted with the business rows beside
it and vanishes with them on rollback. Workers are woken by ``pg_notify`` issued inside
that same transaction, from the session's ``before_commit`` hook (:mod:`sqla_queue.outbox`),
so PostgreSQL delivers the notification only if, and when, the transaction commits;
never on rollback. This module holds the ORM side: ``enqueue()`` itself, and the session
classes that carry it and ``enqueue_many()`` as methods.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Callable, Iterable
from typing import Any, TypeVar

from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session, object_mapper
from sqlalchemy.orm import attributes as orm_attributes
from typing_extensions import Unpack

from ._rules import dialect_json_serializer
from .binds import sync_session
from .bulk import DEFAULT_BATCH_SIZE, Method, enqueue_many
from .errors import EnqueueError, NotAQueueModel
from .options import EnqueueKwargs, enqueue_options
from .outbox import hook_session_class, install_hooks, notify_on_commit
from .rows import queue_table_of, table_plan
from .sql import delay_from_insert
from .tracing import current_trace_context

__all__ = ["AsyncQueueSession", "QueueSession", "enqueue", "notify_on_commit"]

J = TypeVar("J")


def enqueue(session: Any, job: J, **options: Unpack[EnqueueKwargs]) -> J:
    """Add ``job`` to ``session`` so it commits, or rolls back, with the caller's writes.

    Options (:class:`~sqla_queue.options.EnqueueKwargs`) override the job's own values:
    ``queue``, ``priority`` (higher first), ``delay`` (seconds or timedelta, measured by
    the database clock) or ``run_at`` (an aware datetime), and ``max_attempts``. Every
    check happens here, before the job is added: a wrong input raises
    :class:`~sqla_queue.EnqueueError` (or :class:`~sqla_queue.NotAQueueModel`) and
    leaves the session untouched.

    Works with any ``Session`` (and ``AsyncSession``: nothing here does I/O). Returns
    ``job``; its ``id`` is known after the next flush.
    """
    sync = sync_session(session)
    qt = queue_table_of(job)
    if qt is None:
        raise NotAQueueModel(
            f"cannot enqueue {type(job).__qualname__}: not a model using sqla_queue.JobMixin"
        )
    state = orm_attributes.instance_state(job)
    if state.key is not None:
        raise EnqueueError(f"{type(job).__qualname__} job is already persistent; enqueue a new object")

    checked = enqueue_options(options)
    values = dict(checked.values)
    mapper = object_mapper(job)
    plan = table_plan(mapper.class_)
    trace_key = plan.trace_key
    if trace_key is not None and trace_key not in values and state.dict.get(trace_key) is None:
        context = current_trace_context()
        if context is not None:
            values[trace_key] = context
    plan.check_job(job, mapper, values, lambda: _json_serializer(sync, mapper))
    if checked.delay_seconds is not None:
        # From the moment of the INSERT, in seconds (not a calendar interval).
        values["run_after"] = delay_from_insert(checked.delay_seconds)

    for key, value in values.items():
        setattr(job, key, value)
    install_hooks(sync)
    sync.add(job)
    return job


def _json_serializer(session: Session, mapper: Any) -> Callable[[Any], Any]:
    try:
        dialect = session.get_bind(mapper=mapper).dialect
    except sa_exc.UnboundExecutionError:  # unbound session: the standard serializer
        dialect = None
    return dialect_json_serializer(dialect)


class QueueSession(Session):
    """A ``Session`` with :meth:`enqueue`; use with ``sessionmaker(class_=QueueSession)``."""

    def enqueue(self, job: J, **options: Unpack[EnqueueKwargs]) -> J:
        """Same as :func:`sqla_queue.enqueue` with this session."""
        return enqueue(self, job, **options)

    def enqueue_many(
        self,
        model: Any,
        rows: Iterable[Any],
        *,
        batch_size: int | None = None,
        method: Method = "auto",
        **options: Unpack[EnqueueKwargs],
    ) -> int:
        """Same as :func:`sqla_queue.enqueue_many` with this session (COPY on psycopg)."""
        return enqueue_many(
            self,
            model,
            rows,
            batch_size=DEFAULT_BATCH_SIZE if batch_size is None else batch_size,
            method=method,
            **options,
        )


hook_session_class(QueueSession)


class AsyncQueueSession(AsyncSession):
    """An ``AsyncSession`` with :meth:`enqueue` and :meth:`enqueue_many`.

    Use with ``async_sessionmaker(engine, class_=AsyncQueueSession)``. Its synchronous
    session is a :class:`QueueSession`, whose commit hooks send the NOTIFY.
    """

    sync_session_class = QueueSession
    sync_session: QueueSession

    def enqueue(self, job: J, **options: Unpack[EnqueueKwargs]) -> J:
        """Same as :func:`sqla_queue.enqueue`: only adds the job, so nothing to await."""
        return enqueue(self, job, **options)

    async def enqueue_many(
        self,
        model: Any,
        rows: Iterable[Any] | AsyncIterable[Any],
        *,
        batch_size: int | None = None,
        method: Method = "auto",
        **options: Unpack[EnqueueKwargs],
    ) -> int:
        """Same as ``await sqla_queue.enqueue_many(self, …)`` (COPY on psycopg)."""
        return await enqueue_many(
            self,
            model,
            rows,
            batch_size=DEFAULT_BATCH_SIZE if batch_size is None else batch_size,
            method=method,
            **options,
        )
