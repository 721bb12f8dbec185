"""Administrative operations over a queue table, shared by both command lines.

Each runs the statement builders in short transactions until the work is done, so a
large backlog never holds locks for long.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine, text

from . import sql as q
from .cancel import cancel as cancel_jobs
from .driver import WorkerStartError
from .model import queue_table, table_problem

__all__ = ["cancel", "check_table", "format_stats", "prune", "requeue", "sweep"]

_COLUMNS = text(
    "SELECT a.attname FROM pg_attribute a "
    "WHERE a.attrelid = to_regclass(:name) AND a.attnum > 0 AND NOT a.attisdropped"
)


def check_table(engine: Engine, model: Any) -> None:
    """Raise :class:`~sqla_queue.WorkerStartError`, in the worker's words, when ``model``'s
    table is missing from the database or lacks the queue columns.

    Run before a command, it turns the database's "relation ... does not exist" into what
    to do about it: create the table, or migrate it.
    """
    table = queue_table(model).table
    with engine.connect() as conn:
        schema = table.schema
        translate = conn.get_execution_options().get("schema_translate_map")
        if translate and schema in translate:
            schema = translate[schema]
        quote = conn.dialect.identifier_preparer.quote
        name = f"{quote(schema)}.{quote(table.name)}" if schema else quote(table.name)
        columns = list(conn.scalars(_COLUMNS, {"name": name}))
    problem = table_problem(f"{schema}.{table.name}" if schema else table.name, columns)
    if problem is not None:
        raise WorkerStartError(problem)


def sweep(engine: Engine, model: Any, *, limit: int = 1000) -> tuple[int, int]:
    """Sweep every expired lease; returns (back to pending, dead-lettered)."""
    back = dead = 0
    while True:
        with engine.begin() as conn:
            rows = conn.execute(q.sweep_expired(model, limit=limit)).all()
        dead += sum(1 for row in rows if row[1] == "failed")
        back += sum(1 for row in rows if row[1] != "failed")
        if len(rows) < limit:
            return back, dead


def requeue(
    engine: Engine,
    model: Any,
    *,
    ids: Sequence[Any] | None = None,
    queues: Sequence[str] | None = None,
    statuses: Sequence[str] = ("failed",),
) -> int:
    """Give dead-lettered (and, with ``statuses``, cancelled) jobs fresh attempts;
    returns how many.

    ``ids=None`` means every such job (of ``queues``), an empty ``ids`` none at all.
    """
    with engine.begin() as conn:
        stmt = q.requeue_failed(model, ids=ids, queues=queues or None, statuses=statuses)
        return len(conn.scalars(stmt).all())


def cancel(
    engine: Engine, model: Any, *, ids: Sequence[Any] | None = None, queues: Sequence[str] | None = None
) -> list[Any]:
    """Cancel pending and running jobs (:func:`sqla_queue.cancel`) in a transaction of
    its own; returns the keys cancelled."""
    with engine.begin() as conn:
        return cancel_jobs(conn, model, ids=ids, queues=queues or None)


def prune(
    engine: Engine,
    model: Any,
    *,
    older_than: timedelta,
    statuses: Sequence[str] = ("done", "cancelled"),
    limit: int = 10_000,
) -> int:
    """Delete finished jobs older than ``older_than``, ``limit`` per transaction."""
    total = 0
    while True:
        stmt = q.prune_finished(model, older_than=older_than, statuses=statuses, limit=limit)
        with engine.begin() as conn:
            deleted = int(conn.execute(stmt).rowcount)
        total += deleted
        if deleted < limit:
            return total


def format_stats(engine: Engine, model: Any) -> str:
    """Jobs per queue and status, and the oldest runnable job's age, as a text table."""
    with engine.connect() as conn:
        rows = conn.execute(q.queue_stats(model)).all()
    if not rows:
        return "(no jobs)"
    header = ("queue", "status", "jobs", "oldest runnable")
    table = [header] + [(r.queue, r.status, str(r.jobs), _age(r.oldest_runnable_age)) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in table]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _age(age: timedelta | None) -> str:
    if age is None:
        return "-"
    seconds = max(age.total_seconds(), 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.1f}s"
