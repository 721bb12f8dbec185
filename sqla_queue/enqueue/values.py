"""``enqueue_values()``: the fast path for hot producers, a job from plain values.

``enqueue()`` adds an ORM object to the session, and the unit of work inserts it at the
flush: that costs more Python time than the round trips themselves. ``enqueue_values()``
skips the ORM: it checks the values with the same rules and runs one statement, an
``INSERT … RETURNING`` that also sends the wake-up, directly on the session's psycopg
connection, inside its transaction. The job commits or rolls back with the caller's other
writes, as with ``enqueue()``; no object is added to the session, so nothing of the job is
in its identity map. From asyncio, ``await enqueue_values(async_session_or_connection,
…)`` awaits the same statement on the psycopg ``AsyncConnection``.

Everything that depends only on the model, the dialect and which columns are given (the
SQL, compiled by SQLAlchemy; the checks that apply; the defaults, already converted for
the driver) is worked out once, on the first call of that shape: a later call looks its
plan up by those keys, checks its values and sends them.
"""

from __future__ import annotations

from collections.abc import Coroutine, Mapping
from typing import Any, Final, overload

from sqlalchemy import Connection
from sqlalchemy.exc import InvalidRequestError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_scoped_session
from sqlalchemy.orm import Session, scoped_session
from sqlalchemy.util import greenlet_spawn
from typing_extensions import Unpack

from ..cache import plans
from ..dbapi import SchemaMapKey, reraise_as_sqlalchemy, schema_map_key
from ..errors import EnqueueError
from ..tracing import current_trace_context
from .binds import resolve_session
from .options import EnqueueKwargs, EnqueueOptions
from .outbox import wake_after
from .rows import InsertPlan, TablePlan, insert_plan, table_plan
from .unique import MAX_TRIES, Enqueued, UniqueKey, holder_of

__all__ = ["enqueue_values"]

#: Where a pooled connection keeps the psycopg cursor the fast path reuses (the pool
#: clears a connection's ``info`` when it replaces the DBAPI connection).
_CURSOR: Final = "sqla_queue.enqueue_values.cursor"
#: The same for the psycopg ``AsyncCursor`` of the async form.
_ASYNC_CURSOR: Final = "sqla_queue.enqueue_values.async_cursor"
#: What makes the call a coroutine.
_ASYNC_KINDS: Final = (AsyncSession, async_scoped_session, AsyncConnection)


@overload
def enqueue_values(
    session: AsyncSession | async_scoped_session[Any] | AsyncConnection,
    model: Any,
    values: Mapping[str, Any] | None = None,
    /,
    *,
    unique_key: UniqueKey,
    **options: Unpack[EnqueueKwargs],
) -> Coroutine[Any, Any, Enqueued[Any]]: ...


@overload
def enqueue_values(
    session: AsyncSession | async_scoped_session[Any] | AsyncConnection,
    model: Any,
    values: Mapping[str, Any] | None = None,
    /,
    *,
    unique_key: None = None,
    **options: Unpack[EnqueueKwargs],
) -> Coroutine[Any, Any, Any]: ...


@overload
def enqueue_values(
    session: Session | scoped_session[Any] | Connection,
    model: Any,
    values: Mapping[str, Any] | None = None,
    /,
    *,
    unique_key: UniqueKey,
    **options: Unpack[EnqueueKwargs],
) -> Enqueued[Any]: ...


@overload
def enqueue_values(
    session: Session | scoped_session[Any] | Connection,
    model: Any,
    values: Mapping[str, Any] | None = None,
    /,
    *,
    unique_key: None = None,
    **options: Unpack[EnqueueKwargs],
) -> Any: ...


