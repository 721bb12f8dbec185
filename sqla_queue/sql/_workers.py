"""The workers table's statements: a worker's row written at its start and with each
heartbeat, deleted at its stop, the rows listed, and the rows of long-dead workers pruned.
"""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy import Delete, Float, Select, Table, Text, cast, func, select
from sqlalchemy.dialects.postgresql import JSONB, insert
from sqlalchemy.sql.dml import Insert, ReturningDelete

from ..model import queue_table
from ..registry import declared_workers_table
from ._base import QueueModel, _clock, _param, seconds_interval

__all__ = ["forget_worker", "prune_workers", "record_worker", "worker_rows"]

#: Bound-parameter names of :func:`record_worker` (one per column; JSON as text).
WORKER_PARAMS: Final = ("name", "host", "pid", "queues", "concurrency", "runtime", "version", "running", "jobs")


def _table(model: QueueModel) -> Table:
    qt = queue_table(model)
    found = declared_workers_table(qt.table)
    if found is None:
        raise TypeError(
            f"{qt.table.name!r} has no workers table: call sqla_queue.workers_table(Model) beside the model"
        )
    return found


def record_worker(model: QueueModel) -> Insert:
    """Insert or update a worker's row, seen now: ``sqla_queue_worker_<column>`` for each
    of :data:`WORKER_PARAMS` (``queues`` and ``jobs`` as JSON text, or NULL)."""
    t = _table(model)
    values: dict[str, Any] = {}
    for name in WORKER_PARAMS:
        column = t.c[name]
        bound = _param(f"sqla_queue_worker_{name}", Text() if name in ("queues", "jobs") else column.type)
        values[name] = cast(bound, JSONB()) if name in ("queues", "jobs") else bound
    values["last_seen"] = _clock()
    stmt = insert(t).values(**values)
    keep = ("host", "pid", "queues", "concurrency", "runtime", "version", "running", "jobs", "last_seen")
    return stmt.on_conflict_do_update(index_elements=[t.c.name], set_={k: stmt.excluded[k] for k in keep})


def forget_worker(model: QueueModel) -> Delete:
    """Delete the row of the worker ``sqla_queue_worker_name`` (it stops)."""
    t = _table(model)
    return t.delete().where(t.c.name == _param("sqla_queue_worker_name", t.c.name.type))


def prune_workers(model: QueueModel) -> ReturningDelete[Any]:
    """Delete the rows no heartbeat updated for ``sqla_queue_older_than`` seconds: their
    workers died without stopping. Returns the names."""
    t = _table(model)
    older = seconds_interval(_param("sqla_queue_older_than", Float()))
    return t.delete().where(t.c.last_seen < _clock() - older).returning(t.c.name)


def worker_rows(model: QueueModel) -> Select[Any]:
    """Every worker's row, the earliest started first, and the seconds since each was
    last seen (``seen_ago``)."""
    t = _table(model)
    ago = func.extract("epoch", _clock() - t.c.last_seen).label("seen_ago")
    return select(*t.c, ago).order_by(t.c.started_at, t.c.name)
