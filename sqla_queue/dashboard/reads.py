"""What the dashboard reads, shared by its pages and its JSON API (:mod:`.api`).

Each function reads through the statement builders of :mod:`sqla_queue.sql` and the
tools of :mod:`sqla_queue.admin`, bounded as a page must be (a list reads previews cut in
SQL, a job its big values cut to what is shown), and returns plain values: the pages
render them as HTML, the API as JSON. Not a public module: its names may change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flask import abort
from sqlalchemy import JSON, BigInteger, ColumnElement, Engine, Integer, SmallInteger, String, Text, case, cast, func
from sqlalchemy.dialects.postgresql import JSONB

from .. import admin
from .. import sql as q
from ..model import history_column

if TYPE_CHECKING:
    from . import _Settings, _Table

#: A list shows the first characters of a JSON value stored uncompressed in at most
#: this many bytes (the last ones of a text of at most ``_PREVIEW_TEXT_BYTES``), and only
#: the size of a bigger one: PostgreSQL would read, decompress and render all of it to
#: give a few characters (a 4 MB payload for 60 of them). Its job page shows the start.
_PREVIEW_BYTES = 4096
_PREVIEW_TEXT_BYTES = 16384
_PREVIEW_CHARS = 200
#: How much of ``last_error`` the job page shows before linking to the whole.
_ERROR_VIEW = 100_000


#: The values each integer column type can hold: a key outside them names no job (and
#: PostgreSQL would refuse the statement that looks for it).
_INT_RANGES = ((BigInteger, 63), (SmallInteger, 15), (Integer, 31))


def _as_text(column: Any) -> ColumnElement[str] | None:
    """``column`` as text rendered by PostgreSQL, for the types whose values can be big
    (JSON, text without a length); None for the others (and for a ``TypeDecorator``,
    whose Python side may change what the value shows)."""
    kind = column.type
    if isinstance(kind, JSONB):
        return func.jsonb_pretty(column)
    if isinstance(kind, JSON):
        return cast(column, Text)
    if isinstance(kind, String) and kind.length is None:
        return column  # type: ignore[no-any-return]
    return None


#: The lease a worker not seen for is shown as gone, when the dashboard was given none.
_DEFAULT_LEASE = 60.0


def _attempt(entry: dict[str, Any]) -> dict[str, str]:
    """One entry of a job's history as the page shows it: every field a text."""
    seconds = entry.get("seconds")
    return {
        "attempt": str(entry.get("attempt", "")),
        "outcome": str(entry.get("outcome") or ""),
        "worker": str(entry.get("worker") or ""),
        "started_at": str(entry.get("started_at") or ""),
        "seconds": f"{float(seconds):.3f}" if isinstance(seconds, int | float) else "",
        "error": str(entry.get("error") or ""),
    }


def _job_view(settings: _Settings, entry: _Table, key: Any) -> tuple[dict[str, Any], dict[str, int]] | None:
    """A job's columns, each value that can be big cut in SQL to what the page shows
    (``truncate`` characters, ``last_error`` more), with the full lengths of those: the
    page of a job with a 4 MB payload reads a few kilobytes. None when there is no job."""
    table = entry.qt.table
    shown: list[Any] = []
    measured: list[str] = []
    attempts = history_column(table)  # read whole: bounded by its entries and their size
    for column in table.c:
        text = _as_text(column)
        if text is None or column is attempts:
            shown.append(column)
            continue
        bound = _ERROR_VIEW if column.name == "last_error" else settings.truncate
        shown.append(func.left(text, bound + 1).label(column.name))
        measured.append(column.name)
    lengths = [func.length(_as_text(table.c[name])) for name in measured]
    with settings.engine.connect() as conn:
        row = conn.execute(q.get_job(entry.model, key).with_only_columns(*shown, *lengths)).first()
    if row is None:
        return None
    values = dict(zip(table.c.keys(), row[: len(shown)], strict=True))
    return values, {name: int(n or 0) for name, n in zip(measured, row[len(shown):], strict=True)}


