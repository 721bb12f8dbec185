"""Bulk actions by filter: every job a filter matches requeued, cancelled or deleted,
one bounded batch per statement, walking the table newest key first.

Each batch is the fenced statement of its action (:func:`requeue_failed`'s, the cancel
of :func:`cancel_jobs`, :func:`delete_jobs`') over at most ``limit`` rows: the next
ones before the key ``before`` (the last key of the previous batch) that the action
takes, picked once and locked in key order (``pk = ANY(ARRAY(…))``, or a materialized
CTE). Rows that changed under the pick are passed over and the next ones taken.
``created_before`` bounds the walk to the jobs that existed when it started: jobs
enqueued meanwhile (a busy queue being cancelled) are not chased.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Final, Literal

from sqlalchemy import DateTime, Select, bindparam, delete, false, func, literal, or_, select
from sqlalchemy.sql.dml import ReturningDelete, ReturningUpdate
from sqlalchemy.sql.elements import ColumnElement

from ..model import JobStatus, QueueTable, UniqueJobs, queue_table, status_literal, unique_jobs
from ._base import FAILED, PENDING, RUNNING, QueueModel, _keys_of, _kind_filter
from ._cancel import _cancel
from ._finish import Finishing
from ._inspect import _job_filter, _statuses
from ._retention import DELETABLE_STATUSES, _delete_conditions, _requeue_values
from ._unique import keeps_unique_key

#: How many rows one statement of a bulk action takes, by default.
BULK_BATCH: Final = 1000
#: The bulk actions, and the statuses each one acts on (requeue: dead letters only).
BulkAction = Literal["requeue", "cancel", "delete"]
BULK_STATUSES: Final[dict[str, tuple[JobStatus, ...]]] = {
    "requeue": (FAILED,),
    "cancel": (PENDING, RUNNING),
    "delete": DELETABLE_STATUSES,
}


def requeue_batch(
    model: QueueModel,
    *,
    queues: Sequence[str] | None = None,
    statuses: Sequence[JobStatus | str] | None = None,
    tasks: Sequence[str] | None = None,
    error_contains: str | None = None,
    created_before: datetime | None = None,
    before: Any = None,
    limit: int = BULK_BATCH,
) -> ReturningUpdate[Any]:
    """One batch of a requeue by filter: dead letters back to ``pending`` with fresh
    attempts (:func:`requeue_failed`'s values), the next ``limit`` of them before the key
    ``before``, newest first; returns the keys it moved.

    ``statuses`` is the filter's (None: any): only ``failed`` jobs among them move. As
    :func:`requeue_failed`, a dead letter whose unique key another job holds (pending,
    running, or a newer dead letter requeued first) stays: the walk passes over keys held
    in the statuses of the model's :class:`~sqla_queue.UniqueJobs` (read through its
    unique index), and of two dead letters of one key in a batch only the newer moves,
    the older then held by it. So a batch may move fewer than it picked: the walk ends
    at the first batch that moves none."""
    qt = queue_table(model)
    conditions = _conditions(qt, "requeue", statuses, queues=queues, tasks=tasks, error_contains=error_contains)
    unique = _requeue_guard(qt)
    columns = [qt.pk] if unique is None else [qt.pk, qt.c[unique.column]]
    picked = _batch(qt, conditions, before=before, created_before=created_before, limit=limit, skip_locked=False,
                    columns=columns).cte("sqla_queue_picked")
    key = qt.pk.name
    where: list[ColumnElement[bool]] = [qt.pk == picked.c[key], _status_in(qt, [FAILED])]
    if unique is not None:
        newer = picked.alias("sqla_queue_newer")
        where.append(~select(literal(1)).where(
            newer.c[unique.column] == picked.c[unique.column], newer.c[key] > picked.c[key]
        ).exists())
    return qt.table.update().where(*where).values(**_requeue_values(0)).returning(qt.pk)


def cancel_batch(
    model: QueueModel,
    *,
    queues: Sequence[str] | None = None,
    statuses: Sequence[JobStatus | str] | None = None,
    tasks: Sequence[str] | None = None,
    error_contains: str | None = None,
    created_before: datetime | None = None,
    before: Any = None,
    limit: int = BULK_BATCH,
) -> Finishing:
    """One batch of a cancel by filter: the cancel of :func:`cancel_jobs` (pending
    **and running** jobs, a fenced transition) on the next ``limit`` of them before the
    key ``before``, newest first; returns ``(pk, status before)`` of each. Send the
    running ones' workers the cancel message, as :func:`sqla_queue.cancel` does.

    ``statuses`` is the filter's (None: any): only pending and running jobs among them
    are cancelled. The pick waits for rows another transaction holds (a worker's
    heartbeat), as the cancel does: a running job is cancelled, never passed over."""
    qt = queue_table(model)
    conditions = _conditions(qt, "cancel", statuses, queues=queues, tasks=tasks, error_contains=error_contains)
    chosen = _batch(qt, conditions, before=before, created_before=created_before, limit=limit, skip_locked=False)
    return _cancel(qt, [*conditions, _keys_of(qt, chosen)])


def delete_batch(
    model: QueueModel,
    *,
    queues: Sequence[str] | None = None,
    statuses: Sequence[JobStatus | str] | None = None,
    tasks: Sequence[str] | None = None,
    error_contains: str | None = None,
    created_before: datetime | None = None,
    before: Any = None,
    limit: int = BULK_BATCH,
    free_keys: bool = False,
) -> ReturningDelete[Any]:
    """One batch of a delete by filter: :func:`delete_jobs` (never a ``running`` job,
    nor one still holding its unique key unless ``free_keys``; rows another transaction
    holds are skipped) on the next ``limit`` rows before the key ``before``, newest
    first; returns their keys.

    ``statuses`` is the filter's (None: any): running jobs among them stay."""
    qt = queue_table(model)
    conditions = _conditions(
        qt, "delete", statuses, queues=queues, tasks=tasks, error_contains=error_contains, free_keys=free_keys
    )
    chosen = _batch(qt, conditions, before=before, created_before=created_before, limit=limit, skip_locked=True)
    return delete(qt.table).where(_keys_of(qt, chosen)).returning(qt.pk)


