"""``enqueue()``: a job joins the caller's unit of work (the transactional outbox).

The job is an ordinary pending ORM object: it is inserted with the business rows beside
it and vanishes with them on rollback. Workers are woken by ``pg_notify`` issued inside
that same transaction, from the session's ``before_commit`` hook (:mod:`sqla_queue.enqueue.outbox`),
so PostgreSQL delivers the notification only if, and when, the transaction commits;
never on rollback. This module holds the ORM side: ``enqueue()`` itself, and the session
classes that carry it and ``enqueue_many()`` as methods.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Callable, Coroutine, Generator, Iterable
from typing import TYPE_CHECKING, Any, TypeVar, overload

from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session, object_mapper
from sqlalchemy.orm import attributes as orm_attributes
from typing_extensions import Unpack

from ..errors import EnqueueError, NotAQueueModel
from ..sql import delay_from_insert
from ..tracing import current_trace_context
from ._rules import dialect_json_serializer
from .binds import resolve_session, sync_session
from .bulk import DEFAULT_BATCH_SIZE, Method, enqueue_many
from .options import EnqueueKwargs, enqueue_options
from .outbox import awaited, expect_await, hook_session_class, install_hooks, notify_on_commit
from .rows import queue_table_of, table_plan
from .unique import Enqueued, EnqueuedMany, UniqueKey, enqueue_keyed
from .workflow import WAITING_RUN_AFTER, Workflow

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import async_scoped_session
    from sqlalchemy.orm import scoped_session

__all__ = ["AsyncQueueSession", "QueueSession", "UniqueKey", "enqueue", "enqueue_workflow", "notify_on_commit"]

J = TypeVar("J")


@overload
def enqueue(
    session: AsyncSession | async_scoped_session[Any],
    job: J,
    *,
    unique_key: UniqueKey,
    **options: Unpack[EnqueueKwargs],
) -> Coroutine[Any, Any, Enqueued[J]]: ...


@overload
def enqueue(
    session: Session | scoped_session[Any], job: J, *, unique_key: UniqueKey, **options: Unpack[EnqueueKwargs]
) -> Enqueued[J]: ...


@overload
def enqueue(session: Any, job: J, *, unique_key: None = None, **options: Unpack[EnqueueKwargs]) -> J: ...


def enqueue(session: Any, job: J, *, unique_key: Any = None, **options: Unpack[EnqueueKwargs]) -> Any:
    """Add ``job`` to ``session`` so it commits, or rolls back, with the caller's writes.

    Options (:class:`~sqla_queue.enqueue.EnqueueKwargs`) override the job's own values:
    ``queue``, ``priority`` (higher first), ``delay`` (seconds or timedelta, measured by
    the database clock) or ``run_at`` (an aware datetime), and ``max_attempts``. Every
    check happens here, before the job is added: a wrong input raises
    :class:`~sqla_queue.EnqueueError` (or :class:`~sqla_queue.NotAQueueModel`) and
    leaves the session untouched.

    Works with any ``Session`` (and ``AsyncSession``: nothing here does I/O). Returns
    ``job``; its ``id`` is known after the next flush.

    ``unique_key``: at most one job holds a key (in the statuses of the model's
    :class:`~sqla_queue.UniqueJobs`: pending and running unless it says otherwise). Such
    a job is inserted at once, in the session's transaction, by ``INSERT … ON CONFLICT DO
    NOTHING`` (not at the flush, which could only fail on a duplicate), and the call
    returns an :class:`~sqla_queue.Enqueued`: inserted (``.job`` is ``job``, persistent,
    its ``id`` known) or skipped, with the ``job_id`` of the job holding the key. A
    duplicate raises nothing, now or at commit, and the transaction goes on. With an
    ``AsyncSession`` this does I/O, so it returns a coroutine: ``await
    enqueue(async_session, job, unique_key=...)``. Pending objects are flushed first
    (autoflush), relationships on the job are refused (set the foreign key), and mapper
    events such as ``before_insert`` do not run for it, as with ``enqueue_many()``.
    """
    if unique_key is not None:
        resolved = resolve_session(session)
        if isinstance(resolved, AsyncSession):
            return _KeyedEnqueue(resolved, job, unique_key, options)
        return _enqueue(sync_session(resolved), job, unique_key, options)
    return _enqueue(sync_session(session), job, None, options)


class _KeyedEnqueue(Coroutine[Any, Any, "Enqueued[Any]"]):
    """The coroutine of a keyed ``enqueue()`` on an ``AsyncSession``, which inserts the
    job when awaited. Forgetting the ``await`` would lose the job with nothing but a
    warning at garbage collection, so until it starts, the session's commit raises
    :class:`~sqla_queue.EnqueueError` (``close()`` without awaiting gives it up on
    purpose)."""

    __slots__ = ("_args", "_coro", "_session", "_sync")

    def __init__(self, session: AsyncSession, job: Any, unique_key: Any, options: EnqueueKwargs) -> None:
        self._session = session
        self._sync = session.sync_session
        self._args = (job, unique_key, options)
        self._coro: Coroutine[Any, Any, Enqueued[Any]] | None = None
        expect_await(self._sync, self, f"{type(job).__qualname__} unique_key={unique_key!r}")

    def _started(self) -> Coroutine[Any, Any, Enqueued[Any]]:
        if self._coro is None:
            awaited(self._sync, self)
            job, unique_key, options = self._args
            self._coro = self._session.run_sync(_enqueue, job, unique_key, options)
        return self._coro

    def __await__(self) -> Generator[Any, None, Enqueued[Any]]:
        return self._started().__await__()

    def send(self, value: Any) -> Any:
        return self._started().send(value)

    def throw(self, *args: Any) -> Any:
        return self._started().throw(*args)

    def close(self) -> None:
        if self._coro is None:
            awaited(self._sync, self)
        else:
            self._coro.close()


def _enqueue(sync: Session, job: J, unique_key: Any, options: EnqueueKwargs) -> Any:
    """:func:`enqueue` on the synchronous session: returns ``job``, or with a key an
    :class:`Enqueued`."""
    qt = queue_table_of(job)
    if qt is None:
        raise NotAQueueModel(
            f"cannot enqueue {type(job).__qualname__}: not a model using sqla_queue.JobMixin"
        )
    state = orm_attributes.instance_state(job)
    if state.key is not None:
        raise EnqueueError(f"{type(job).__qualname__} job is already persistent; enqueue a new object")

    checked = enqueue_options(options, unique_key)
    values = dict(checked.values)
    mapper = object_mapper(job)
    plan = table_plan(mapper.class_)
    trace_key = plan.trace_key
    if trace_key is not None and trace_key not in values and state.dict.get(trace_key) is None:
        context = current_trace_context()
        if context is not None:
            values[trace_key] = context
    key_column = plan.unique_column
    if unique_key is not None:
        plan.key_values(values, unique_key)
        given = state.dict.get(plan.unique_attr) if plan.unique_attr is not None else None
        if given is not None and given != unique_key:
            raise EnqueueError(
                f"{type(job).__qualname__} job has {key_column}={given!r} but unique_key={unique_key!r}: "
                "give one key"
            )
    elif plan.unique_attr is not None and state.dict.get(plan.unique_attr) is not None:
        raise EnqueueError(
            f"{type(job).__qualname__} job sets its unique key column {key_column}: enqueue it with "
            f"unique_key=... (a duplicate is then skipped, where the flush could only fail)"
        )
    plan.check_job(job, mapper, values, lambda: _json_serializer(sync, mapper))
    if checked.delay_seconds is not None:
        # From the moment of the INSERT, in seconds (not a calendar interval).
        values["run_after"] = delay_from_insert(checked.delay_seconds)
    if unique_key is not None:
        return enqueue_keyed(sync, job, plan, mapper, values)

    for key, value in values.items():
        setattr(job, key, value)
    install_hooks(sync)
    sync.add(job)
    return job


@overload
def enqueue_workflow(session: AsyncSession, workflow: Workflow) -> Coroutine[Any, Any, Workflow]: ...


@overload
def enqueue_workflow(session: Session, workflow: Workflow) -> Workflow: ...


def enqueue_workflow(session: Any, workflow: Workflow) -> Workflow | Coroutine[Any, Any, Workflow]:
    """Enqueue every job of ``workflow`` in ``session``'s transaction (see
    :class:`Workflow`); returns it, its jobs flushed (their ``id`` known). With an
    ``AsyncSession`` it returns a coroutine. Pending objects are flushed first. A wrong
    job raises before anything is added to the session."""
    if not isinstance(workflow, Workflow):
        raise TypeError(f"enqueue_workflow() takes a sqla_queue.Workflow, got {type(workflow).__qualname__}")
    if workflow.enqueued:
        raise EnqueueError("this workflow is enqueued already: build a new one")
    if not len(workflow):
        raise EnqueueError("this workflow has no jobs")
    resolved = resolve_session(session)
    if isinstance(resolved, AsyncSession):
        return resolved.run_sync(_enqueue_workflow, workflow)
    return _enqueue_workflow(sync_session(resolved), workflow)


def _enqueue_workflow(sync: Session, workflow: Workflow) -> Workflow:
    edges = workflow.edges()
    added: list[Any] = []
    try:
        for job, parents, _children, options in edges:
            job.workflow_id = workflow.id
            job.on_parent_failure = workflow.on_parent_failure
            job.waiting_on = len(parents)
            if parents:
                job.run_after = WAITING_RUN_AFTER
            _enqueue(sync, job, None, options)
            added.append(job)
    except BaseException:
        for job in added:
            sync.expunge(job)
        raise
    sync.flush()
    ids = [job.id for job in added]
    for job, parents, children, _options in edges:
        job.parent_ids = [ids[p] for p in parents] or None
        job.child_ids = [ids[c] for c in children] or None
    # The edges go in now, not with the commit: the jobs read as they will commit.
    sync.flush()
    workflow.enqueued = True
    return workflow


def _json_serializer(session: Session, mapper: Any) -> Callable[[Any], Any]:
    try:
        dialect = session.get_bind(mapper=mapper).dialect
    except sa_exc.UnboundExecutionError:  # unbound session: the standard serializer
        dialect = None
    return dialect_json_serializer(dialect)


class QueueSession(Session):
    """A ``Session`` with :meth:`enqueue`; use with ``sessionmaker(class_=QueueSession)``."""

    @overload
    def enqueue(self, job: J, *, unique_key: UniqueKey, **options: Unpack[EnqueueKwargs]) -> Enqueued[J]: ...

    @overload
    def enqueue(self, job: J, *, unique_key: None = None, **options: Unpack[EnqueueKwargs]) -> J: ...

    def enqueue(self, job: J, *, unique_key: Any = None, **options: Unpack[EnqueueKwargs]) -> Any:
        """Same as :func:`sqla_queue.enqueue` with this session."""
        return enqueue(self, job, unique_key=unique_key, **options)

    def enqueue_many(
        self,
        model: Any,
        rows: Iterable[Any],
        *,
        batch_size: int | None = None,
        method: Method = "auto",
        **options: Unpack[EnqueueKwargs],
    ) -> EnqueuedMany:
        """Same as :func:`sqla_queue.enqueue_many` with this session (COPY on psycopg)."""
        return enqueue_many(
            self,
            model,
            rows,
            batch_size=DEFAULT_BATCH_SIZE if batch_size is None else batch_size,
            method=method,
            **options,
        )

    def enqueue_workflow(self, workflow: Workflow) -> Workflow:
        """Same as :func:`sqla_queue.enqueue_workflow` with this session."""
        return enqueue_workflow(self, workflow)


hook_session_class(QueueSession)


class AsyncQueueSession(AsyncSession):
    """An ``AsyncSession`` with :meth:`enqueue` and :meth:`enqueue_many`.

    Use with ``async_sessionmaker(engine, class_=AsyncQueueSession)``. Its synchronous
    session is a :class:`QueueSession`, whose commit hooks send the NOTIFY.
    """

    sync_session_class = QueueSession
    sync_session: QueueSession

    @overload
    def enqueue(
        self, job: J, *, unique_key: UniqueKey, **options: Unpack[EnqueueKwargs]
    ) -> Coroutine[Any, Any, Enqueued[J]]: ...

    @overload
    def enqueue(self, job: J, *, unique_key: None = None, **options: Unpack[EnqueueKwargs]) -> J: ...

    def enqueue(self, job: J, *, unique_key: Any = None, **options: Unpack[EnqueueKwargs]) -> Any:
        """Same as :func:`sqla_queue.enqueue`: without a key it only adds the job, so
        nothing to await; with ``unique_key=`` it inserts the job at once, so ``await`` it."""
        return enqueue(self, job, unique_key=unique_key, **options)

    async def enqueue_many(
        self,
        model: Any,
        rows: Iterable[Any] | AsyncIterable[Any],
        *,
        batch_size: int | None = None,
        method: Method = "auto",
        **options: Unpack[EnqueueKwargs],
    ) -> EnqueuedMany:
        """Same as ``await sqla_queue.enqueue_many(self, …)`` (COPY on psycopg)."""
        return await enqueue_many(
            self,
            model,
            rows,
            batch_size=DEFAULT_BATCH_SIZE if batch_size is None else batch_size,
            method=method,
            **options,
        )

    async def enqueue_workflow(self, workflow: Workflow) -> Workflow:
        """Same as ``await sqla_queue.enqueue_workflow(self, workflow)``."""
        return await enqueue_workflow(self, workflow)
