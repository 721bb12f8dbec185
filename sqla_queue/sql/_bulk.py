"""Bulk actions by filter: every job a filter matches requeued, cancelled or deleted,
one bounded batch per statement, walking the table in key order.

Each batch is the fenced statement of its action (:func:`requeue_failed`'s, the cancel
of :func:`cancel_jobs`, :func:`delete_jobs`') over at most ``limit`` rows: the next
ones after the key ``after`` (the last key the previous batch returned) that the action
takes, picked once in an ``InitPlan`` (``pk = ANY(ARRAY(…))``) and locked in key order.
Rows that changed under the pick are passed over and the next ones taken, so a batch
comes back short only at the end of the walk. ``created_before`` bounds the walk to the
jobs that existed when it started: jobs enqueued meanwhile (a busy queue being
cancelled) are not chased.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Final, Literal

from sqlalchemy import DateTime, Select, bindparam, delete, false, func, literal, select
from sqlalchemy.sql.dml import ReturningDelete, ReturningUpdate
from sqlalchemy.sql.elements import ColumnElement

from ..model import JobStatus, QueueTable, queue_table, status_literal
from ._base import FAILED, PENDING, RUNNING, QueueModel, _keys_of, _kind_filter
from ._cancel import _cancel
from ._inspect import _job_filter, _statuses
from ._results import Finishing
from ._retention import DELETABLE_STATUSES, _delete_conditions, _requeue_conditions, _requeue_values
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
    after: Any = None,
    limit: int = BULK_BATCH,
) -> ReturningUpdate[Any]:
    """One batch of a requeue by filter: :func:`requeue_failed` (dead letters back to
    ``pending`` with fresh attempts, none whose unique key another job holds) on the next
    ``limit`` of them after the key ``after``, in key order; returns their keys.

    ``statuses`` is the filter's (None: any): only ``failed`` jobs among them move."""
    qt = queue_table(model)
    conditions = _conditions(qt, "requeue", statuses, queues=queues, tasks=tasks, error_contains=error_contains)
    chosen = _batch(qt, conditions, after=after, created_before=created_before, limit=limit, skip_locked=False)
    return (
        qt.table.update().where(*conditions, _keys_of(qt, chosen)).values(**_requeue_values(0)).returning(qt.pk)
    )


def cancel_batch(
    model: QueueModel,
    *,
    queues: Sequence[str] | None = None,
    statuses: Sequence[JobStatus | str] | None = None,
    tasks: Sequence[str] | None = None,
    error_contains: str | None = None,
    created_before: datetime | None = None,
    after: Any = None,
    limit: int = BULK_BATCH,
) -> Finishing:
    """One batch of a cancel by filter: the cancel of :func:`cancel_jobs` (pending
    **and running** jobs, a fenced transition) on the next ``limit`` of them after the
    key ``after``, in key order; returns ``(pk, status before)`` of each. Send the
    running ones' workers the cancel message, as :func:`sqla_queue.cancel` does.

    ``statuses`` is the filter's (None: any): only pending and running jobs among them
    are cancelled. The pick waits for rows another transaction holds (a worker's
    heartbeat), as the cancel does: a running job is cancelled, never passed over."""
    qt = queue_table(model)
    conditions = _conditions(qt, "cancel", statuses, queues=queues, tasks=tasks, error_contains=error_contains)
    chosen = _batch(qt, conditions, after=after, created_before=created_before, limit=limit, skip_locked=False)
    return _cancel(qt, [*conditions, _keys_of(qt, chosen)])


def delete_batch(
    model: QueueModel,
    *,
    queues: Sequence[str] | None = None,
    statuses: Sequence[JobStatus | str] | None = None,
    tasks: Sequence[str] | None = None,
    error_contains: str | None = None,
    created_before: datetime | None = None,
    after: Any = None,
    limit: int = BULK_BATCH,
    free_keys: bool = False,
) -> ReturningDelete[Any]:
    """One batch of a delete by filter: :func:`delete_jobs` (never a ``running`` job,
    nor one still holding its unique key unless ``free_keys``; rows another transaction
    holds are skipped) on the next ``limit`` rows after the key ``after``, in key order;
    returns their keys.

    ``statuses`` is the filter's (None: any): running jobs among them stay."""
    qt = queue_table(model)
    conditions = _conditions(
        qt, "delete", statuses, queues=queues, tasks=tasks, error_contains=error_contains, free_keys=free_keys
    )
    chosen = _batch(qt, conditions, after=after, created_before=created_before, limit=limit, skip_locked=True)
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
        return _requeue_conditions(qt, chosen, filters)
    if action == "cancel":
        literals = [status_literal(s) for s in chosen]
        status = qt.c.status == literals[0] if len(literals) == 1 else qt.c.status.in_(literals)
        return [status, *filters, *_kind_filter(qt)]
    return _delete_conditions(
        qt, queues=queues, statuses=chosen, tasks=tasks, error_contains=error_contains, free_keys=free_keys
    )


def _batch(
    qt: QueueTable,
    conditions: list[ColumnElement[bool]],
    *,
    after: Any,
    created_before: datetime | None,
    limit: int,
    skip_locked: bool,
) -> Select[Any]:
    """The keys of the next ``limit`` rows after ``after`` that ``conditions`` pick,
    created at ``created_before`` or earlier, locked in key order."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be an integer of at least 1, got {limit!r}")
    where = list(conditions)
    if after is not None:
        where.append(qt.pk > bindparam("sqla_queue_after", after, type_=qt.pk.type))
    if created_before is not None:
        where.append(_created_before(qt, created_before))
    return select(qt.pk).where(*where).order_by(qt.pk).limit(limit).with_for_update(skip_locked=skip_locked)


def _created_before(qt: QueueTable, moment: datetime) -> ColumnElement[bool]:
    if not isinstance(moment, datetime) or moment.utcoffset() is None:
        raise ValueError(f"created_before must be a timezone-aware datetime, got {moment!r}")
    created: ColumnElement[datetime] = qt.c.created_at
    return created <= bindparam("sqla_queue_created_before", moment, type_=DateTime(timezone=True))
