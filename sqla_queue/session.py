"""``enqueue()``: a job joins the caller's unit of work (the transactional outbox).

The job is an ordinary pending ORM object: it is inserted with the business rows beside
it and vanishes with them on rollback. Workers are woken by ``pg_notify`` issued inside
that same transaction, from the session's ``before_commit`` hook, so PostgreSQL delivers
the notification only if, and when, the transaction commits; never on rollback.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Callable, Iterable
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any, Final, Literal, TypeVar

from sqlalchemy import JSON, Select, String, bindparam, event, func, select
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncSession, async_scoped_session
from sqlalchemy.orm import Mapper, Session, object_mapper, scoped_session
from sqlalchemy.orm import attributes as orm_attributes
from sqlalchemy.orm.exc import UnmappedInstanceError
from sqlalchemy.sql.elements import ClauseElement

from ._rules import (
    check_json,
    check_row_size,
    check_task_name,
    dialect_json_serializer,
    managed_violation,
    polymorphic_rule,
    table_rules,
    validate_options,
)
from .driver import notify_with_commit
from .errors import EnqueueError, NotAQueueModel
from .model import QueueTable, notify_channel, queue_table
from .sql import delay_from_insert

__all__ = ["AsyncQueueSession", "QueueSession", "enqueue", "notify_on_commit"]

J = TypeVar("J")

_NOTIFY_KEY: Final = "sqla_queue.notify"
_HOOKED_KEY: Final = "sqla_queue.hooked"


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
    _check_managed_columns(job)
    _check_job_values(sync, qt, job, values)
    if delay_by is not None:
        # From the moment of the INSERT, in seconds (not a calendar interval).
        values["run_after"] = delay_from_insert(delay_by)

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


class AsyncQueueSession(AsyncSession):
    """An ``AsyncSession`` with :meth:`enqueue` and :meth:`enqueue_many`.

    Use with ``async_sessionmaker(engine, class_=AsyncQueueSession)``. Its synchronous
    session is a :class:`QueueSession`, whose commit hooks send the NOTIFY.
    """

    sync_session_class = QueueSession
    sync_session: QueueSession

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
        """Same as :func:`sqla_queue.enqueue`: only adds the job, so nothing to await."""
        return enqueue(
            self,
            job,
            queue=queue,
            priority=priority,
            delay=delay,
            run_at=run_at,
            max_attempts=max_attempts,
        )

    async def enqueue_many(
        self,
        model: Any,
        rows: Iterable[Any] | AsyncIterable[Any],
        *,
        queue: str | None = None,
        priority: int | None = None,
        delay: timedelta | float | None = None,
        run_at: datetime | None = None,
        max_attempts: int | None = None,
        batch_size: int | None = None,
        method: Literal["auto", "copy", "insert"] = "auto",
    ) -> int:
        """Same as ``await sqla_queue.enqueue_many(self, …)`` (COPY on psycopg)."""
        from .bulk import DEFAULT_BATCH_SIZE, enqueue_many  # bulk imports this module

        return await enqueue_many(
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


def _resolve_session(session: Any) -> Any:
    """A ``scoped_session`` (Flask-SQLAlchemy's ``db.session``) or ``async_scoped_session``
    stands for its current session."""
    return session() if isinstance(session, (scoped_session, async_scoped_session)) else session


def _sync_session(session: Any) -> Session:
    session = _resolve_session(session)
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


def _check_managed_columns(job: Any) -> None:
    violation = managed_violation(orm_attributes.instance_state(job).dict)
    if violation is not None:
        key, value = violation
        raise EnqueueError(
            f"{_describe(job)} has {key}={value!r}; the queue manages {key}, leave it unset"
        )


def _json_serializer(session: Session, mapper: Mapper[Any]) -> Callable[[Any], Any]:
    try:
        dialect = session.get_bind(mapper=mapper).dialect
    except sa_exc.UnboundExecutionError:  # unbound session: the standard serializer
        dialect = None
    return dialect_json_serializer(dialect)


#: Per mapper: (attribute key, column key) of its columns in the queue table.
_attribute_plans: dict[Mapper[Any], tuple[tuple[str, str], ...]] = {}


def _attribute_plan(mapper: Mapper[Any], table: Any) -> tuple[tuple[str, str], ...]:
    plan = _attribute_plans.get(mapper)
    if plan is None:
        plan = _attribute_plans[mapper] = tuple(
            (prop.key, prop.columns[0].key)
            for prop in mapper.column_attrs
            if prop.columns[0].table is table
        )
    return plan


def _check_job_values(
    session: Session, qt: QueueTable, job: Any, options: dict[str, Any]
) -> None:
    """The job's values, with ``options`` over them, through the rules ``enqueue_many``
    applies to its rows too (:mod:`sqla_queue._rules`): what would only fail at flush or
    commit, taking the caller's transaction with it, fails here, naming the column.

    Unset and ``None`` values are left to the column defaults (the ORM omits them from
    the INSERT) and SQL expressions to the database; a discriminator of single-table
    inheritance set to None gets the model's identity, and one naming another model is
    refused, as in ``enqueue_many()`` and ``enqueue_values()``.
    """
    mapper = object_mapper(job)
    data = orm_attributes.instance_state(job).dict
    rules = table_rules(qt.table)
    serializer: Callable[[Any], Any] | None = None
    texts: list[str] = []
    jsons: list[str] = []
    try:
        if qt.is_task_table:
            check_task_name(options.get("task", data.get("task")))
        for attr, key in _attribute_plan(mapper, qt.table):
            if key in options:
                value = options[key]
            elif attr in data:
                value = data[attr]
            else:
                continue
            if value is None or isinstance(value, ClauseElement):
                continue
            if key in rules.json:
                if value is not JSON.NULL:
                    serializer = serializer or _json_serializer(session, mapper)
                    jsons.append(check_json(value, key, serializer))
            else:
                rules.check(key, value)
                if isinstance(value, str):
                    texts.append(value)
        check_row_size(texts, jsons)
        polymorphic = polymorphic_rule(mapper, qt.table)
        if polymorphic is not None:
            given = data.get(polymorphic.attr)
            identity = polymorphic.resolve(given)
            if given is None and identity is not None:
                options[polymorphic.attr] = identity  # set on the job with the options
    except EnqueueError as exc:
        raise type(exc)(f"{_describe(job)}: {exc}") from exc.__cause__


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
    # It also runs when a SAVEPOINT commits (begin_nested()), and a NOTIFY sent there is
    # lost if that savepoint then fails: only the outermost commit may consume the set.
    # The hook cannot tell which transaction is committing (a root commit with a
    # savepoint still open also runs it inside the savepoint), so a nested one sends too
    # but keeps the set for the outermost, which sends again; PostgreSQL delivers the
    # identical notifications of one transaction once.
    nested = session.in_nested_transaction()
    pending = session.info.get(_NOTIFY_KEY) if nested else session.info.pop(_NOTIFY_KEY, None)
    if not pending:
        return
    by_bind: dict[Any, tuple[Any, set[tuple[Any, str]]]] = {}
    for table, _channel, queue in pending:
        bind = session.get_bind(clause=table)
        if bind.dialect.name == "postgresql":
            by_bind.setdefault(bind, (table, set()))[1].add((table, queue))
    for table, jobs in by_bind.values():
        conn = session.connection(bind_arguments={"clause": table})
        # The channel of the schema the connection's schema_translate_map puts each
        # table in: the one its workers listen on.
        translate = conn.get_execution_options().get("schema_translate_map")
        pairs = {(notify_channel(t, translate), queue) for t, queue in jobs}
        if notify_with_commit(conn, pairs):
            continue  # sent in the COMMIT's own round trip
        # One statement per database, whatever the number of jobs; on the connection,
        # not session.execute(), which would autoflush from inside before_commit.
        params: dict[str, str] = {}
        for n, (channel, queue) in enumerate(sorted(pairs)):
            params[f"sqla_queue_channel_{n}"] = channel
            params[f"sqla_queue_queue_{n}"] = queue
        conn.execute(_notify_statement(len(pairs)), params)


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
