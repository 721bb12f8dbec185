"""``enqueue_values()``: the fast path for hot producers, a job from plain values.

``enqueue()`` adds an ORM object to the session, and the unit of work inserts it at the
flush: that costs more Python time than the round trips themselves. ``enqueue_values()``
skips the ORM: it checks the values with the same rules and runs one statement, an
``INSERT … RETURNING`` that also sends the wake-up (built by SQLAlchemy and compiled once
per set of columns), directly on the session's psycopg connection, inside its transaction. The job
commits or rolls back with the caller's other writes, as with ``enqueue()``; no object is
added to the session, so nothing of the job is in its identity map.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any

from sqlalchemy import Connection, Select, String, Table, bindparam, func, insert, literal, literal_column, select
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Session, scoped_session
from sqlalchemy.sql.elements import ColumnElement

from ._rules import (
    check_json,
    dialect_json_serializer,
    managed_violation,
    table_rules,
    validate_options,
)
from .driver import Statement, compile_statement
from .errors import EnqueueError
from .model import QueueTable, queue_table
from .session import _resolve_session
from .sql import delay_from_insert

__all__ = ["enqueue_values"]

_DELAY_PARAM = "sqla_queue_delay_seconds"
#: ``DEFAULT`` in the VALUES list: the column's server default.
_DEFAULT: ColumnElement[Any] = literal_column("DEFAULT")


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
) -> Any:
    """Insert one job of ``model``'s table from ``values`` (column key -> value) inside
    ``session``'s transaction (a ``Session``, a ``scoped_session`` or a ``Connection``),
    and return its primary key.

    The options are those of :func:`~sqla_queue.enqueue` and override ``values``. The
    checks are the same too, and happen before anything is sent: a wrong value raises
    :class:`~sqla_queue.EnqueueError` (or :class:`~sqla_queue.InvalidPayload`) and leaves
    the transaction untouched. Columns not given get their Python defaults (scalars and
    callables) or server defaults. The NOTIFY is sent by the INSERT itself: PostgreSQL
    delivers it on commit, once per table and queue per transaction.
    """
    qt = queue_table(model)
    table = qt.table
    options, delay_by = validate_options(
        queue=queue, priority=priority, delay=delay, run_at=run_at, max_attempts=max_attempts
    )
    row = dict(values) if values else {}
    row.update(options)
    conn = _connection(session, qt)
    plan = _plan(table, qt.channel, frozenset(row), delay_by is not None, conn.dialect)
    plan.check(row, conn.dialect)
    params = plan.params(row)
    if delay_by is not None:
        params[_DELAY_PARAM] = delay_by
    raw: Any = conn.connection.dbapi_connection
    if raw is not None and conn.dialect.driver == "psycopg" and not conn.dialect.is_async:
        row_out = raw.execute(plan.compiled.sql, plan.compiled.params(params)).fetchone()
        pk = row_out[0]
    else:
        pk = conn.execute(plan.statement, params).scalars().one()
    return pk


def _connection(session: Session | scoped_session[Any] | Connection, qt: QueueTable) -> Connection:
    if isinstance(session, Connection):
        return session
    resolved = _resolve_session(session)
    if not isinstance(resolved, Session):
        raise TypeError(
            f"enqueue_values needs a Session or a Connection, got {type(session).__qualname__}"
            " (from async code: await session.run_sync(lambda s: enqueue_values(s, ...)))"
        )
    bind_arguments: dict[str, Any] = (
        {"mapper": qt.mapped_class} if qt.mapped_class is not None else {"clause": qt.table}
    )
    return resolved.connection(bind_arguments=bind_arguments)


class _Plan:
    """The INSERT for one set of given columns, and how to fill the others."""

    def __init__(self, table: Table, channel: str, keys: frozenset[str], delayed: bool, dialect: Dialect) -> None:
        unknown = sorted(keys - set(table.c.keys()))
        if unknown:
            raise EnqueueError(f"{table.name} has no column {', '.join(map(repr, unknown))}")
        self.rules = table_rules(table)
        self.serializer = dialect_json_serializer(dialect)
        self.json = self.rules.json & keys
        values: dict[str, Any] = {key: bindparam(key, type_=table.c[key].type) for key in keys}
        #: Columns filled by a Python default: (key, value, or a callable to call per row).
        self.defaults: list[tuple[str, Any, Callable[[], Any] | None]] = []
        for column in table.c:
            if column.key in keys or column.default is None:
                continue
            default: Any = column.default
            if getattr(default, "is_sequence", False) or getattr(default, "is_identity", False):
                continue
            if default.is_clause_element:
                values[column.key] = default.arg
            elif default.is_callable:
                values[column.key] = bindparam(column.key, type_=column.type)
                self.defaults.append((column.key, None, _no_context(default.arg)))
            elif default.is_scalar:
                if _server_says_the_same(column):
                    values[column.key] = _DEFAULT  # the server fills it in alike: one parameter less
                    continue
                values[column.key] = bindparam(column.key, type_=column.type)
                self.defaults.append((column.key, default.arg, None))
        if delayed:
            values["run_after"] = delay_from_insert(bindparam(_DELAY_PARAM))  # type: ignore[arg-type]
        (pk,) = table.primary_key.columns
        # The wake-up rides in the INSERT itself: WITH job AS (INSERT … RETURNING) SELECT
        # pk, pg_notify(channel, job.queue). PostgreSQL delivers it only on commit, once per
        # queue per transaction, and an autocommit insert takes a single round trip.
        job = insert(table).values(values).returning(pk, table.c.queue).cte("sqla_queue_job")
        self.statement: Select[Any] = select(
            job.c[pk.name], func.pg_notify(literal(channel, String()), job.c.queue)
        )
        self.compiled: Statement = compile_statement(self.statement, dialect)

    def check(self, row: Mapping[str, Any], dialect: Dialect) -> None:
        violation = managed_violation(row)
        if violation is not None:
            key, value = violation
            raise EnqueueError(f"{key} is managed by the queue; do not set it (got {value!r})")
        rules = self.rules
        for key, value in row.items():
            if key in self.json:
                check_json(value, key, self.serializer)
            elif value is not None:
                rules.check(key, value)

    def params(self, row: Mapping[str, Any]) -> dict[str, Any]:
        params = dict(row)
        for key, value, make in self.defaults:
            params[key] = make() if make is not None else value
        return params


def _server_says_the_same(column: Any) -> bool:
    """The column's server default is the literal its Python default would send (the
    mixin's columns: ``default=0, server_default=text("0")``)."""
    server = column.server_default
    arg = getattr(server, "arg", None)
    if arg is None or isinstance(column.default.arg, bool):
        return False
    text = arg if isinstance(arg, str) else getattr(arg, "text", None)
    return text is not None and text.strip("'") == str(column.default.arg)


def _no_context(fn: Callable[..., Any]) -> Callable[[], Any]:
    """SQLAlchemy wraps a default's zero-argument callable to take an execution context."""
    return lambda: fn(None)


@lru_cache(maxsize=256)
def _plan(table: Table, channel: str, keys: frozenset[str], delayed: bool, dialect: Dialect) -> _Plan:
    return _Plan(table, channel, keys, delayed, dialect)
