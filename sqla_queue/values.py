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

from collections.abc import Callable, Coroutine, Mapping
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any, Final, overload

from sqlalchemy import Connection, String, Table, bindparam, func, insert, inspect, literal, literal_column, select
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import InvalidRequestError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_scoped_session
from sqlalchemy.orm import Session, scoped_session
from sqlalchemy.sql.base import Executable
from sqlalchemy.sql.elements import ColumnElement, False_, True_
from sqlalchemy.util import greenlet_spawn

from ._rules import (
    check_json,
    check_row_size,
    dialect_json_serializer,
    managed_violation,
    polymorphic_rule,
    python_default,
    table_rules,
    validate_options,
)
from .driver import SchemaMapKey, compile_statement, reraise_as_sqlalchemy, schema_map_key
from .errors import EnqueueError
from .model import QueueTable, notify_channel, queue_table
from .session import _resolve_session
from .sql import delay_from_insert

__all__ = ["enqueue_values"]

_DELAY_PARAM = "sqla_queue_delay_seconds"
#: ``DEFAULT`` in the VALUES list: the column's server default.
_DEFAULT: ColumnElement[Any] = literal_column("DEFAULT")
#: Where a pooled connection keeps the psycopg cursor the fast path reuses (the pool
#: clears a connection's ``info`` when it replaces the DBAPI connection).
_CURSOR: Final = "sqla_queue.enqueue_values.cursor"
#: The same for the psycopg ``AsyncCursor`` of the async form.
_ASYNC_CURSOR: Final = "sqla_queue.enqueue_values.async_cursor"
#: Plans kept at most (a new shape past that starts the cache afresh).
_MAX_PLANS: Final = 1024
#: What makes the call a coroutine.
_ASYNC_KINDS: Final = (AsyncSession, async_scoped_session, AsyncConnection)


@overload
def enqueue_values(
    session: AsyncSession | async_scoped_session[Any] | AsyncConnection,
    model: Any,
    values: Mapping[str, Any] | None = None,
    /,
    *,
    queue: str | None = None,
    priority: int | None = None,
    delay: timedelta | float | None = None,
    run_at: datetime | None = None,
    max_attempts: int | None = None,
) -> Coroutine[Any, Any, Any]: ...


@overload
def enqueue_values(
    session: Session | scoped_session[Any] | Connection,
    model: Any,
    values: Mapping[str, Any] | None = None,
    /,
    *,
    queue: str | None = None,
    priority: int | None = None,
    delay: timedelta | float | None = None,
    run_at: datetime | None = None,
    max_attempts: int | None = None,
) -> Any: ...


