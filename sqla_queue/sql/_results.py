"""Results: how a handler's return value is encoded and stored by the completion, the NOTIFY
of the ids every finishing transition sends on a table that keeps results, and the read
of a job's result (:func:`job_result`) that :func:`sqla_queue.result` and
:func:`sqla_queue.wait_for_result` run.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, Column, Select, String, Text, case, cast, func, literal, literal_column, select
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.sql.elements import ColumnElement

from ..jsontext import ResultEncoder, dialect_json_serializer
from ..model import QueueTable, progress_column, queue_table, result_column, results_channel, status_literal
from ._base import FAILED, PROGRESS_PARAM, QueueModel
from ._notify import pg_notify


def result_encoder(column: Column[Any], serializer: Any = None, limit: int = 2**28 - 1) -> ResultEncoder:
    """How a result is encoded for ``column``: JSON text, checked against the column's
    Python type when it is not a JSON column (the statement casts the text to it)."""
    python_type: type[Any] | None = None
    if not isinstance(column.type, JSON):
        try:
            python_type = column.type.python_type
        except NotImplementedError:
            python_type = None
    return ResultEncoder(serializer or dialect_json_serializer(None), limit, python_type)


def _stored_result(column: Column[Any], text: ColumnElement[Any]) -> ColumnElement[Any]:
    """A result's JSON text as the column's value: cast to a JSON column's type, or for a
    column of another type, the JSON scalar's text (``#>> '{}'``) cast to it."""
    if isinstance(column.type, JSON):
        return cast(text, column.type)
    scalar = cast(text, JSONB()).op("#>>", return_type=Text())(literal_column("'{}'"))
    return cast(scalar, column.type)


#: The longest list of ids a finishing statement's NOTIFY carries; past it, ``*`` (every
#: waiter reads its job again). PostgreSQL refuses payloads of 8,000 bytes and more.
NOTIFY_IDS_MAX = 7000


def results_notified(qt: QueueTable, moved: Any, *, failed_only: bool = False) -> ColumnElement[Any]:
    """A condition that holds for every row and, evaluated once per statement, NOTIFYs the
    ids of the rows of ``moved`` (the CTE of a finishing UPDATE, its key first) on the
    table's :func:`~sqla_queue.model.results_channel` (comma-separated; ``*`` when too
    many), delivered at commit: what :func:`sqla_queue.wait_for_result` listens for.
    ``failed_only``: only the rows returned with status ``failed`` finished (a retry's)."""
    first = next(iter(moved.c))
    finished = [moved.c.status == status_literal(FAILED)] if failed_only else []
    ids = func.string_agg(cast(first, Text()), literal(",", String()))
    payload = case((func.length(ids) > NOTIFY_IDS_MAX, literal("*", String())), else_=ids)
    notified = (
        select(pg_notify(results_channel(qt.table), payload).label("sent"))
        .select_from(moved)
        .where(*finished)
        .having(func.count() > 0)
        .cte("sqla_queue_notified")
    )
    # An uncorrelated scalar subquery: an InitPlan, run once, so one NOTIFY per statement.
    sent = select(func.count()).select_from(notified).scalar_subquery()
    return sent >= 0


def progress_extra(qt: QueueTable) -> tuple[tuple[str, str, bool], ...]:
    """The tokens' optional progress column (``PROGRESS_PARAM``), on a table that keeps
    progress: the extra of :func:`~._base._token_table` a transition adds."""
    return ((PROGRESS_PARAM, "text", True),) if progress_column(qt.table) is not None else ()


def progress_values(qt: QueueTable, given: ColumnElement[Any] | None) -> dict[str, Any]:
    """The SET of a transition that records progress: each token's, or the row's when
    the token has none (NULL). Nothing on a table that keeps no progress."""
    column = progress_column(qt.table)
    if column is None or given is None:
        return {}
    return {column.key: func.coalesce(cast(given, column.type), column)}


def _progress_of(qt: QueueTable, tokens: Any) -> dict[str, Any]:
    """The SET of the tokens' progress (``PROGRESS_PARAM``), on a table that keeps it."""
    return progress_values(qt, tokens.c[PROGRESS_PARAM]) if progress_extra(qt) else {}


def job_result(model: QueueModel, job_id: Any) -> Select[Any]:
    """``(status, result, last_error)`` of job ``job_id`` of a table that keeps results
    (no row: no such job). Raises ``TypeError`` for a table that keeps none."""
    qt = queue_table(model)
    column = result_column(qt.table)
    if column is None:
        raise TypeError(
            f"table {qt.table.name!r} keeps no results: mix sqla_queue.ResultMixin into its model "
            f"(or name a column in __queue_result__)"
        )
    return select(qt.c.status, column, qt.c.last_error).where(qt.pk == job_id)