def _list_columns(entry: _Table) -> list[Any]:
    """The columns a list shows, a payload and an error only as a bounded preview (see
    :data:`_PREVIEW_BYTES`) with their stored size."""
    c = entry.qt.c
    columns: list[Any] = [
        entry.qt.pk, c.queue, c.status, c.attempts, c.max_attempts, c.run_after, c.created_at, c.lease_owner,
    ]
    if entry.has_task:
        columns.append(c.task)
    previews = [("last_error", True)] + ([("payload", False)] if entry.has_payload else [])
    for name, tail in previews:
        column = c[name]
        if isinstance(column.type, String):
            # The length of a text, compressed or not, is in its header: nothing is read.
            text: Any = column
            size: Any = func.octet_length(column)
            small = size <= _PREVIEW_TEXT_BYTES
        else:
            text = cast(column, Text)
            size = func.pg_column_size(column)  # as stored: a JSON value has no cheaper length
            small = (size <= _PREVIEW_BYTES) & func.pg_column_compression(column).is_(None)
        cut = func.right(text, _PREVIEW_CHARS) if tail else func.left(text, _PREVIEW_CHARS)
        columns += [case((small, cut), else_=None).label(name), size.label(f"{name}_bytes")]
    return columns


#: How many of its running jobs the workers page names for each worker.
_RUNNING_SHOWN = 10


def _running_jobs(engine: Engine, entry: _Table) -> dict[str | None, list[Any]]:
    """The running jobs of each worker (its executors' together), up to
    :data:`_RUNNING_SHOWN` each, newest first: what each is running."""
    c = entry.qt.c
    columns = [entry.qt.pk, c.lease_owner, c.queue, *([c.task] if entry.has_task else [])]
    stmt = q.list_jobs(entry.model, statuses=["running"], limit=1000).with_only_columns(*columns)
    with engine.connect() as conn:
        rows = conn.execute(stmt).all()
    running: dict[str | None, list[Any]] = {}
    for row in rows:
        match = admin._EXECUTOR.match(row.lease_owner or "")
        worker = match["worker"] if match else row.lease_owner
        jobs = running.setdefault(worker, [])
        if len(jobs) < _RUNNING_SHOWN:
            jobs.append(row._mapping)
    return running


def _job_id(entry: _Table, value: str) -> Any:
    try:
        key = admin.parse_job_id(entry.model, value)
    except ValueError:
        abort(404)
    column_type = entry.qt.pk.type
    if isinstance(key, int):
        for kind, bits in _INT_RANGES:
            if isinstance(column_type, kind):
                if not -(2**bits) <= key < 2**bits:
                    abort(404)
                break
    return key


def _split(values: list[str]) -> tuple[str, ...]:
    """Repeated query arguments, each also split on commas: ``?queue=a,b&queue=c``."""
    parts = (part.strip() for value in values for part in value.split(","))
    return tuple(dict.fromkeys(part for part in parts if part))


def _list_page(
    settings: _Settings, entry: _Table, filters: admin.JobFilters, *, before: Any, limit: int
) -> admin.JobPage:
    """A page of jobs matching ``filters`` after the key ``before`` (keyset pagination):
    :func:`sqla_queue.admin.list_jobs`' statement, reading only what a list shows
    (:func:`_list_columns`); ``next_before`` is the key of the next page's start."""
    stmt = q.list_jobs(
        entry.model, **filters.builder_kwargs(), before=before, limit=limit + 1
    ).with_only_columns(*_list_columns(entry))
    with settings.engine.connect() as conn:
        rows = list(conn.execute(stmt).all())
    more = len(rows) > limit
    rows = rows[:limit]
    return admin.JobPage(rows, rows[-1]._mapping[entry.qt.pk.name] if more else None)


def _job_value(settings: _Settings, entry: _Table, key: Any, column: str) -> tuple[bool, Any]:
    """One column of one job, whole, as its Python value: (found, value). What a job's
    bounded view links to when a value was cut."""
    with settings.engine.connect() as conn:
        row = conn.execute(q.get_job(entry.model, key).with_only_columns(entry.qt.table.c[column])).first()
    return (False, None) if row is None else (True, row[0])
