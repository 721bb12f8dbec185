"""Bulk actions by filter: every job a filter matches requeued, cancelled or deleted
(the dashboard's jobs page), counted first, then walked in bounded batches.

Each batch is one statement in a transaction of its own (:func:`~sqla_queue.sql.requeue_batch`,
:func:`~sqla_queue.sql.cancel_batch`, :func:`~sqla_queue.sql.delete_batch`), so a large
selection never holds its locks for long and a worker's claims and heartbeats go on
between batches. The walk goes down the keys from where the last batch ended, over the
jobs created up to the moment of the count: jobs enqueued since are left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, get_args

from sqlalchemy import Engine

from . import sql as q
from .admin import JobFilters
from .cancel import tell_cancelled

__all__ = ["ACTIONS", "BulkCount", "BulkResult", "count_matching", "run_bulk"]

#: The bulk actions.
ACTIONS: Final[tuple[str, ...]] = get_args(q.BulkAction)


@dataclass(frozen=True)
class BulkCount:
    """What an action by filter would take, read in one statement."""

    #: The jobs the filter matches.
    matched: int
    #: How many of them the action takes (requeue: dead letters; cancel: pending and
    #: running; delete: all but running, and not those holding a unique key).
    acting: int
    #: Delete only: how many more it takes when told to free their unique keys.
    holding_keys: int
    #: The database's clock at the count: the walk takes no job created after it.
    as_of: datetime


@dataclass(frozen=True)
class BulkResult:
    """What a walk did."""

    #: The jobs the action moved (or deleted).
    done: int
    #: The statements it ran.
    batches: int


def count_matching(
    engine: Engine, model: Any, action: str, filters: JobFilters, *, created_before: datetime | None = None
) -> BulkCount:
    """Count what ``action`` would take of the jobs ``filters`` match (their ids are not
    a filter here: an action by filter takes every page); ``created_before``: of those
    a walk bounded by it takes."""
    _check(action)
    stmt = q.bulk_count(model, action, **_kwargs(filters), created_before=created_before)  # type: ignore[arg-type]
    with engine.connect() as conn:
        row = conn.execute(stmt).one()
    return BulkCount(int(row.matched), int(row.acting), int(row.holding_keys), row.now)


def run_bulk(
    engine: Engine,
    model: Any,
    action: str,
    filters: JobFilters,
    *,
    created_before: datetime,
    free_keys: bool = False,
    batch: int = q.BULK_BATCH,
    on_batch: Callable[[int], None] | None = None,
) -> BulkResult:
    """Run ``action`` on every job ``filters`` match that was created at
    ``created_before`` or earlier, newest first, ``batch`` rows per statement, each in a
    transaction of its own, until the walk is at its end. A cancel tells the running jobs'
    workers, as :func:`sqla_queue.cancel` does; a delete keeps the jobs that still hold
    their unique key unless ``free_keys``. ``on_batch`` is told each batch's count."""
    _check(action)
    kwargs: dict[str, Any] = {**_kwargs(filters), "created_before": created_before, "limit": batch}
    if action == "delete":
        kwargs["free_keys"] = free_keys
    builders: dict[str, Callable[..., Any]] = {
        "requeue": q.requeue_batch, "cancel": q.cancel_batch, "delete": q.delete_batch
    }
    builder = builders[action]
    before: Any = None
    done = batches = 0
    while True:
        with engine.begin() as conn:
            rows = conn.execute(builder(model, **kwargs, before=before), q.wake_values(model, conn)).all()
            if action == "cancel":
                tell_cancelled(conn, model, rows)
        batches += 1
        done += len(rows)
        if on_batch is not None:
            on_batch(len(rows))
        # A cancel or a delete takes every row it picks: a short batch is the last. A
        # requeue may pick a dead letter whose key a newer one takes: its last moves none.
        if not rows or (action != "requeue" and len(rows) < batch):
            return BulkResult(done, batches)
        before = min(row[0] for row in rows)


def _kwargs(filters: JobFilters) -> dict[str, Any]:
    kwargs = filters.builder_kwargs()
    del kwargs["ids"]
    return kwargs


def _check(action: str) -> None:
    if action not in ACTIONS:
        raise ValueError(f"unknown bulk action {action!r} (one of {', '.join(ACTIONS)})")
