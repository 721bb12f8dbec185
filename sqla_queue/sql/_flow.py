"""Flow control: pausing a queue, and the condition every claim adds for it (the claim
under the limits and sequences of ``__queue_flow__`` is in ``_limits``).

A paused queue is a row of the queue table's :func:`~sqla_queue.queues_table` with
``paused_at`` set; a queue with limits of its own, a row with ``concurrency`` or
``rate`` set. The claims read that table in the statement that claims (never a worker's
memory of it), so a change holds for every claim that starts after the transaction that
made it commits.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    Select,
    exists,
    literal,
    select,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql.dml import ReturningInsert, ReturningUpdate
from sqlalchemy.sql.elements import ColumnElement

from ..flow import declared_queues_table, required_queues_table
from ..model import QueueTable, check_queue, flow_rules, queue_table
from ..rules import check_queue_limits
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


def set_queue_limits(
    model: QueueModel, queue: str, *, concurrency: int | None = None, rate: int | None = None
) -> ReturningInsert[Any]:
    """Set ``queue``'s own limits: ``INSERT … ON CONFLICT (queue) DO UPDATE SET
    concurrency = :concurrency, rate = :rate RETURNING queue``. ``concurrency`` replaces,
    for this queue, the limit of the model's ``Concurrency(…, key="queue")``; ``rate``,
    that of its ``RateLimit(…, key="queue")`` (the period stays the model's); None puts
    the model's limit back. Refused (``ValueError``) for a limit no declared rule has.
    Run it in any transaction: every claim that starts after its commit counts against
    it; running jobs are left to finish."""
    check_queue(queue)
    table = required_queues_table(model)
    qt = queue_table(model)
    check_queue_limits(_owner(qt), flow_rules(qt.table), concurrency, rate)
    stmt = pg_insert(table).values(queue=queue, concurrency=concurrency, rate=rate, updated_at=_clock())
    return stmt.on_conflict_do_update(
        index_elements=[table.c.queue],
        set_={"concurrency": stmt.excluded.concurrency, "rate": stmt.excluded.rate,
              "updated_at": stmt.excluded.updated_at},
    ).returning(table.c.queue)


def queue_limits(model: QueueModel) -> Select[Any]:
    """``(queue, concurrency, rate)`` of every queue with a limit of its own set at run
    time (:func:`set_queue_limits`), by name."""
    table = required_queues_table(model)
    return (
        select(table.c.queue, table.c.concurrency, table.c.rate)
        .where((table.c.concurrency.is_not(None)) | (table.c.rate.is_not(None)))
        .order_by(table.c.queue)
    )


def _owner(qt: QueueTable) -> str:
    """The model's name in an error (the table's, for a bare Table)."""
    return qt.mapped_class.__name__ if qt.mapped_class is not None else qt.table.name
