"""Statements run on the psycopg connection directly, as SQLAlchemy would run them.

Both sides of the queue do this where SQLAlchemy's execution machinery costs more than
the round trip: the worker for every claim and completion, ``enqueue_values()`` for its
INSERT. A statement is compiled once by SQLAlchemy (:func:`compile_statement`, refusing
what only SQLAlchemy's execution could finish), and an error raised on the driver's
cursor is raised as ``Connection.execute()`` would (:func:`reraise_as_sqlalchemy`).
Nothing here knows the worker or the enqueue paths.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, cast

import psycopg
from sqlalchemy import Connection
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler

from .errors import SqlaQueueError

__all__ = [
    "CompileOnceError", "SchemaMapKey", "Statement", "compile_statement", "reraise_as_sqlalchemy", "schema_map_key",
]


@dataclass(frozen=True)
class Statement:
    """A SQLAlchemy statement compiled once for psycopg: SQL text, defaults, processors."""

    sql: str
    defaults: Mapping[str, Any]
    processors: Mapping[str, Any]

    def params(self, values: Mapping[str, Any]) -> dict[str, Any]:
        params = dict(self.defaults)
        params.update(values)
        for name, process in self.processors.items():
            if name in params and params[name] is not None:
                params[name] = process(params[name])
        return params


class CompileOnceError(SqlaQueueError, ValueError):
    """A statement that cannot be compiled once and run as text on the DBAPI cursor: it
    keeps a placeholder that only SQLAlchemy's execution fills in (an expanding ``IN``
    list, a ``literal_execute`` parameter, an untranslated schema)."""


#: What SQLAlchemy leaves in a compiled string for its own execution to fill in.
_LATE_PLACEHOLDERS: Final = ("__[POSTCOMPILE_", "__[SCHEMA_")

#: A ``schema_translate_map`` as a hashable key (None for no map or an empty one).
SchemaMapKey = tuple[tuple[str | None, str | None], ...] | None


def schema_map_key(schema_translate_map: Mapping[str | None, str | None] | None) -> SchemaMapKey:
    """``schema_translate_map`` frozen, for keys of caches of compiled statements."""
    if not schema_translate_map:
        return None
    return tuple(sorted(schema_translate_map.items(), key=lambda item: (item[0] is not None, item[0] or "")))


def compile_statement(
    stmt: ClauseElement,
    dialect: Any,
    schema_translate_map: Mapping[str | None, str | None] | None = None,
) -> Statement:
    """``stmt`` compiled once by SQLAlchemy for ``dialect``, to run on the DBAPI connection.

    The text must be complete as compiled: ``schema_translate_map`` (an execution option
    SQLAlchemy applies only on its own execution path) is rendered into it, and a
    statement that still holds a placeholder for SQLAlchemy's execution to expand (an
    expanding ``IN``: use ``= ANY(array)``) raises :class:`CompileOnceError` here, when
    it is compiled, rather than failing on the server at every run.
    """
    kwargs: dict[str, Any] = {}
    if schema_translate_map:
        kwargs = {"schema_translate_map": dict(schema_translate_map), "render_schema_translate": True}
    compiled = cast(SQLCompiler, stmt.compile(dialect=dialect, **kwargs))
    text = compiled.string
    late = sorted(
        {compiled.bind_names.get(bind, bind.key) for bind in compiled.binds.values()
         if bind.expanding or bind.literal_execute}
    )
    if late or any(marker in text for marker in _LATE_PLACEHOLDERS):
        raise CompileOnceError(
            "this statement cannot run as compiled once on the DBAPI cursor: "
            + (f"its parameter(s) {', '.join(late)} are expanded (IN lists) or rendered "
               "by SQLAlchemy at execution; bind an array (column = ANY(:array)) instead"
               if late else f"its SQL keeps a placeholder for SQLAlchemy's execution: {text[:200]!r}")
        )
    defaults = compiled.construct_params(_check=False) or {}
    processors = {
        name: proc
        for name, proc in (compiled._bind_processors or {}).items()
        if proc and not _plain_array(compiled.binds.get(name), dialect)
    }
    return Statement(text, dict(defaults), processors)


def _plain_array(bind: Any, dialect: Any) -> bool:
    """An ARRAY parameter whose items need no conversion: psycopg adapts the list itself,
    and SQLAlchemy's processor would only walk it."""
    kind = getattr(bind, "type", None)
    item = getattr(kind, "item_type", None)
    return item is not None and item.dialect_impl(dialect).bind_processor(dialect) is None


def reraise_as_sqlalchemy(conn: Connection, error: BaseException, statement: str, parameters: Any) -> None:
    """Raise ``error``, from ``statement`` run on ``conn``'s psycopg connection directly,
    as ``conn.execute()`` would have raised it; return if SQLAlchemy would let it pass.

    A psycopg error becomes SQLAlchemy's class for it (``IntegrityError``,
    ``OperationalError``, …, the psycopg error as ``.orig``), after the engine's
    ``handle_error`` hooks; an error that means the connection is gone, or an exit
    exception (``KeyboardInterrupt``, a cancellation) in the middle of the statement,
    invalidates the connection as SQLAlchemy does, so ``rollback()`` then works and the
    next use gets a new one. SQLAlchemy's own handler does all that, to stay exact.
    """
    if isinstance(error, psycopg.Error) or not isinstance(error, Exception):
        try:
            raise error  # the handler reads sys.exc_info(), which a new greenlet lacks
        except BaseException as raised:  # noqa: BLE001 - handed to SQLAlchemy, which raises it
            conn._handle_dbapi_exception(raised, statement, parameters, None, None)
