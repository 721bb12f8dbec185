"""An operator's moves of a schedule's watermark (run now, pause, resume) against the
scheduler's own claims: each tick enqueued at most once, a paused schedule enqueuing
nothing on both runtimes, and the ticks of a pause skipped on resume."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, String, select, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqla_queue import JobMixin, Schedule, WorkerStartError, admin, schedules_table
from sqla_queue import sql as q
from sqla_queue.schedule_actions import pause, resume, run_now, schedule_views

from .helpers import table_of, wait_for
from .models import TASK_SCHEDULES, Task

TASKS = table_of(Task)
T0 = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


def minute(n: float) -> datetime:
    return T0 + timedelta(minutes=n)


def _jobs(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(TASKS).order_by(TASKS.c.run_after, TASKS.c.id)).all())


def _state(engine: Engine, name: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(q.schedule_states(Task).where(TASK_SCHEDULES.c.name == name)).one_or_none()


def _scheduler(engine: Engine, *schedules: Schedule) -> Any:
    from sqla_queue import Worker

    worker = Worker(engine, Task, lambda job: None, schedules=list(schedules))
    assert worker.scheduler is not None
    return worker.scheduler


REPORT = Schedule("report", every=60, values=lambda tick: {"task": "report", "payload": {"for": tick.isoformat()}},
                  backfill=5, queue="reports", priority=3)


def test_run_now_enqueues_one_job_and_the_ticks_up_to_it_count_as_run(engine: Engine) -> None:
    scheduler = _scheduler(engine, REPORT)
    try:
        scheduler.run_due(minute(0))  # first sight: the watermark at minute 0
        ran = run_now(engine, Task, REPORT, seen=minute(0), now=minute(2.5))
        assert ran.refused is None and ran.tick == minute(2.5)
        (job,) = _jobs(engine)
        assert job.id == ran.key and job.run_after == minute(2.5) and job.task == "report"
        assert job.payload == {"for": minute(2.5).isoformat()} and (job.queue, job.priority) == ("reports", 3)
        state = _state(engine, "report")
        assert (state.last_tick, state.previous_tick) == (minute(2.5), minute(0))
        # Minutes 1 and 2 were due and not enqueued (no worker ran): the run now stands for them.
        assert scheduler.run_due(minute(2.5)) == {}
        assert len(scheduler.run_due(minute(3))["report"]) == 1  # the next tick runs, backfilling nothing
    finally:
        scheduler.link.reset()
    assert [job.run_after for job in _jobs(engine)] == [minute(2.5), minute(3)]


def test_run_now_is_refused_once_a_tick_was_claimed_since_the_page(engine: Engine) -> None:
    """The form carries the watermark it showed: a scheduler's tick, or a first click's
    run, moved it since, and a second run would double it."""
    scheduler = _scheduler(engine, REPORT)
    try:
        assert run_now(engine, Task, REPORT, seen=None, now=minute(0.5)).key is not None  # no row yet: made
        assert run_now(engine, Task, REPORT, seen=None, now=minute(0.6)).refused == "ticked"  # the same click again
        assert len(scheduler.run_due(minute(1))["report"]) == 1  # the scheduler's tick
        assert run_now(engine, Task, REPORT, seen=minute(0.5), now=minute(1.2)).refused == "ticked"
        assert run_now(engine, Task, REPORT, seen=minute(1), now=minute(0.9)).refused == "ticked"  # never backwards
        assert run_now(engine, Task, REPORT, seen=minute(1), now=minute(1.2)).key is not None
    finally:
        scheduler.link.reset()
    assert [job.run_after for job in _jobs(engine)] == [minute(0.5), minute(1), minute(1.2)]


def test_run_now_and_a_scheduler_claim_of_the_same_moment_enqueue_once(engine: Engine) -> None:
    """A run now inside its transaction (its job's values being made) holds the
    watermark row; the scheduler's claim of the tick then due waits for it, and finds
    that tick claimed when it commits: one job, the run's, not two."""
    inside, release = threading.Event(), threading.Event()

    def values(tick: datetime) -> dict[str, Any]:
        inside.set()
        assert release.wait(10)
        return {"task": "report", "payload": {}}

    gated = Schedule("report", every=60, values=values)
    scheduler = _scheduler(engine, gated)
    try:
        scheduler.run_due(minute(0))
        ran: list[Any] = []
        clicked = threading.Thread(target=lambda: ran.append(run_now(engine, Task, gated, seen=minute(0),
                                                                     now=minute(1.5))))
        clicked.start()
        assert inside.wait(10)
        answer: list[Any] = []
        claim = threading.Thread(target=lambda: answer.append(scheduler.run_due(minute(1))))
        claim.start()
        wait_for(lambda: _waiting_on_a_lock(engine), what="the scheduler's claim to wait on the row")
        release.set()
        clicked.join(10)
        claim.join(10)
        assert answer == [{}]
        if scheduler.busy:  # the claim gave up waiting (a loaded machine): its retry comes after the commit
            assert scheduler.run_due(minute(1)) == {}
        assert scheduler.busy == set() and scheduler.handled["report"] == minute(1)
    finally:
        release.set()
        scheduler.link.reset()
    (run,) = ran
    assert [job.id for job in _jobs(engine)] == [run.key]


def test_run_now_gives_up_on_a_row_a_worker_holds(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(q.claim_schedule_tick(Task, schedule="report", tick=minute(0)))
    holder = engine.connect()
    try:
        holder.begin()
        holder.execute(select(TASK_SCHEDULES).where(TASK_SCHEDULES.c.name == "report").with_for_update())
        ran = run_now(engine, Task, REPORT, seen=minute(0), now=minute(1), lock_timeout=0.1)
        assert (ran.key, ran.refused) == (None, "busy")
    finally:
        holder.rollback()
        holder.close()
    assert _jobs(engine) == [] and _state(engine, "report").last_tick == minute(0)


def test_a_paused_schedule_enqueues_nothing_and_resume_skips_the_pause(engine: Engine) -> None:
    scheduler = _scheduler(engine, REPORT)  # backfill=5: a resume catching up would show
    try:
        scheduler.run_due(minute(0))
        assert pause(engine, Task, "report", now=minute(0.5)) is True
        assert pause(engine, Task, "report", now=minute(0.6)) is False  # paused already
        assert "(paused)" in admin.format_schedules(engine, Task, [REPORT])  # sqla-queue schedules
        paused_at = _state(engine, "report").paused_at
        assert paused_at is not None
        for n in (1, 2, 3):
            assert scheduler.run_due(minute(n)) == {}
        assert _state(engine, "report").last_tick == minute(0)  # a paused row is never claimed
        run = run_now(engine, Task, REPORT, seen=minute(0), now=minute(3.2))  # a run now still runs
        assert run.key is not None
        assert resume(engine, Task, "report", now=minute(3.5)) is True
        assert resume(engine, Task, "report", now=minute(3.6)) is False  # not paused
        state = _state(engine, "report")
        assert (state.paused_at, state.last_tick) == (None, minute(3.5))
        assert scheduler.run_due(minute(3.5)) == {}
        assert len(scheduler.run_due(minute(4))["report"]) == 1  # minutes 1 to 3 skipped, not backfilled
    finally:
        scheduler.link.reset()
    assert [job.run_after for job in _jobs(engine)] == [minute(3.2), minute(4)]


def test_a_schedule_paused_before_it_ever_ticked_starts_after_its_resume(engine: Engine) -> None:
    scheduler = _scheduler(engine, REPORT)
    try:
        assert pause(engine, Task, "report", now=minute(0.5))  # its row made, paused
        assert scheduler.run_due(minute(1)) == {}
        assert resume(engine, Task, "report", now=minute(1.5))
        assert len(scheduler.run_due(minute(2))["report"]) == 1
        # Resuming never moves the watermark back.
        assert pause(engine, Task, "report", now=minute(2.1))
        assert resume(engine, Task, "report", now=minute(1))
        assert _state(engine, "report").last_tick == minute(2)
    finally:
        scheduler.link.reset()
    assert [job.run_after for job in _jobs(engine)] == [minute(2)]


def test_workers_honour_a_pause_on_both_runtimes(engine: Engine, make_worker: Any) -> None:
    """A real worker (thread or asyncio) on a one-second schedule: paused, its scheduler
    passes ticks and enqueues none; resumed, the next tick is enqueued."""
    beat = Schedule("beat", every=1, values={"task": "beat", "payload": {}}, backfill=30)
    paused = datetime.now(UTC)
    assert pause(engine, Task, "beat", now=paused)
    worker = make_worker(engine, Task, lambda job: None, schedules=[beat], poll_interval=0.5, shutdown_grace=2)
    worker.start()
    try:
        wait_for(lambda: worker.scheduler.handled.get("beat", paused) >= paused + timedelta(seconds=2),
                 what="the scheduler to pass two ticks of the pause")
        assert _jobs(engine) == [] and worker.stats.scheduled == 0
        resumed = datetime.now(UTC)
        assert resume(engine, Task, "beat", now=resumed)
        wait_for(lambda: _jobs(engine), what="a tick enqueued after the resume")
    finally:
        worker.stop(grace=2)
    assert all(job.run_after > resumed for job in _jobs(engine))  # none of the pause's 30 backfillable ticks


def test_schedule_views_tell_the_code_from_rows_only(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(q.claim_schedule_tick(Task, schedule="gone", tick=minute(0)))
        conn.execute(q.claim_schedule_tick(Task, schedule="report", tick=minute(0)))
    pause(engine, Task, "gone", now=minute(1))
    views = {v.name: v for v in schedule_views(engine, Task, [REPORT, Schedule("fresh", every=3600)], now=minute(0.5))
             or ()}
    assert set(views) == {"fresh", "gone", "report"}
    report = views["report"]
    assert (report.in_code, report.last_tick, report.next_tick) == (True, minute(0), minute(1))
    assert (views["fresh"].in_code, views["fresh"].last_tick) == (True, None)
    assert (views["gone"].in_code, views["gone"].schedule, views["gone"].next_tick) == (False, None, None)
    assert views["gone"].paused_at is not None
    unknown = schedule_views(engine, Task, None) or []
    assert [(v.name, v.in_code) for v in unknown] == [("gone", None), ("report", None)]
    with pytest.raises(ValueError, match="name"):
        pause(engine, Task, "")


class _Other(DeclarativeBase):
    pass


class OldScheduledJob(_Other, JobMixin):
    __tablename__ = "old_scheduled_jobs"
    note: Mapped[str | None] = mapped_column(String(20))


def test_a_worker_refuses_a_watermark_table_made_before_pauses(engine: Engine, make_worker: Any) -> None:
    """A watermark table from before ``paused_at``: the worker says to migrate, at start."""
    _Other.metadata.create_all(engine, tables=[table_of(OldScheduledJob), schedules_table(OldScheduledJob)])
    try:
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE old_scheduled_jobs_schedules DROP COLUMN paused_at"))
        worker = make_worker(engine, OldScheduledJob, lambda job: None,
                             schedules=[Schedule("s", every=1, values={"note": "x"})])
        with pytest.raises(WorkerStartError, match="has no column paused_at: migrate"):
            worker.start()
    finally:
        _Other.metadata.drop_all(engine)


def _waiting_on_a_lock(engine: Engine) -> bool:
    with engine.connect() as conn:
        return bool(conn.scalar(text(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
        )))
