"""Unique jobs: the keyed insert that skips a held key, the holder of a key, and the finished
rows that keep theirs.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Select, and_, bindparam, select
from sqlalchemy.dialects.postgresql import Insert
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql.elements import ColumnElement

from ..errors import EnqueueError
from ..model import (
    FINISHED_STATUSES,
    QueueTable,
    UniqueJobs,
    queue_table,
    status_literal,
    unique_jobs,
    unique_predicate,
)
from ._base import QueueModel, _status


def keeps_unique_key(model: QueueModel) -> ColumnElement[bool] | None:
    """The condition of finished jobs that still hold their unique key (a key, in a
    finished status of the model's :class:`~sqla_queue.UniqueJobs`: ``done`` under
    :data:`~sqla_queue.UNIQUE_EVER`); None when no finished status holds keys.

    Such a row is what makes "at most once, ever" true: deleting it frees its key, and
    the same work can then be enqueued and run again. So :func:`prune_finished` and
    :func:`archive_finished` never remove one, and :func:`delete_jobs` only with
    ``free_keys=True``.
    """
    qt = queue_table(model)
    unique = unique_jobs(qt.table)
    if unique is None:
        return None
    kept = [s for s in unique.statuses if s in FINISHED_STATUSES]
    if not kept:
        return None
    statuses: ColumnElement[bool] = (
        _status(qt, kept[0]) if len(kept) == 1 else qt.c.status.in_([status_literal(s) for s in kept])
    )
    return and_(qt.c[unique.column].isnot(None), statuses)


def _unique(qt: QueueTable) -> UniqueJobs:
    unique = unique_jobs(qt.table)
    if unique is None:
        raise EnqueueError(
            f"table {qt.table.fullname!r} has no unique key: its model needs sqla_queue.JobMixin's "
            "unique_key column (or a __queue_unique__ = UniqueJobs(...) declaration)"
        )
    return unique


def insert_unique(model: QueueModel) -> Insert:
    """``INSERT … ON CONFLICT (key) WHERE … DO NOTHING`` into the queue table: a job
    whose key is already held (in the statuses of the model's
    :class:`~sqla_queue.UniqueJobs`) is skipped, never an error, so the caller's
    transaction goes on. Add ``.values(...)`` (or execute with parameters) and, to learn
    which rows went in, ``.returning(...)``. The conflict target names the partial unique
    index by its column and predicate; a concurrent insert of the same key waits for the
    other transaction, then skips if it committed."""
    qt = queue_table(model)
    unique = _unique(qt)
    return pg_insert(qt.table).on_conflict_do_nothing(
        index_elements=[qt.c[unique.column]], index_where=unique_predicate(qt.table, unique)
    )


def unique_holder(model: QueueModel, *, key: Any) -> Select[Any]:
    """The primary key of the job holding ``key`` (in the statuses where a key is held),
    if one does: what a skipped :func:`insert_unique` was skipped for."""
    qt = queue_table(model)
    unique = _unique(qt)
    column = qt.c[unique.column]
    return select(qt.pk).where(column == bindparam("sqla_queue_unique_key", key, type_=column.type)).where(
        unique_predicate(qt.table, unique)
    )
