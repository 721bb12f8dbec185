"""Periodic jobs: the watermark row of each schedule, moved forward to claim a tick, and
the operator's own moves of it: a run now, a pause, a resume.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import DateTime, Select, and_, bindparam, false, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql.dml import ReturningInsert, ReturningUpdate
from sqlalchemy.sql.elements import ColumnElement

from ..periodic import schedules_table
from ._base import SCHEDULE_PARAM, TICK_PARAM, QueueModel, _clock, _param, _values


def _tick_claim(model: QueueModel, fence: ColumnElement[bool] | None = None) -> ReturningInsert[Any]:
    """The claim of a tick: the watermark inserted, or moved forward to ``:tick`` where
    it stands before it (and ``fence`` holds); returns ``previous_tick``."""
    table = schedules_table(model)
    tick = _param(TICK_PARAM, DateTime(timezone=True))
    stmt = pg_insert(table).values(name=_param(SCHEDULE_PARAM, table.c.name.type), last_tick=tick)
    forward: ColumnElement[bool] = table.c.last_tick < stmt.excluded.last_tick
    return stmt.on_conflict_do_update(
        index_elements=[table.c.name],
        set_={
            "last_tick": stmt.excluded.last_tick,
            "previous_tick": table.c.last_tick,
            "updated_at": _clock(),
        },
        where=forward if fence is None else and_(forward, fence),
    ).returning(table.c.previous_tick)


def schedule_tick_template(model: QueueModel) -> ReturningInsert[Any]:
    """Claim a schedule's tick: ``{SCHEDULE_PARAM: name, TICK_PARAM: tick}``.

    ``INSERT INTO <table>_schedules (name, last_tick) VALUES (:name, :tick) ON CONFLICT
    (name) DO UPDATE SET last_tick = :tick, previous_tick = <the old last_tick> WHERE
    last_tick < :tick AND paused_at IS NULL RETURNING previous_tick``: one row when this
    call moved the watermark forward (``previous_tick`` is where it stood, NULL for a
    schedule seen for the first time), none when the tick was claimed already, or the
    schedule is paused (:func:`pause_schedule`). Run it in the transaction
    that inserts the tick's jobs: a concurrent claim of the same tick waits for that
    transaction's row lock, then matches nothing if it committed (and claims the tick
    itself if it rolled back), so a tick is claimed if and only if its jobs exist.
    The graphile-worker design: no leader, one small row per schedule.
    """
    return _tick_claim(model, schedules_table(model).c.paused_at.is_(None))


def claim_schedule_tick(model: QueueModel, *, schedule: str, tick: datetime) -> ReturningInsert[Any]:
    """:func:`schedule_tick_template` with the schedule's name and the tick (an aware
    datetime) bound: returns ``previous_tick`` if this call claimed the tick, no row if
    it was claimed already (or the schedule is paused)."""
    _aware(tick, "tick")
    with _values({SCHEDULE_PARAM: schedule, TICK_PARAM: tick}):
        return schedule_tick_template(model)


def claim_schedule_run(
    model: QueueModel, *, schedule: str, tick: datetime, seen: datetime | None
) -> ReturningInsert[Any]:
    """Claim ``tick`` (the moment of an operator's *run now*) as a tick of its own, the
    way :func:`schedule_tick_template` claims one, fenced also by the watermark the
    operator saw: it moves only if it still stands at ``seen`` (None: the schedule had
    no row yet) and before ``tick``. Returns ``previous_tick`` when it moved, no row
    when a tick was claimed since (by a worker, or by another run now).

    Run it in the transaction that inserts the run's job: a worker's claim of the same
    row waits for it, and then finds every tick up to ``tick`` claimed. A paused
    schedule runs too: the pause stops the workers' ticks, not the operator.
    """
    _aware(tick, "tick")
    if seen is not None:
        _aware(seen, "seen")
    table = schedules_table(model)
    fence = (
        table.c.last_tick == bindparam("sqla_queue_seen", seen, type_=DateTime(timezone=True))
        if seen is not None else false()
    )
    with _values({SCHEDULE_PARAM: schedule, TICK_PARAM: tick}):
        return _tick_claim(model, fence)


def pause_schedule(model: QueueModel, *, schedule: str, tick: datetime) -> ReturningInsert[Any]:
    """Pause a schedule: its row gets ``paused_at`` (inserted, its watermark at ``tick``,
    when the schedule had none), so no worker's claim matches it until
    :func:`resume_schedule`. Returns ``paused_at`` when this call paused it, no row when
    it was paused already."""
    _aware(tick, "tick")
    table = schedules_table(model)
    name = bindparam("sqla_queue_schedule", schedule, type_=table.c.name.type)
    stmt = pg_insert(table).values(
        name=name, last_tick=bindparam("sqla_queue_tick", tick, type_=DateTime(timezone=True)), paused_at=_clock()
    )
    return stmt.on_conflict_do_update(
        index_elements=[table.c.name],
        set_={"paused_at": _clock(), "updated_at": _clock()},
        where=table.c.paused_at.is_(None),
    ).returning(table.c.paused_at)


def resume_schedule(model: QueueModel, *, schedule: str, tick: datetime) -> ReturningUpdate[Any]:
    """Resume a paused schedule, its watermark moved to ``tick`` (the moment of the
    resume) if it stands before: the ticks that fell during the pause are skipped, not
    caught up (nor backfilled); the first tick after ``tick`` runs. Returns the new
    ``last_tick`` when this call resumed it, no row when it was not paused."""
    _aware(tick, "tick")
    table = schedules_table(model)
    c = table.c
    moment = bindparam("sqla_queue_tick", tick, type_=DateTime(timezone=True))
    return (
        update(table)
        .where(c.name == bindparam("sqla_queue_schedule", schedule, type_=c.name.type), c.paused_at.is_not(None))
        .values(paused_at=None, last_tick=func.greatest(c.last_tick, moment), updated_at=_clock())
        .returning(c.last_tick)
    )


def schedule_states(model: QueueModel) -> Select[Any]:
    """``(name, last_tick, previous_tick, updated_at, paused_at)`` of every schedule row
    of the queue table, by name: what ``sqla-queue schedules`` and the dashboard show. A
    row whose schedule was removed from the code stays, harmless (nothing reads it but
    these)."""
    table = schedules_table(model)
    c = table.c
    return select(c.name, c.last_tick, c.previous_tick, c.updated_at, c.paused_at).order_by(c.name)


def _aware(moment: Any, name: str) -> None:
    if not isinstance(moment, datetime) or moment.tzinfo is None or moment.utcoffset() is None:
        raise ValueError(f"{name} must be a timezone-aware datetime, got {moment!r}")