def bulk_count(
    model: QueueModel,
    action: BulkAction,
    *,
    queues: Sequence[str] | None = None,
    statuses: Sequence[JobStatus | str] | None = None,
    tasks: Sequence[str] | None = None,
    error_contains: str | None = None,
    created_before: datetime | None = None,
) -> Select[Any]:
    """``(matched, acting, holding_keys, now)``: how many jobs the filter matches, how
    many of them ``action`` takes (requeue: dead letters; cancel: pending and running;
    delete: all but running, key holders aside), how many more a delete takes only when
    told to free their unique keys (0 for the other actions), and the database's
    ``now()``, the ``created_before`` of the walk that follows (``created_before``
    here: only the jobs a walk bounded by it takes)."""
    qt = queue_table(model)
    filters = _job_filter(qt, queues=queues, statuses=statuses, tasks=tasks, error_contains=error_contains)
    if created_before is not None:
        filters.append(_created_before(qt, created_before))
    acting = _conditions(qt, action, statuses)
    kept: ColumnElement[Any] = literal(0)
    holding = keeps_unique_key(qt.table)
    if action == "delete" and holding is not None:
        kept = func.count().filter(*_conditions(qt, action, statuses, free_keys=True), holding)
    return select(
        func.count().label("matched"),
        func.count().filter(*acting).label("acting"),
        kept.label("holding_keys"),
        func.now().label("now"),
    ).select_from(qt.table).where(*filters)


