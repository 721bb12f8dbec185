"""What an operator sees of a table's periodic schedules and does to them: each one's
state, a *run now*, a pause and a resume (the dashboard's schedules page).

Every change is a move of the schedule's watermark row (:func:`~sqla_queue.schedules_table`),
the row the workers' scheduler claims each tick on (:mod:`sqla_queue.worker.scheduler`),
so an operator's move and a worker's claim serialise on that row's lock:

- **run now** enqueues one job, for the moment of the click, and moves the watermark to
  that moment in the same transaction (:func:`~sqla_queue.sql.claim_schedule_run`, the
  tick claim fenced also by the watermark the operator saw). Every tick up to that moment
  counts as claimed: a tick due but not enqueued yet (a scheduler a moment late, or none
  running) is not enqueued after it, nor backfilled; the next tick after it runs as
  usual. If a tick was claimed since the page was read, nothing is enqueued: a run now
  never doubles the scheduler's tick, nor a second click the first.
- **pause** sets ``paused_at``: the workers' claims match nothing while it is set
  (:func:`~sqla_queue.sql.schedule_tick_template`), so no tick is enqueued; a run now
  still runs.
- **resume** clears it and moves the watermark to the moment of the resume (if it stood
  before): the ticks of the pause are skipped, not caught up; the next one runs.

Moments are this process's clock (as a worker's ticks are the worker's): keep the clocks
of the dashboard's and the workers' machines in time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, func, select
from sqlalchemy.exc import DBAPIError

from . import sql as q
from .admin import schedule_rows
from .enqueue.values import enqueue_values
from .ops import ScheduleOps
from .periodic import MAX_NAME_LENGTH, Schedule

__all__ = ["RUN_NOW_LOCK_TIMEOUT", "RunNow", "ScheduleView", "pause", "resume", "run_now", "schedule_views"]

#: How long a run now waits for the watermark row a worker holds while it claims a tick
#: (its transaction is bounded too: see the scheduler's ``TICK_IDLE_TIMEOUT``).
RUN_NOW_LOCK_TIMEOUT = 5.0


@dataclass(frozen=True)
class ScheduleView:
    """One schedule as the schedules page shows it: declared in the code, a watermark row
    in the table, or both."""

    name: str
    #: The code's schedule; None when the code has none of that name (or is unknown).
    schedule: Schedule | None
    #: Whether the code declares it: None when the code's schedules are not known (the
    #: dashboard was given models, not workers).
    in_code: bool | None
    last_tick: datetime | None
    previous_tick: datetime | None
    paused_at: datetime | None
    #: The next tick the workers will enqueue; None when paused or not in the code.
    next_tick: datetime | None


def schedule_views(
    engine: Engine, model: Any, schedules: Sequence[Schedule] | None, *, now: datetime | None = None
) -> list[ScheduleView] | None:
    """Every schedule of ``model``'s table, by name: those of the code (``schedules``;
    None when unknown) and those only a watermark row names. None when the watermark
    table does not exist in the database."""
    rows = schedule_rows(engine, model)
    if rows is None:
        return None
    now = now or datetime.now(UTC)
    code = {s.name: s for s in schedules or ()}
    views = []
    for name in sorted({*code, *rows}):
        schedule, row = code.get(name), rows.get(name)
        paused = row.paused_at if row is not None else None
        views.append(ScheduleView(
            name=name,
            schedule=schedule,
            in_code=(schedule is not None) if schedules is not None else None,
            last_tick=row.last_tick if row is not None else None,
            previous_tick=row.previous_tick if row is not None else None,
            paused_at=paused,
            next_tick=schedule.next_tick(now) if schedule is not None and paused is None else None,
        ))
    return views


@dataclass(frozen=True)
class RunNow:
    """What a run now did: the key of the job it enqueued, or why it enqueued none."""

    #: The job enqueued, None when none was.
    key: Any
    #: The moment claimed, the job's ``run_after``.
    tick: datetime
    #: Why nothing was enqueued: ``"ticked"`` (the watermark moved since it was read),
    #: ``"busy"`` (a worker held the row longer than :data:`RUN_NOW_LOCK_TIMEOUT`).
    refused: str | None = None


def run_now(
    engine: Engine,
    model: Any,
    schedule: Schedule,
    *,
    seen: datetime | None,
    now: datetime | None = None,
    lock_timeout: float = RUN_NOW_LOCK_TIMEOUT,
) -> RunNow:
    """Enqueue one job of ``schedule`` now, as a tick of the moment ``now`` claimed on
    the watermark in the job's transaction, if the watermark still stands at ``seen``
    (the ``last_tick`` the operator was shown; None: no row yet). The job is the one a
    tick would enqueue: ``schedule``'s values for that moment, its options, ``run_after``
    the moment. A worker holding the row longer than ``lock_timeout`` seconds makes it
    give up (``refused="busy"``)."""
    tick = (now or datetime.now(UTC)).astimezone(UTC)
    ops = ScheduleOps(model, enqueue_values)
    bound = select(func.set_config("lock_timeout", f"{max(1, round(lock_timeout * 1000))}ms", True))
    try:
        with engine.begin() as conn:
            conn.execute(bound)  # for this transaction only (SET LOCAL)
            claimed = conn.execute(q.claim_schedule_run(model, schedule=schedule.name, tick=tick, seen=seen)).first()
            if claimed is None:
                return RunNow(None, tick, "ticked")
            return RunNow(ops.enqueue_tick(conn, schedule, tick), tick)
    except DBAPIError as exc:
        if getattr(exc.orig, "sqlstate", None) == "55P03":  # lock_not_available
            return RunNow(None, tick, "busy")
        raise


def pause(engine: Engine, model: Any, name: str, *, now: datetime | None = None) -> bool:
    """Pause schedule ``name``: no worker enqueues its ticks until :func:`resume`.
    True when this call paused it (False: it was paused already)."""
    _check_name(name)
    tick = (now or datetime.now(UTC)).astimezone(UTC)
    with engine.begin() as conn:
        return conn.execute(q.pause_schedule(model, schedule=name, tick=tick)).first() is not None


def resume(engine: Engine, model: Any, name: str, *, now: datetime | None = None) -> bool:
    """Resume schedule ``name``, its watermark moved to ``now`` if it stood before: the
    ticks of the pause are skipped. True when this call resumed it (False: not paused)."""
    _check_name(name)
    tick = (now or datetime.now(UTC)).astimezone(UTC)
    with engine.begin() as conn:
        return conn.execute(q.resume_schedule(model, schedule=name, tick=tick)).first() is not None


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LENGTH or "\x00" in name:
        raise ValueError(f"a schedule's name has 1 to {MAX_NAME_LENGTH} characters, got {name!r}")

