"""Each attempt's history: the entry that the statement ending an attempt appends to the
job's history column, on a table that keeps one (:class:`~sqla_queue.HistoryMixin`).

The entry is built in SQL from the row as it was before the statement (its attempt,
lease owner and start) and what the statement knows (how the attempt ended, its error),
so no statement needs a value more than it already takes, and a statement that the
fence refuses appends nothing. The array keeps the last :data:`HISTORY_KEEP` entries.
"""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy import Numeric, String, Text, case, cast, func, literal, literal_column, null
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.sql.elements import ColumnElement

from ..model import HISTORY_KEEP, QueueTable, history_column
from ._base import _clock, has_timeouts

__all__ = ["ERROR_HEAD", "history_values"]

#: The characters of an attempt's error its entry keeps at most: all of a short one; of a
#: longer one, its first line (the exception, cut to ``ERROR_HEAD // 4``) and the end of
#: its traceback, where the innermost frames are (``last_error`` keeps the whole text of
#: the last one).
ERROR_HEAD: Final = 1000
#: The entries kept, as the JSON path that slices them (a constant, never a value).
_LAST: Final[ColumnElement[Any]] = literal_column(f"'lax $[last - {HISTORY_KEEP - 1} to last]'")


def history_values(
    qt: QueueTable,
    outcome: str | ColumnElement[Any],
    error: ColumnElement[Any] | None = None,
    *,
    when: ColumnElement[bool] | None = None,
) -> dict[str, Any]:
    """The SET that appends this attempt's entry, ending as ``outcome`` with ``error``
    (only where ``when`` holds, if given); nothing on a table that keeps no history."""
    column = history_column(qt.table)
    if column is None:
        return {}
    c = qt.c
    ended = _clock()
    started = c.started_at if has_timeouts(qt) else null()
    seconds = (
        func.round(cast(func.extract("epoch", ended - c.started_at), Numeric()), 3) if has_timeouts(qt) else null()
    )
    how = literal(outcome, String()) if isinstance(outcome, str) else outcome
    entry = func.jsonb_build_object(
        literal("attempt", String()), c.attempts,
        literal("worker", String()), c.lease_owner,
        literal("started_at", String()), started,
        literal("ended_at", String()), ended,
        literal("seconds", String()), seconds,
        literal("outcome", String()), how,
        literal("error", String()), _head(cast(error, Text())) if error is not None else null(),
        type_=JSONB(),
    )
    so_far = func.coalesce(column, literal_column("'[]'::jsonb"), type_=JSONB())
    appended = func.jsonb_path_query_array(so_far.op("||")(func.jsonb_build_array(entry)), _LAST, type_=JSONB())
    value = appended if when is None else case((when, appended), else_=column)
    return {column.key: value}


def _head(error: ColumnElement[str]) -> ColumnElement[Any]:
    """An error as an entry keeps it (see :data:`ERROR_HEAD`)."""
    first = func.left(func.split_part(error, literal_column("E'\\n'"), 1), ERROR_HEAD // 4, type_=Text())
    tail = func.right(error, ERROR_HEAD - ERROR_HEAD // 4 - 5, type_=Text())
    cut = func.concat(first, literal_column("E'\\n...\\n'"), tail, type_=Text())
    return case((func.length(error) <= ERROR_HEAD, error), else_=cut)
