"""Retention: what becomes of finished jobs: requeued (dead letters given fresh attempts),
deleted, pruned past their age, moved to an archive; never a row that still holds a unique key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, Final, TypeAlias

from sqlalchemy import CTE, DateTime, Delete, Select, Table, and_, delete, func, insert, literal, null, or_, select
from sqlalchemy.sql.dml import ReturningDelete, ReturningInsert, ReturningUpdate
from sqlalchemy.sql.elements import ColumnElement

from ..model import FINISHED_STATUSES, JobStatus, QueueTable, queue_table, status_literal, unique_jobs
from ._base import (
    CANCELLED,
    DONE,
    FAILED,
    PENDING,
    RUNNING,
    Duration,
    QueueModel,
    _clock,
    _interval,
    _keys_of,
    _seconds,
    _status,
    seconds_interval,
)
from ._inspect import _job_filter, _statuses
from ._unique import keeps_unique_key
from ._workflows import no_waiting_children


def requeue_failed(
    model: QueueModel,
    *,
    ids: Iterable[Any] | None = None,
    queues: Sequence[str] | None = None,
    delay: Duration = 0,
    tasks: Sequence[str] | None = None,
    error_contains: str | None = None,
    statuses: Sequence[JobStatus | str] = (FAILED,),
) -> ReturningUpdate[Any]:
    """Give dead-lettered (``failed``) jobs a fresh set of attempts.

    ``last_error`` is kept for the record. ``ids=None`` requeues every failed job (of
    ``queues``, ``tasks``, with ``error_contains`` in ``last_error``: the filters of
    :func:`list_jobs`); an empty ``ids`` requeues none. ``delay`` counts from the update.
    ``statuses``: the finished states to requeue, ``failed`` and/or ``cancelled``.

    Unique jobs: a job whose key another job holds now (or a newer job of ``statuses``
    with the same key) stays as it is, so the requeue never breaks the unique index; an
    enqueue of that key racing the requeue can still make it fail with an
    ``IntegrityError`` (an UPDATE cannot skip a conflict), so run it again.
    """
    qt = queue_table(model)
    conditions = _requeue_conditions(qt, statuses, _job_filter(
        qt, ids=ids, queues=queues, tasks=tasks, error_contains=error_contains
    ))
    return qt.table.update().where(*conditions).values(**_requeue_values(delay)).returning(qt.pk)


def _requeue_conditions(
    qt: QueueTable, statuses: Sequence[JobStatus | str], filters: list[ColumnElement[bool]]
) -> list[ColumnElement[bool]]:
    """The rows a requeue moves: of ``statuses`` (failed and/or cancelled), matching
    ``filters``, and none whose unique key another job holds."""
    wanted = list(dict.fromkeys(JobStatus(s) for s in statuses))
    if not wanted or any(s not in (FAILED, CANCELLED) for s in wanted):
        raise ValueError(f"only failed and cancelled jobs can be requeued, got {[str(s) for s in wanted]}")
    status: ColumnElement[bool] = (
        _status(qt, wanted[0]) if len(wanted) == 1 else qt.c.status.in_([status_literal(s) for s in wanted])
    )
    conditions = [status, *filters]
    unique = unique_jobs(qt.table)
    if unique is not None and any(s not in unique.statuses for s in wanted):
        other = qt.table.alias("sqla_queue_holder")
        other_pk = other.c[qt.pk.key]
        held = or_(
            other.c.status.in_([status_literal(st) for st in unique.statuses]),
            and_(other.c.status.in_([status_literal(st) for st in wanted]), other_pk > qt.pk),
        )
        conditions.append(
            ~select(literal(1))
            .where(other.c[unique.column] == qt.c[unique.column], other_pk != qt.pk, held)
            .exists()
        )
    return conditions


def _requeue_values(delay: Duration) -> dict[str, Any]:
    """A requeued job: pending, fresh attempts, after ``delay`` (``last_error`` kept)."""
    return {
        "status": status_literal(PENDING),
        "attempts": 0,
        "run_after": _clock() + _interval(delay, "delay"),
        "finished_at": null(),
        "lease_owner": null(),
        "lease_expires_at": null(),
        "isolated": False,
    }


#: The statuses :func:`delete_jobs` may delete: all but ``running``.
DELETABLE_STATUSES: Final = (PENDING, DONE, FAILED, CANCELLED)


def delete_jobs(
    model: QueueModel,
    *,
    ids: Iterable[Any] | None = None,
    queues: Sequence[str] | None = None,
    statuses: Sequence[JobStatus | str] | None = None,
    tasks: Sequence[str] | None = None,
    error_contains: str | None = None,
    limit: int = 10_000,
    free_keys: bool = False,
) -> ReturningDelete[Any]:
    """Delete up to ``limit`` jobs matching the filters of :func:`job_filter`; returns
    their keys. Never a ``running`` job (its worker holds it: cancel it, or let it end),
    and rows another transaction holds are skipped, not waited for; run it until it
    returns fewer than ``limit`` rows. ``statuses=None`` means every deletable status.

    Finished jobs that still hold a unique key (:func:`keeps_unique_key`: ``done``
    under :data:`~sqla_queue.UNIQUE_EVER`) are kept unless ``free_keys=True``: deleting
    one frees its key, so the same work could be enqueued and run again.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be an integer of at least 1, got {limit!r}")
    qt = queue_table(model)
    conditions = _delete_conditions(
        qt, ids=ids, queues=queues, statuses=statuses, tasks=tasks, error_contains=error_contains,
        free_keys=free_keys,
    )
    doomed = (
        select(qt.pk)
        .where(*conditions)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    return delete(qt.table).where(_keys_of(qt, doomed)).returning(qt.pk)


def _delete_conditions(
    qt: QueueTable,
    *,
    ids: Iterable[Any] | None = None,
    queues: Sequence[str] | None = None,
    statuses: Sequence[JobStatus | str] | None = None,
    tasks: Sequence[str] | None = None,
    error_contains: str | None = None,
    free_keys: bool,
) -> list[ColumnElement[bool]]:
    """The rows a delete removes: matching the filters, of ``statuses`` (None: every
    deletable one; never ``running``), none still holding its unique key unless
    ``free_keys``."""
    wanted = _statuses(statuses)
    if wanted is None:
        wanted = list(DELETABLE_STATUSES)
    if RUNNING in wanted:
        raise ValueError("running jobs cannot be deleted: their worker holds them (cancel them first)")
    conditions = _job_filter(qt, ids=ids, queues=queues, statuses=wanted, tasks=tasks, error_contains=error_contains)
    kept = None if free_keys else keeps_unique_key(qt.table)
    if kept is not None:
        conditions.append(~kept)
    conditions.extend(no_waiting_children(qt))
    return conditions


#: Ages of finished jobs by status: what :func:`prune_finished` removes past which age.
Ages: TypeAlias = "Mapping[JobStatus | str, Duration | datetime]"


def _finished_before(
    qt: QueueTable,
    older_than: Duration | datetime | Ages,
    statuses: Sequence[JobStatus | str] | None,
    default: Sequence[JobStatus],
    limit: int,
    exclusive: bool,
) -> Select[Any]:
    if isinstance(older_than, Mapping):
        if statuses is not None:
            raise ValueError("give the statuses either as the keys of older_than or as statuses, not both")
        ages: dict[JobStatus, Duration | datetime] = {JobStatus(s): age for s, age in older_than.items()}
        wanted = list(ages)
    else:
        wanted = [JobStatus(s) for s in (default if statuses is None else statuses)]
        ages = dict.fromkeys(wanted, older_than)
    unfinished = [s for s in wanted if s not in FINISHED_STATUSES]
    if unfinished or not wanted:
        raise ValueError(
            f"only finished jobs ({', '.join(s.value for s in FINISHED_STATUSES)}) can be "
            f"removed, got {[s.value for s in wanted]}"
        )
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    cutoffs: dict[Any, list[JobStatus]] = {}
    for status, age in ages.items():
        if isinstance(age, datetime):
            if age.tzinfo is None:
                raise ValueError("older_than must be timezone-aware")
            key: Any = ("at", age)
        else:
            key = ("ago", _seconds(age, "older_than"))
        cutoffs.setdefault(key, []).append(status)
    conditions: list[ColumnElement[bool]] = []
    for (kind, value), group in cutoffs.items():
        cutoff: ColumnElement[datetime] = (
            literal(value, DateTime(timezone=True)) if kind == "at" else func.now() - seconds_interval(value)
        )
        conditions.append(and_(qt.c.status.in_([status_literal(s) for s in group]), qt.c.finished_at < cutoff))
    where = [or_(*conditions) if len(conditions) > 1 else conditions[0]]
    kept = keeps_unique_key(qt.table)
    if kept is not None:
        where.append(~kept)  # "at most once, ever": a key's holder outlives any retention
    where.extend(no_waiting_children(qt))
    if exclusive:
        where.insert(0, select(func.pg_try_advisory_xact_lock(prune_lock_key(qt.table))).scalar_subquery())
    return select(qt.pk).where(*where).limit(limit).with_for_update(skip_locked=True)


def prune_lock_key(table: Table) -> int:
    """The advisory lock ``exclusive`` pruning takes for ``table``: a 64-bit number from
    its name, the same in every process."""
    digest = hashlib.sha1(f"sqla_queue.prune:{table.fullname}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def prune_finished(
    model: QueueModel,
    *,
    older_than: Duration | datetime | Ages,
    statuses: Sequence[JobStatus | str] | None = None,
    limit: int = 10_000,
    exclusive: bool = False,
) -> Delete:
    """Delete up to ``limit`` jobs that finished before ``older_than`` ago.

    ``statuses`` default to ``done`` and ``cancelled``: dead letters (``failed``) are
    kept unless named. ``older_than`` may instead map statuses to their own ages,
    ``{"done": timedelta(days=7), "failed": timedelta(days=90)}`` (those statuses only).
    Bounded, so a large backlog is pruned in short transactions: run it until its
    rowcount is below ``limit``. Rows another transaction holds are skipped, and only
    finished rows are touched, so it never waits for (nor blocks) a claim.

    ``exclusive=True``: the statement first takes a transaction-level advisory lock of
    the table's (:func:`prune_lock_key`, tried, never waited for) and deletes nothing when
    another pruner holds it: many workers, at most one pruning a table at a time.

    Finished jobs that still hold a unique key (:func:`keeps_unique_key`: ``done``
    under :data:`~sqla_queue.UNIQUE_EVER`) are never pruned, whatever their age.
    """
    qt = queue_table(model)
    doomed = _finished_before(qt, older_than, statuses, (DONE, CANCELLED), limit, exclusive)
    return delete(qt.table).where(_keys_of(qt, doomed))


def archive_finished(
    model: QueueModel,
    archive: Table | type[Any],
    *,
    older_than: Duration | datetime | Ages,
    statuses: Sequence[JobStatus | str] | None = None,
    limit: int = 10_000,
    exclusive: bool = False,
) -> ReturningInsert[Any]:
    """Move finished jobs into ``archive`` in one statement (``WITH moved AS (DELETE …
    RETURNING …) INSERT INTO archive SELECT … FROM moved``).

    Every column the two tables share by name is copied; see
    :func:`sqla_queue.archive_table` for a ready-made archive table. ``statuses``
    default to every finished one; ``older_than`` and ``exclusive`` are those of
    :func:`prune_finished`. Returns the ids it moved; bounded by ``limit``, so run it
    until it returns fewer. Finished jobs that still hold a unique key stay in the queue
    table (:func:`keeps_unique_key`): only there does the key keep the work from running
    again.
    """
    qt = queue_table(model)
    target: Table = archive if isinstance(archive, Table) else archive.__table__
    shared = [col.name for col in qt.table.c if col.name in target.c]
    doomed = _finished_before(qt, older_than, statuses, FINISHED_STATUSES, limit, exclusive)
    moved: CTE = (
        delete(qt.table)
        .where(qt.pk.in_(doomed.scalar_subquery()))
        .returning(*(qt.table.c[name] for name in shared))
        .cte("moved")
    )
    return (
        insert(target)
        .from_select(shared, select(*(moved.c[name] for name in shared)), include_defaults=False)
        .returning(target.c[qt.pk.name])
    )