def _conditions(
    qt: QueueTable,
    action: str,
    statuses: Sequence[JobStatus | str] | None,
    *,
    queues: Sequence[str] | None = None,
    tasks: Sequence[str] | None = None,
    error_contains: str | None = None,
    free_keys: bool = False,
) -> list[ColumnElement[bool]]:
    """The conditions of the rows ``action`` takes among those the filter matches: its
    action's builder's, on the statuses it acts on that ``statuses`` (None: any) admits;
    a plain ``false`` when the filter admits none of them."""
    if action not in BULK_STATUSES:
        raise ValueError(f"unknown bulk action {action!r} (one of {', '.join(BULK_STATUSES)})")
    wanted = _statuses(statuses)
    chosen = [s for s in BULK_STATUSES[action] if wanted is None or s in wanted]
    if not chosen:
        return [false()]
    filters = _job_filter(qt, queues=queues, tasks=tasks, error_contains=error_contains)
    if action == "requeue":
        unique = _requeue_guard(qt)
        return [_status_in(qt, chosen), *filters, *([] if unique is None else [~_key_held(qt, unique)])]
    if action == "cancel":
        return [_status_in(qt, chosen), *filters, *_kind_filter(qt)]
    return _delete_conditions(
        qt, queues=queues, statuses=chosen, tasks=tasks, error_contains=error_contains, free_keys=free_keys
    )


def _batch(
    qt: QueueTable,
    conditions: list[ColumnElement[bool]],
    *,
    before: Any,
    created_before: datetime | None,
    limit: int,
    skip_locked: bool,
    columns: Sequence[Any] | None = None,
) -> Select[Any]:
    """The keys (or ``columns``) of the next ``limit`` rows before ``before`` that
    ``conditions`` pick, created at ``created_before`` or earlier, newest first, locked."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be an integer of at least 1, got {limit!r}")
    where = list(conditions)
    if before is not None:
        where.append(qt.pk < bindparam("sqla_queue_before", before, type_=qt.pk.type))
    if created_before is not None:
        where.append(_created_before(qt, created_before))
    return (
        select(*(columns or [qt.pk])).where(*where).order_by(qt.pk.desc()).limit(limit)
        .with_for_update(skip_locked=skip_locked)
    )


def _status_in(qt: QueueTable, statuses: Sequence[JobStatus]) -> ColumnElement[bool]:
    """``status`` is one of ``statuses``, as literals (the partial indexes match them)."""
    column: ColumnElement[str] = qt.c.status
    literals = [status_literal(s) for s in statuses]
    return column == literals[0] if len(literals) == 1 else column.in_(literals)


def _requeue_guard(qt: QueueTable) -> UniqueJobs | None:
    """The model's unique jobs when a requeued dead letter could take a key another
    job holds (:func:`requeue_failed`'s guard): ``failed`` is not among its statuses."""
    unique = unique_jobs(qt.table)
    return unique if unique is not None and FAILED not in unique.statuses else None


def _key_held(qt: QueueTable, unique: UniqueJobs) -> ColumnElement[bool]:
    """Another job holds the row's key now: one in the statuses of the unique index,
    found through that index (its predicate, word for word)."""
    holder = qt.table.alias("sqla_queue_holder")
    key = holder.c[unique.column]
    holding = [holder.c.status == status_literal(s) for s in unique.statuses]
    return select(literal(1)).where(
        key == qt.c[unique.column], key.isnot(None), or_(*holding) if len(holding) > 1 else holding[0],
        holder.c[qt.pk.key] != qt.pk,
    ).exists()


def _created_before(qt: QueueTable, moment: datetime) -> ColumnElement[bool]:
    if not isinstance(moment, datetime) or moment.utcoffset() is None:
        raise ValueError(f"created_before must be a timezone-aware datetime, got {moment!r}")
    created: ColumnElement[datetime] = qt.c.created_at
    return created <= bindparam("sqla_queue_created_before", moment, type_=DateTime(timezone=True))