def enqueue_values(
    session: Any,
    model: Any,
    values: Mapping[str, Any] | None = None,
    /,
    *,
    unique_key: Any = None,
    **options: Unpack[EnqueueKwargs],
) -> Any:
    """Insert one job of ``model``'s table from ``values`` (column key -> value) inside
    ``session``'s transaction (a ``Session``, a ``scoped_session`` or a ``Connection``),
    and return its primary key.

    The options are those of :func:`~sqla_queue.enqueue` and override ``values``. The
    checks are the same too, and happen before anything is sent: a wrong value raises
    :class:`~sqla_queue.EnqueueError` (or :class:`~sqla_queue.InvalidPayload`) and leaves
    the transaction untouched. Columns not given get their Python defaults (scalars and
    callables, and those taking SQLAlchemy's execution context, evaluated by SQLAlchemy's
    execution of the INSERT) or server defaults; a subclass of a single-table inheritance
    model writes its polymorphic identity. The NOTIFY is sent by the INSERT itself:
    PostgreSQL delivers it on commit, once per table and queue per transaction. An error of
    the database is raised as ``Connection.execute()`` raises it (SQLAlchemy's
    ``IntegrityError``, …), and the transaction then needs a rollback, as after any failed
    statement.

    With an ``AsyncSession``, an ``async_scoped_session`` or an ``AsyncConnection`` this
    returns a coroutine: ``job_id = await enqueue_values(async_session, Model, values)``.
    It is the same call (checks, plan, one statement with its NOTIFY, in the caller's
    transaction, begun if need be as ``AsyncConnection.execute`` would), awaited on the
    psycopg ``AsyncConnection`` itself. Nothing happens until it is awaited: errors,
    the checks' too, are raised by the ``await``.
    """
    if isinstance(session, Connection):
        conn = session
    elif isinstance(session, _ASYNC_KINDS):
        return _enqueue_values_async(session, model, values, options, unique_key)
    else:
        conn = None
    target: TablePlan = plans.get(model) or table_plan(model)
    row = dict(values) if values else {}
    delay_by = None
    if options or unique_key is not None:
        checked = EnqueueOptions(unique_key=unique_key, **options)
        row.update(checked.values)
        delay_by = checked.delay_seconds
        if unique_key is not None:
            target.key_values(row, unique_key)
    if target.polymorphic is not None:
        target.polymorphic.fill(row)
    trace_key = target.trace_key
    if trace_key is not None and trace_key not in row:
        context = current_trace_context()
        if context is not None:
            row[trace_key] = context
    keyed = target.unique_column is not None and row.get(target.unique_column) is not None
    if conn is None:
        # The dialect without a connection: a bad value begins nothing on the session.
        resolved = _resolved_session(session)
        bind = resolved.get_bind(**target.bind_arguments)
        plan = insert_plan(target, bind.dialect, row, delay_by is not None,
                           _schemas(bind.get_execution_options()), keyed)
        conn = resolved.connection(bind_arguments=target.bind_arguments)
        schemas = _schemas(conn.get_execution_options())
        if schemas != plan.schemas:  # the session's connection has a map of its own
            plan = insert_plan(target, conn.dialect, row, delay_by is not None, schemas, keyed)
    else:
        plan = insert_plan(target, conn.dialect, row, delay_by is not None,
                           _schemas(conn.get_execution_options()), keyed)
    if plan.keyed:
        return _keyed(conn, target, plan, row, delay_by)
    if plan.direct:
        if not conn.in_transaction():
            # What Connection.execute would do first (autobegin): then commit() on a
            # "commit as you go" connection commits the job, and close() rolls it back.
            conn.begin()
        pooled = conn.connection
        raw: Any = pooled.dbapi_connection
        if raw is not None:
            info = pooled.info
            cursor = info.get(_CURSOR)
            if cursor is None or cursor.connection is not raw or cursor.closed:
                cursor = info[_CURSOR] = raw.cursor()
            params = plan.driver_params(row, delay_by)
            try:
                cursor.execute(plan.sql, params)
                return _inserted(conn, plan, cursor.fetchone())
            except BaseException as exc:
                reraise_as_sqlalchemy(conn, exc, plan.sql, params)
                raise
    return _execute(conn, plan, row, delay_by)