def enqueue_values(
    session: Any,
    model: Any,
    values: Mapping[str, Any] | None = None,
    /,
    *,
    queue: str | None = None,
    priority: int | None = None,
    delay: timedelta | float | None = None,
    run_at: datetime | None = None,
    max_attempts: int | None = None,
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
        return _enqueue_values_async(session, model, values, queue, priority, delay, run_at, max_attempts)
    else:
        conn = None
    target = _targets.get(model) or _target(model)
    row = dict(values) if values else {}
    delay_by = None
    if queue is not None or priority is not None or delay is not None or run_at is not None or max_attempts is not None:
        options, delay_by = validate_options(
            queue=queue, priority=priority, delay=delay, run_at=run_at, max_attempts=max_attempts
        )
        row.update(options)
    if target.polymorphic is not None:
        target.polymorphic.fill(row)
    if conn is None:
        # The dialect without a connection: a bad value begins nothing on the session.
        resolved = _resolved_session(session)
        bind = resolved.get_bind(**target.bind_arguments)
        plan = _checked_plan(target, bind.dialect, row, delay_by, _schemas(bind.get_execution_options()))
        conn = resolved.connection(bind_arguments=target.bind_arguments)
        schemas = _schemas(conn.get_execution_options())
        if schemas != plan.schemas:  # the session's connection has a map of its own
            plan = _checked_plan(target, conn.dialect, row, delay_by, schemas)
    else:
        plan = _checked_plan(target, conn.dialect, row, delay_by, _schemas(conn.get_execution_options()))
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
                return cursor.fetchone()[0]
            except BaseException as exc:
                reraise_as_sqlalchemy(conn, exc, plan.sql, params)
                raise
    return conn.execute(plan.statement, plan.params(row, delay_by)).scalars().one()


async def _enqueue_values_async(
    session: AsyncSession | async_scoped_session[Any] | AsyncConnection,
    model: Any,
    values: Mapping[str, Any] | None,
    queue: str | None,
    priority: int | None,
    delay: timedelta | float | None,
    run_at: datetime | None,
    max_attempts: int | None,
) -> Any:
    """:func:`enqueue_values` from asyncio: the same steps, the I/O awaited.

    The statement is awaited on the psycopg ``AsyncConnection`` under SQLAlchemy's
    adapter, as the sync call runs it on the psycopg connection: no greenlet, no
    execution machinery, once the transaction and its connection are there.
    """
    target = _targets.get(model) or _target(model)
    row = dict(values) if values else {}
    delay_by = None
    if queue is not None or priority is not None or delay is not None or run_at is not None or max_attempts is not None:
        options, delay_by = validate_options(
            queue=queue, priority=priority, delay=delay, run_at=run_at, max_attempts=max_attempts
        )
        row.update(options)
    if target.polymorphic is not None:
        target.polymorphic.fill(row)
    if isinstance(session, AsyncConnection):
        conn = session.sync_connection
        if conn is None:
            raise InvalidRequestError("the AsyncConnection is not started: `async with engine.connect() as conn`")
        plan = _checked_plan(target, conn.dialect, row, delay_by, _schemas(conn.get_execution_options()))
        if not conn.in_transaction():
            # As AsyncConnection.execute would (autobegin), in a greenlet: begin events
            # may do I/O. Then commit() commits the job, and close() rolls it back.
            await greenlet_spawn(conn.begin)
    else:
        resolved = _resolve_session(session)
        sync = resolved.sync_session
        # The dialect without a connection: a bad value begins nothing on the session.
        bind = sync.get_bind(**target.bind_arguments)
        plan = _checked_plan(target, bind.dialect, row, delay_by, _schemas(bind.get_execution_options()))
        conn = (await resolved.connection(bind_arguments=target.bind_arguments)).sync_connection
        assert conn is not None
        schemas = _schemas(conn.get_execution_options())
        if schemas != plan.schemas:  # the session's connection has a map of its own
            plan = _checked_plan(target, conn.dialect, row, delay_by, schemas)
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
                return (await cursor.fetchone())[0]
            except BaseException as exc:
                # SQLAlchemy's handling may close the connection: I/O, in a greenlet.
                await greenlet_spawn(reraise_as_sqlalchemy, conn, exc, plan.sql, params)
                raise
    # Another async driver, or a connection to revalidate: SQLAlchemy's own way, in a
    # greenlet as AsyncConnection.execute runs it.
    return await greenlet_spawn(_execute, conn, plan, row, delay_by)


def _execute(conn: Connection, plan: _Plan, row: Mapping[str, Any], delay_by: float | None) -> Any:
    return conn.execute(plan.statement, plan.params(row, delay_by)).scalars().one()


def _checked_plan(
    target: _Target, dialect: Dialect, row: Mapping[str, Any], delay_by: float | None, schemas: SchemaMapKey = None
) -> _Plan:
    """The plan of this call's shape (made on the first call of it), once ``row`` meets
    its checks. ``schemas``: the ``schema_translate_map`` the statement renders."""
    key = (target.table, dialect, schemas, delay_by is not None, *row)
    plan = _plans.get(key)
    if plan is None:
        plan = _plan(target.table, frozenset(row), delay_by is not None, dialect, schemas)
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    plan.check(row)
    return plan


class _Target:
    """What one model resolves to, once: its queue table, and how a Session finds its bind."""

    __slots__ = ("bind_arguments", "polymorphic", "table")

    def __init__(self, qt: QueueTable) -> None:
        self.table = qt.table
        self.bind_arguments: dict[str, Any] = (
            {"mapper": qt.mapped_class} if qt.mapped_class is not None else {"clause": qt.table}
        )
        mapper = inspect(qt.mapped_class) if qt.mapped_class is not None else None
        #: The discriminator of single-table inheritance: the model's identity, as the ORM.
        self.polymorphic = polymorphic_rule(mapper, qt.table)


_targets: dict[Any, _Target] = {}
_plans: dict[tuple[Any, ...], _Plan] = {}


def _target(model: Any) -> _Target:
    target = _Target(queue_table(model))  # raises NotAQueueModel for anything else
    if isinstance(model, (type, Table)):  # not instances: they would pile up
        _targets[model] = target
    return target


def _resolved_session(session: Session | scoped_session[Any]) -> Session:
    resolved = _resolve_session(session)
    if not isinstance(resolved, Session):
        raise TypeError(
            "enqueue_values needs a Session, a Connection, an AsyncSession or an AsyncConnection,"
            f" got {type(session).__qualname__}"
        )
    return resolved


class _Plan:
    """The INSERT for one set of given columns, how to check them and fill the others."""

    def __init__(
        self, table: Table, keys: frozenset[str], delayed: bool, dialect: Dialect, schemas: SchemaMapKey = None
    ) -> None:
        #: The ``schema_translate_map`` rendered into the SQL (frozen).
        self.schemas = schemas
        translate = dict(schemas) if schemas else None
        channel = notify_channel(table, translate)
        unknown = sorted(keys - set(table.c.keys()))
        if unknown:
            raise EnqueueError(f"{table.name} has no column {', '.join(map(repr, unknown))}")
        rules = table_rules(table)
        serializer = dialect_json_serializer(dialect)
        #: The JSON columns given (checked even when None: JSON null is a value).
        self.json: list[tuple[str, Callable[[Any], Any]]] = [(key, serializer) for key in sorted(rules.json & keys)]
        #: The other given columns that have a check, and the check.
        self.checks: list[tuple[str, Callable[[Any, str], None]]] = [
            (key, rules.checks[key]) for key in sorted(keys - rules.json) if key in rules.checks
        ]
        values: dict[str, Any] = {key: bindparam(key, type_=table.c[key].type) for key in keys}
        scalars: dict[str, Any] = {}
        #: Columns filled per row by a Python callable default.
        self.callables: list[tuple[str, Callable[[], Any]]] = []
        #: A column left out has a default that takes SQLAlchemy's execution context
        #: (``default=lambda ctx: ctx.get_current_parameters()…``): only SQLAlchemy's
        #: execution of the INSERT can evaluate it, so the plan leaves every default to it.
        contextual = any(
            python_default(column)[0] == "context" for column in table.c if column.key not in keys
        )
        for column in table.c:
            if contextual or column.key in keys or column.default is None:
                continue
            default: Any = column.default
            if getattr(default, "is_sequence", False) or getattr(default, "is_identity", False):
                continue
            if default.is_clause_element:
                values[column.key] = default.arg
            elif default.is_callable:
                values[column.key] = bindparam(column.key, type_=column.type)
                self.callables.append((column.key, _no_context(default.arg)))
            elif default.is_scalar:
                if _server_says_the_same(column):
                    values[column.key] = _DEFAULT  # the server fills it in alike: one parameter less
                    continue
                values[column.key] = bindparam(column.key, type_=column.type)
                scalars[column.key] = default.arg
        if delayed:
            values["run_after"] = delay_from_insert(bindparam(_DELAY_PARAM))  # type: ignore[arg-type]
        (pk,) = table.primary_key.columns
        # The wake-up rides in the INSERT itself: WITH job AS (INSERT … RETURNING) SELECT
        # pk, pg_notify(channel, job.queue). PostgreSQL delivers it only on commit, once per
        # queue per transaction, and an autocommit insert takes a single round trip.
        self.statement: Executable
        if contextual:
            # SQLAlchemy evaluates such defaults for a top-level INSERT only (the context's
            # current parameters are its own): the wake-up rides in its RETURNING.
            notify = func.pg_notify(literal(channel, String()), table.c.queue)
            self.statement = insert(table).values(values).returning(pk, notify)
        else:
            job = insert(table).values(values).returning(pk, table.c.queue).cte("sqla_queue_job")
            self.statement = select(
                job.c[pk.name], func.pg_notify(literal(channel, String()), job.c.queue)
            )
        #: On psycopg, the statement runs on the driver's cursor (sync, or awaited on the
        #: async one): SQLAlchemy's execution machinery would cost more Python time than
        #: the round trip. Not for a contextual default, which only that machinery evaluates.
        self.direct = dialect.driver == "psycopg" and not dialect.is_async and not contextual
        self.direct_async = dialect.driver == "psycopg" and dialect.is_async and not contextual
        compiled = compile_statement(self.statement, dialect, translate)
        self.sql = compiled.sql
        #: The SQLAlchemy-level values of the scalar defaults (for ``Connection.execute``).
        self.scalars = scalars
        processors = compiled.processors
        per_call = set(keys) | {key for key, _ in self.callables} | {_DELAY_PARAM}
        #: Every parameter that does not change per call, ready for the driver: the
        #: compiled literals and the scalar defaults, converted once here.
        self.fixed: dict[str, Any] = {
            name: value for name, value in compiled.defaults.items() if name not in per_call
        }
        self.fixed.update(scalars)
        for name, value in self.fixed.items():
            process = processors.get(name)
            if process is not None and value is not None:
                self.fixed[name] = process(value)
        #: The converters of the parameters that change per call.
        self.processors: list[tuple[str, Callable[[Any], Any]]] = [
            (name, process) for name, process in processors.items() if name in per_call
        ]

    def check(self, row: Mapping[str, Any]) -> None:
        violation = managed_violation(row)
        if violation is not None:
            key, value = violation
            raise EnqueueError(f"{key} is managed by the queue; do not set it (got {value!r})")
        jsons = [check_json(row[key], key, serializer) for key, serializer in self.json]
        texts: list[str] = []
        for key, check in self.checks:
            value = row[key]
            if value is not None:
                check(value, key)
                if isinstance(value, str):
                    texts.append(value)
        check_row_size(texts, jsons)

    def params(self, row: Mapping[str, Any], delay: float | None) -> dict[str, Any]:
        """The parameters for ``Connection.execute`` (SQLAlchemy converts them)."""
        params = dict(row)
        params.update(self.scalars)
        for key, make in self.callables:
            params[key] = make()
        if delay is not None:
            params[_DELAY_PARAM] = delay
        return params

    def driver_params(self, row: Mapping[str, Any], delay: float | None) -> dict[str, Any]:
        """The parameters for the psycopg cursor, converted as SQLAlchemy would."""
        params = dict(self.fixed)
        params.update(row)
        for key, make in self.callables:
            params[key] = make()
        if delay is not None:
            params[_DELAY_PARAM] = delay
        for name, process in self.processors:
            value = params[name]
            if value is not None:
                params[name] = process(value)
        return params


def _server_says_the_same(column: Any) -> bool:
    """The column's server default is the literal its Python default would send (the
    mixin's columns: ``default=0, server_default=text("0")``, ``default=False,
    server_default=false()``)."""
    server = column.server_default
    arg = getattr(server, "arg", None)
    python = column.default.arg
    if arg is None:
        return False
    if isinstance(python, bool):
        return (python is False and isinstance(arg, False_)) or (python is True and isinstance(arg, True_))
    text = arg if isinstance(arg, str) else getattr(arg, "text", None)
    return text is not None and text.strip("'") == str(python)


def _no_context(fn: Callable[..., Any]) -> Callable[[], Any]:
    """SQLAlchemy wraps a default's zero-argument callable to take an execution context."""
    return lambda: fn(None)


@lru_cache(maxsize=256)
def _plan(table: Table, keys: frozenset[str], delayed: bool, dialect: Dialect, schemas: SchemaMapKey) -> _Plan:
    return _Plan(table, keys, delayed, dialect, schemas)


def _schemas(options: Mapping[str, Any]) -> SchemaMapKey:
    """The ``schema_translate_map`` of a connection's or an engine's execution options."""
    return schema_map_key(options.get("schema_translate_map"))
