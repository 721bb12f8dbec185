"""Flow control: pausing a queue, and the condition every claim adds for it.

A paused queue is a row of the queue table's :func:`~sqla_queue.queues_table` with
``paused_at`` set. The claims read that table in the statement that claims (never a
worker's memory of it), so a pause holds for every claim that starts after the
transaction that paused commits.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Select, exists, literal, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql.dml import ReturningInsert, ReturningUpdate
from sqlalchemy.sql.elements import ColumnElement

from ..flow import declared_queues_table, required_queues_table
from ..model import QueueTable, check_queue
from ._base import QueueModel, _clock


def unpaused(
    qt: QueueTable, names: list[str] | None = None, *, served: ColumnElement[Any] | None = None
) -> list[ColumnElement[bool]]:
    """The claim's condition that its jobs' queue is not paused; nothing when the queue
    table has no queues table declared (a claim as before).

    Where the queue is known before the scan (one queue, ``names``; or each queue of a
    multi-queue claim, ``served``), the condition does not refer to the job row: the
    planner tests it once, and a paused queue's backlog is not read at all. A claim of
    every queue tests each candidate's queue (one primary-key probe of a small table),
    and reads past a paused queue's due jobs that sort first."""
    table = declared_queues_table(qt.table)
    if table is None:
        return []
    if served is not None:
        queue: ColumnElement[Any] = served
    elif names is not None and len(names) == 1:
        queue = literal(names[0], table.c.queue.type)
    else:
        queue = qt.c.queue
    # Correlated explicitly: a lateral's ``served`` is not in the enclosing SELECT's FROM
    # list, and auto-correlation would scan it again inside, as a condition on every queue.
    paused = (
        select(table.c.queue)
        .where(table.c.queue == queue, table.c.paused_at.is_not(None))
        .correlate_except(table)
    )
    return [~exists(paused)]


def pause_queue(model: QueueModel, queue: str) -> ReturningInsert[Any]:
    """Pause ``queue``: ``INSERT … ON CONFLICT (queue) DO UPDATE SET paused_at = now()
    WHERE paused_at IS NULL RETURNING queue``; a row when this call paused it, none when
    it was paused already. Run it in any transaction: it holds from that commit."""
    check_queue(queue)
    table = required_queues_table(model)
    stmt = pg_insert(table).values(queue=queue, paused_at=_clock(), updated_at=_clock())
    return stmt.on_conflict_do_update(
        index_elements=[table.c.queue],
        set_={"paused_at": stmt.excluded.paused_at, "updated_at": stmt.excluded.updated_at},
        where=table.c.paused_at.is_(None),
    ).returning(table.c.queue)


def resume_queue(model: QueueModel, queue: str) -> ReturningUpdate[Any]:
    """Resume ``queue``: ``UPDATE … SET paused_at = NULL WHERE queue = :queue AND
    paused_at IS NOT NULL RETURNING queue``; a row when this call resumed it."""
    check_queue(queue)
    table = required_queues_table(model)
    return (
        table.update()
        .where(table.c.queue == queue, table.c.paused_at.is_not(None))
        .values(paused_at=None, updated_at=_clock())
        .returning(table.c.queue)
    )


def paused_queues(model: QueueModel) -> Select[Any]:
    """``(queue, paused_at)`` of every paused queue of the queue table, by name."""
    table = required_queues_table(model)
    return (
        select(table.c.queue, table.c.paused_at)
        .where(table.c.paused_at.is_not(None))
        .order_by(table.c.queue)
    )