async def _enqueue_values_async(
    session: AsyncSession | async_scoped_session[Any] | AsyncConnection,
    model: Any,
    values: Mapping[str, Any] | None,
    options: EnqueueKwargs,
    unique_key: Any = None,
) -> Any:
    """:func:`enqueue_values` from asyncio: the same steps, the I/O awaited.

    The statement is awaited on the psycopg ``AsyncConnection`` under SQLAlchemy's
    adapter, as the sync call runs it on the psycopg connection: no greenlet, no
    execution machinery, once the transaction and its connection are there.
    """
    target: TablePlan = plans.get(model) or table_plan(model)
    row = dict(values) if values else {}
    delay_by = None
    if options or unique_key is not None:
        checked = EnqueueOptions(unique_key=unique_key, **options)
        row.update(checked.values)
        delay_by = checked.delay_seconds
        if unique_key is not None:
            target.key_values(row, unique_key)
    if target.polymorphic is not None:
        target.polymorphic.fill(row)
    trace_key = target.trace_key
    if trace_key is not None and trace_key not in row:
        context = current_trace_context()
        if context is not None:
            row[trace_key] = context
    keyed = target.unique_column is not None and row.get(target.unique_column) is not None
    if isinstance(session, AsyncConnection):
        conn = session.sync_connection
        if conn is None:
            raise InvalidRequestError("the AsyncConnection is not started: `async with engine.connect() as conn`")
        plan = insert_plan(target, conn.dialect, row, delay_by is not None,
                           _schemas(conn.get_execution_options()), keyed)
        if not conn.in_transaction():
            # As AsyncConnection.execute would (autobegin), in a greenlet: begin events
            # may do I/O. Then commit() commits the job, and close() rolls it back.
            await greenlet_spawn(conn.begin)
    else:
        resolved = resolve_session(session)
        sync = resolved.sync_session
        # The dialect without a connection: a bad value begins nothing on the session.
        bind = sync.get_bind(**target.bind_arguments)
        plan = insert_plan(target, bind.dialect, row, delay_by is not None,
                           _schemas(bind.get_execution_options()), keyed)
        conn = (await resolved.connection(bind_arguments=target.bind_arguments)).sync_connection
        assert conn is not None
        schemas = _schemas(conn.get_execution_options())
        if schemas != plan.schemas:  # the session's connection has a map of its own
            plan = insert_plan(target, conn.dialect, row, delay_by is not None, schemas, keyed)
    if plan.keyed:
        return await greenlet_spawn(_keyed, conn, target, plan, row, delay_by)
    if plan.direct_async and not conn.invalidated:
        pooled = conn.connection
        driver: Any = pooled.driver_connection
        if driver is not None:
            info = pooled.info
            cursor = info.get(_ASYNC_CURSOR)
            if cursor is None or cursor.connection is not driver or cursor.closed:
                cursor = info[_ASYNC_CURSOR] = driver.cursor()
            params = plan.driver_params(row, delay_by)
            try:
                await cursor.execute(plan.sql, params)
                return _inserted(conn, plan, await cursor.fetchone())
            except BaseException as exc:
                # SQLAlchemy's handling may close the connection: I/O, in a greenlet.
                await greenlet_spawn(reraise_as_sqlalchemy, conn, exc, plan.sql, params)
                raise
    # Another async driver, or a connection to revalidate: SQLAlchemy's own way, in a
    # greenlet as AsyncConnection.execute runs it.
    return await greenlet_spawn(_execute, conn, plan, row, delay_by)


def _execute(conn: Connection, plan: InsertPlan, row: Mapping[str, Any], delay_by: float | None) -> Any:
    return _inserted(conn, plan, conn.execute(plan.statement, plan.params(row, delay_by)).one())


def _inserted(conn: Connection, plan: InsertPlan, found: Any) -> Any:
    """The new job's key, from the INSERT's row; a model waking after the commit has
    the row's queue handed to the outbox for then (``__queue_wake__``)."""
    if plan.after:
        wake_after(conn, {(plan.channel, found[1])})
    return found[0]


def _keyed(
    conn: Connection, target: TablePlan, plan: InsertPlan, row: Mapping[str, Any], delay_by: float | None
) -> Enqueued[Any]:
    """The keyed INSERT (``ON CONFLICT DO NOTHING``, its NOTIFY riding in it): the new
    job, or the job holding the key (see :mod:`sqla_queue.enqueue.unique`)."""
    key = row[target.unique_column]  # type: ignore[index]
    for _ in range(MAX_TRIES):
        found = conn.execute(plan.statement, plan.params(row, delay_by)).first()
        if found is not None:
            return Enqueued(True, _inserted(conn, plan, found))
        holder = holder_of(conn, target, key)
        if holder is not None:
            return Enqueued(False, holder)
    raise EnqueueError(f"unique key {key!r}: its holders kept finishing; nothing was inserted")


def _resolved_session(session: Session | scoped_session[Any]) -> Session:
    resolved = resolve_session(session)
    if not isinstance(resolved, Session):
        raise TypeError(
            "enqueue_values needs a Session, a Connection, an AsyncSession or an AsyncConnection,"
            f" got {type(session).__qualname__}"
        )
    return resolved


def _schemas(options: Mapping[str, Any]) -> SchemaMapKey:
    """The ``schema_translate_map`` of a connection's or an engine's execution options."""
    return schema_map_key(options.get("schema_translate_map"))
