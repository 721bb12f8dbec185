"""Periodic jobs: the watermark row of each schedule, moved forward to claim a tick.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import DateTime, Select, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql.dml import ReturningInsert

from ..periodic import schedules_table
from ._base import SCHEDULE_PARAM, TICK_PARAM, QueueModel, _clock, _param, _values


def schedule_tick_template(model: QueueModel) -> ReturningInsert[Any]:
    """Claim a schedule's tick: ``{SCHEDULE_PARAM: name, TICK_PARAM: tick}``.

    ``INSERT INTO <table>_schedules (name, last_tick) VALUES (:name, :tick) ON CONFLICT
    (name) DO UPDATE SET last_tick = :tick, previous_tick = <the old last_tick> WHERE
    last_tick < :tick RETURNING previous_tick``: one row when this call moved the
    watermark forward (``previous_tick`` is where it stood, NULL for a schedule seen for
    the first time), none when the tick was claimed already. Run it in the transaction
    that inserts the tick's jobs: a concurrent claim of the same tick waits for that
    transaction's row lock, then matches nothing if it committed (and claims the tick
    itself if it rolled back), so a tick is claimed if and only if its jobs exist.
    The graphile-worker design: no leader, one small row per schedule.
    """
    table = schedules_table(model)
    tick = _param(TICK_PARAM, DateTime(timezone=True))
    stmt = pg_insert(table).values(name=_param(SCHEDULE_PARAM, table.c.name.type), last_tick=tick)
    return stmt.on_conflict_do_update(
        index_elements=[table.c.name],
        set_={
            "last_tick": stmt.excluded.last_tick,
            "previous_tick": table.c.last_tick,
            "updated_at": _clock(),
        },
        where=table.c.last_tick < stmt.excluded.last_tick,
    ).returning(table.c.previous_tick)


def claim_schedule_tick(model: QueueModel, *, schedule: str, tick: datetime) -> ReturningInsert[Any]:
    """:func:`schedule_tick_template` with the schedule's name and the tick (an aware
    datetime) bound: returns ``previous_tick`` if this call claimed the tick, no row if
    it was claimed already."""
    if not isinstance(tick, datetime) or tick.tzinfo is None or tick.utcoffset() is None:
        raise ValueError(f"tick must be a timezone-aware datetime, got {tick!r}")
    with _values({SCHEDULE_PARAM: schedule, TICK_PARAM: tick}):
        return schedule_tick_template(model)


def schedule_states(model: QueueModel) -> Select[Any]:
    """``(name, last_tick, previous_tick, updated_at)`` of every schedule row of the
    queue table, by name: what ``sqla-queue schedules`` shows. A row whose schedule was
    removed from the code stays, harmless (nothing reads it but this)."""
    table = schedules_table(model)
    c = table.c
    return select(c.name, c.last_tick, c.previous_tick, c.updated_at).order_by(c.name)
