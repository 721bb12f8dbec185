"""Does the database's unique index say what the model's ``__queue_unique__`` says?

A keyed insert is ``INSERT … ON CONFLICT (key) WHERE <the model's predicate> DO NOTHING``:
PostgreSQL takes as its arbiter a unique index the predicate implies. When the model's
declaration changed and the index did not (a migration not written, or not run), the
arbiter is the old index: a duplicate is skipped for a job the model says holds no key
(and no holder is found), or an insert fails on an index nobody expected. Both are read
here from the catalog and compared before that can happen: at worker start, and on the
first keyed enqueue into a table per engine, naming both definitions.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Final

from sqlalchemy import Connection, Engine, Index, Table, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.schema import CreateIndex

from .errors import EnqueueError
from .model import UniqueJobs, constraint_name, translated_schema, unique_jobs

__all__ = ["INDEX_SQL", "check_unique_index", "model_index_definition", "unique_index_problem"]

#: ``(definition, unique, columns, predicate)`` of the index named ``%s`` on the table
#: ``%s`` (a qualified, quoted name for ``to_regclass``); no row when there is none.
INDEX_SQL: Final = (
    "SELECT pg_get_indexdef(i.indexrelid), i.indisunique, "
    "ARRAY(SELECT a.attname::text FROM unnest(i.indkey) AS k(n) "
    "      JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.n), "
    "pg_get_expr(i.indpred, i.indrelid) "
    "FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
    "WHERE i.indrelid = to_regclass(%s) AND c.relname = %s"
)
_INDEX_TEXT: Final = text(INDEX_SQL.replace("%s", ":table", 1).replace("%s", ":name", 1))
_LITERAL: Final = re.compile(r"'((?:[^']|'')*)'")

#: Engines (weakly) and the (table, schema) pairs whose index was found to match.
_checked: weakref.WeakKeyDictionary[Engine, set[tuple[Table, str | None]]] = weakref.WeakKeyDictionary()


def _unique_index(table: Table) -> Index | None:
    name = constraint_name(table.name, "unique_idx")
    return next((index for index in table.indexes if index.name == name), None)


def model_index_definition(table: Table) -> str:
    """The model's unique index as PostgreSQL DDL, to show beside the database's."""
    index = _unique_index(table)
    if index is None:  # pragma: no cover - the mixin always attaches it with a declaration
        return "(none)"
    dialect: Any = postgresql.dialect()  # type: ignore[no-untyped-call]
    return str(CreateIndex(index).compile(dialect=dialect)).strip()


def unique_index_problem(table: Table, found: Sequence[Any] | None, where: str | None = None) -> str | None:
    """What is wrong with the database's unique index of ``table``, as
    ``(definition, unique, columns, predicate)`` read with :data:`INDEX_SQL` (None: no
    such index), against the model's :class:`~sqla_queue.UniqueJobs`; None if it matches.

    The comparison is by meaning, not text (PostgreSQL rewrites a predicate): a unique
    index on the key column alone, whose predicate requires a key and names exactly the
    declared statuses."""
    unique: UniqueJobs | None = unique_jobs(table)
    if unique is None:
        return None
    name = where or table.fullname
    statuses_text = ", ".join(repr(s.value) for s in unique.statuses)
    declared = f"__queue_unique__ = UniqueJobs(column={unique.column!r}, statuses=({statuses_text}))"
    model = model_index_definition(table)
    if found is None:
        database = f"(no index named {constraint_name(table.name, 'unique_idx')!r})"
    else:
        definition, is_unique, columns, predicate = found
        statuses = {m.group(1) for m in _LITERAL.finditer(predicate or "")}
        column = table.c[unique.column].name
        if (
            is_unique
            and list(columns) == [column]
            and predicate is not None
            and f"{column} IS NOT NULL" in predicate.replace('"', "")
            and statuses == {s.value for s in unique.statuses}
        ):
            return None
        database = definition
    return (
        f"table {name!r}: its unique index does not match the model's {declared}\n"
        f"  database: {database}\n"
        f"  model:    {model}\n"
        "migrate the index (drop it and create the model's: see the Alembic guide, "
        "\"Changing __queue_unique__\") before enqueueing keyed jobs"
    )


def check_unique_index(conn: Connection, table: Table) -> None:
    """Raise :class:`~sqla_queue.EnqueueError` if the database's unique index of ``table``
    (in the schema ``conn``'s ``schema_translate_map`` puts it in) does not match the model;
    checked once per engine and table while it matches. One catalog query, in ``conn``'s
    transaction: it cannot fail it."""
    if conn.dialect.name != "postgresql" or unique_jobs(table) is None:
        return
    translate: Mapping[str | None, str | None] | None = conn.get_execution_options().get("schema_translate_map")
    schema = translated_schema(table, translate)
    engine = conn.engine
    done = _checked.setdefault(engine, set())
    if (table, schema) in done:
        return
    quote = conn.dialect.identifier_preparer.quote
    qualified = f"{quote(schema)}.{quote(table.name)}" if schema else quote(table.name)
    row = conn.execute(_INDEX_TEXT, {"table": qualified, "name": constraint_name(table.name, "unique_idx")}).first()
    if row is None and conn.scalar(text("SELECT to_regclass(:t) IS NULL"), {"t": qualified}):
        return  # no table at all: the insert says so itself
    where = f"{schema}.{table.name}" if schema else table.name
    problem = unique_index_problem(table, None if row is None else tuple(row), where)
    if problem is not None:
        raise EnqueueError(problem)
    done.add((table, schema))
