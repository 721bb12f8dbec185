"""Periodic jobs: schedules, the watermark claim, and every tick enqueued exactly once."""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import psutil
import pytest
from sqlalchemy import Engine, String, create_engine, func, select, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqla_queue import JobMixin, Schedule, Tasks, Worker, WorkerStartError, schedules_table
from sqla_queue import sql as q
from sqla_queue.periodic import MAX_BACKFILL
from sqla_queue.worker.scheduler import BUSY_RETRY, CLAIM_DEADLINE, TICK_IDLE_TIMEOUT, TICK_LOCK_TIMEOUT

from .helpers import ConnectLag, table_of, wait_for
from .models import REPORT_SCHEDULES, TASK_SCHEDULES, ReportJob, Task
from .workers import FAST

TASKS = table_of(Task)
REPORTS = table_of(ReportJob)
UTC = UTC
PARIS = ZoneInfo("Europe/Paris")
T0 = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


def minute(n: int) -> datetime:
    return T0 + timedelta(minutes=n)


# -- schedules (pure) -----------------------------------------------------------------------


def test_cron_ticks_in_a_timezone_follow_cronsim_on_dst_days() -> None:
    nightly = Schedule("nightly", "30 2 * * *", timezone="Europe/Paris")
    # 02:30 does not exist on 2026-03-29 in Paris: the tick is the first moment after the gap.
    spring = nightly.next_tick(datetime(2026, 3, 28, 12, 0, tzinfo=PARIS))
    assert spring.astimezone(PARIS) == datetime(2026, 3, 29, 3, 0, tzinfo=PARIS)
    assert spring.tzinfo is UTC
    # 02:30 occurs twice on 2026-10-25: one tick, the first.
    autumn = nightly.next_tick(datetime(2026, 10, 24, 12, 0, tzinfo=UTC))
    assert autumn == datetime(2026, 10, 25, 0, 30, tzinfo=UTC)
    assert nightly.next_tick(autumn) == datetime(2026, 10, 26, 1, 30, tzinfo=UTC)
    # A wildcard hour ticks in every real hour, the repeated one included.
    hourly = Schedule("hourly", "0 * * * *", timezone="Europe/Paris")
    ticks, moment = [], datetime(2026, 10, 24, 23, 30, tzinfo=UTC)
    for _ in range(3):
        moment = hourly.next_tick(moment)
        ticks.append(moment)
    assert ticks == [datetime(2026, 10, 25, h, 0, tzinfo=UTC) for h in (0, 1, 2)]


def test_latest_tick_includes_now_and_every_counts_from_the_epoch() -> None:
    five = Schedule("five", "*/5 * * * *")
    assert five.latest_tick(minute(5)) == minute(5)
    assert five.latest_tick(minute(5) - timedelta(microseconds=1)) == minute(0)
    assert five.next_tick(minute(5)) == minute(10)
    hourly = Schedule("hourly", every=timedelta(hours=1))
    assert hourly.latest_tick(T0 + timedelta(minutes=59)) == T0
    assert hourly.next_tick(T0) == T0 + timedelta(hours=1)
    assert Schedule("s", every=7).latest_tick(datetime(1970, 1, 1, 0, 0, 20, tzinfo=UTC)) == datetime(
        1970, 1, 1, 0, 0, 14, tzinfo=UTC
    )


def test_missed_ticks_are_the_latest_and_at_most_backfill_more() -> None:
    every_minute = Schedule("m", every=60)
    assert every_minute.missed(minute(0), minute(10)) == [minute(10)]
    assert Schedule("m", every=60, backfill=3).missed(minute(0), minute(10)) == [minute(n) for n in (7, 8, 9, 10)]
    assert Schedule("m", every=60, backfill=50).missed(minute(0), minute(3)) == [minute(n) for n in (1, 2, 3)]
    cron = Schedule("c", "*/5 * * * *", backfill=5)
    assert cron.missed(minute(0), minute(15)) == [minute(5), minute(10), minute(15)]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"name": ""}, ValueError),
        ({"name": "x" * 201}, ValueError),
        ({"cron": None}, ValueError),
        ({"every": 60}, ValueError),  # both
        ({"cron": "not a cron"}, ValueError),
        ({"cron": "61 * * * *"}, ValueError),
        ({"timezone": "Mars/Olympus"}, ValueError),
        ({"backfill": -1}, ValueError),
        ({"backfill": MAX_BACKFILL + 1}, ValueError),
        ({"backfill": True}, ValueError),
        ({"values": 42}, TypeError),
        ({"priority": 2**40}, ValueError),
        ({"queue": ""}, ValueError),
        ({"max_attempts": 0}, ValueError),
    ],
)
def test_bad_schedules_raise_when_declared(kwargs: dict[str, Any], error: type[Exception]) -> None:
    given: dict[str, Any] = {"name": "s", "cron": "* * * * *", **kwargs}
    with pytest.raises(error):
        Schedule(**given)


@pytest.mark.parametrize("every", [0, 0.5, 1.5, float("inf"), timedelta(milliseconds=10)])
def test_every_must_be_whole_seconds(every: Any) -> None:
    with pytest.raises(ValueError, match="every"):
        Schedule("s", every=every)


def test_tasks_periodic_registers_the_task_and_its_schedule() -> None:
    tasks = Tasks()

    @tasks.periodic(every=3600, name="digest-hourly")  # a second schedule of the same task
    @tasks.periodic("*/5 * * * *", timezone="Europe/Paris", payload={"kind": "digest"}, queue="mail")
    def digest(job: Any) -> None: ...

    assert "digest" in tasks
    by_name = {s.name: s for s in tasks.schedules}
    assert set(by_name) == {"digest", "digest-hourly"}
    assert by_name["digest"].row(T0) == {"task": "digest", "payload": {"kind": "digest"}}
    assert by_name["digest"].options.queue == "mail"
    assert by_name["digest"].timezone == "Europe/Paris"
    with pytest.raises(ValueError, match="already registered"):
        tasks.periodic("* * * * *")(digest)  # a second schedule named "digest"
    with pytest.raises(ValueError, match="another function"):
        tasks.periodic("* * * * *", name="other", task="digest")(lambda job: None)


def test_worker_refuses_two_schedules_of_one_name(engine: Engine) -> None:
    tasks = Tasks()
    tasks.periodic("* * * * *", name="same")(lambda job: None)
    with pytest.raises(ValueError, match="two schedules"):
        Worker(engine, Task, tasks, schedules=[Schedule("same", every=5)])
    with pytest.raises(TypeError):
        Worker(engine, Task, tasks, schedules=["* * * * *"])


# -- the watermark builder ------------------------------------------------------------------


def test_claim_schedule_tick_moves_the_watermark_forward_only(engine: Engine) -> None:
    def claim(tick: datetime) -> list[Any]:
        with engine.begin() as conn:
            return list(conn.execute(q.claim_schedule_tick(Task, schedule="s", tick=tick)).all())

    assert claim(minute(1)) == [(None,)]  # first sight: claimed, no previous tick
    assert claim(minute(1)) == []  # claimed already
    assert claim(minute(0)) == []  # an older tick never moves it back
    assert claim(minute(3)) == [(minute(1),)]
    with engine.connect() as conn:
        states = conn.execute(q.schedule_states(Task)).all()
    assert [(r.name, r.last_tick, r.previous_tick) for r in states] == [("s", minute(3), minute(1))]
    with pytest.raises(ValueError, match="timezone-aware"):
        q.claim_schedule_tick(Task, schedule="s", tick=datetime(2026, 1, 1))


def test_a_concurrent_claim_waits_for_the_first_and_then_matches_nothing(engine: Engine) -> None:
    """The second claimer blocks on the row until the first commits (nothing claimed
    then), or until it rolls back (then it claims the tick itself)."""
    with engine.begin() as conn:
        conn.execute(q.claim_schedule_tick(Task, schedule="s", tick=minute(0)))
    for outcome in ("commit", "rollback"):
        tick = minute(1 if outcome == "commit" else 2)
        first = engine.connect()
        first.begin()
        assert first.execute(q.claim_schedule_tick(Task, schedule="s", tick=tick)).all()
        answer: list[Any] = []
        second = threading.Thread(target=lambda: answer.append(_claim_in_own_transaction(engine, tick)))  # noqa: B023
        second.start()
        wait_for(lambda: _waiting_on_a_lock(engine), what="the second claim to wait on the row lock")
        assert not answer
        first.commit() if outcome == "commit" else first.rollback()
        first.close()
        second.join(10)
        assert answer == ([[]] if outcome == "commit" else [[(minute(1),)]])


def _claim_in_own_transaction(engine: Engine, tick: datetime) -> list[Any]:
    with engine.begin() as conn:
        return list(conn.execute(q.claim_schedule_tick(Task, schedule="s", tick=tick)).all())


def _waiting_on_a_lock(engine: Engine) -> bool:
    with engine.connect() as conn:
        return bool(
            conn.scalar(
                text(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE wait_event_type = 'Lock' AND datname = current_database()"
                )
            )
        )


def test_schedules_table_is_one_per_queue_table_in_its_metadata() -> None:
    assert schedules_table(Task) is TASK_SCHEDULES
    assert TASK_SCHEDULES.name == "tasks_schedules"
    assert TASK_SCHEDULES.metadata is TASKS.metadata
    assert REPORT_SCHEDULES.name == "report_jobs_schedules"
    assert [c.name for c in TASK_SCHEDULES.primary_key.columns] == ["name"]


# -- the scheduler, on an injected clock -------------------------------------------------------


def _jobs(engine: Engine, table: Any = TASKS) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(table).order_by(table.c.run_after, table.c.id)).all())


def _schedulers(engine: Engine, n: int, schedules: list[Schedule], model: Any = Task) -> list[Worker]:
    return [Worker(engine, model, lambda job: None, schedules=schedules) for _ in range(n)]


def _run_together(workers: list[Worker], now: datetime) -> list[dict[str, list[Any]]]:
    """Every worker's scheduler claims the ticks due at ``now`` at the same moment."""
    barrier = threading.Barrier(len(workers))
    results: list[dict[str, list[Any]]] = [{} for _ in workers]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            scheduler = workers[i].scheduler
            assert scheduler is not None
            barrier.wait(10)
            results[i] = scheduler.run_due(now)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(workers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    return results


def _close(workers: list[Worker]) -> None:
    for worker in workers:
        if worker.scheduler is not None:
            worker.scheduler.link.reset()


def test_every_tick_is_enqueued_once_by_racing_schedulers(engine: Engine) -> None:
    schedule = Schedule("five", "*/5 * * * *", values={"task": "work", "payload": {}})
    workers = _schedulers(engine, 6, [schedule])
    try:
        first = _run_together(workers, minute(1))  # first sight: the watermark, no job
        assert all(not r.get("five") for r in first)
        assert _jobs(engine) == []
        for n in range(5, 31, 5):
            results = _run_together(workers, minute(n) + timedelta(seconds=7))
            assert sorted(len(r.get("five", [])) for r in results) == [0, 0, 0, 0, 0, 1]
    finally:
        _close(workers)
    runs = Counter(job.run_after for job in _jobs(engine))
    assert runs == Counter({minute(n): 1 for n in range(5, 31, 5)})


def test_missed_ticks_run_the_latest_once_or_a_bounded_backfill(engine: Engine) -> None:
    latest = Schedule("latest", every=60, values={"task": "work", "payload": {"s": "latest"}})
    backfilled = Schedule("backfilled", every=60, backfill=3, values={"task": "work", "payload": {"s": "back"}})
    (worker,) = _schedulers(engine, 1, [latest, backfilled])
    scheduler = worker.scheduler
    assert scheduler is not None
    try:
        scheduler.run_due(minute(0))
        enqueued = scheduler.run_due(minute(10))  # ten minutes without a worker
        assert len(enqueued["latest"]) == 1 and len(enqueued["backfilled"]) == 4
        assert scheduler.run_due(minute(10) + timedelta(seconds=30)) == {}  # handled: not asked again
    finally:
        _close([worker])
    by_schedule: dict[str, list[datetime]] = {}
    for job in _jobs(engine):
        by_schedule.setdefault(job.payload["s"], []).append(job.run_after)
    assert by_schedule == {"latest": [minute(10)], "back": [minute(n) for n in (7, 8, 9, 10)]}


def test_a_failing_tick_claims_nothing_and_the_next_one_runs(engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    def values(tick: datetime) -> dict[str, Any]:
        if tick == minute(2):
            raise RuntimeError("no report for this one")
        return {"report": f"r{tick.minute}"}

    schedule = Schedule("reports", every=60, values=values)
    (worker,) = _schedulers(engine, 1, [schedule], model=ReportJob)
    scheduler = worker.scheduler
    assert scheduler is not None
    try:
        scheduler.run_due(minute(1))
        assert scheduler.run_due(minute(2)) == {}
        assert "tick 2026-06-01T12:02:00+00:00 not enqueued: RuntimeError" in caplog.text
        with engine.connect() as conn:  # rolled back with the failed insert: still at minute 1
            assert conn.execute(q.schedule_states(ReportJob)).one().last_tick == minute(1)
        assert len(scheduler.run_due(minute(3))["reports"]) == 1
    finally:
        _close([worker])
    assert [(job.report, job.run_after) for job in _jobs(engine, REPORTS)] == [("r3", minute(3))]


def test_a_claim_on_a_held_watermark_row_gives_up_soon_and_is_tried_again(engine: Engine) -> None:
    """Another transaction holds the watermark row: the claim waits TICK_LOCK_TIMEOUT,
    not for as long as that transaction lives; the tick is not taken as handled, the
    next pass comes after BUSY_RETRY, and it enqueues the tick once the row is free."""
    schedule = Schedule("held", every=60, values={"task": "work", "payload": {}})  # no backfill
    (worker,) = _schedulers(engine, 1, [schedule])
    scheduler = worker.scheduler
    assert scheduler is not None
    holder = engine.connect()
    try:
        scheduler.run_due(minute(0))  # first sight: the watermark row
        holder.begin()
        holder.execute(select(TASK_SCHEDULES).where(TASK_SCHEDULES.c.name == "held").with_for_update())
        began = time.monotonic()
        assert scheduler.run_due(minute(1)) == {}
        assert time.monotonic() - began < CLAIM_DEADLINE  # gave up before the client-side deadline
        assert scheduler.busy == {"held"} and scheduler.handled["held"] == minute(0)
        scheduler.clock = lambda: minute(1) + timedelta(seconds=1)
        assert scheduler.tick() == BUSY_RETRY
        holder.rollback()
        assert len(scheduler.run_due(minute(1) + timedelta(seconds=2))["held"]) == 1
        assert scheduler.busy == set()
    finally:
        holder.close()
        _close([worker])
    assert [job.run_after for job in _jobs(engine)] == [minute(1)]


def test_a_removed_schedule_stops_and_its_row_stays_harmless(engine: Engine) -> None:
    old = Schedule("old", every=60, values={"task": "work", "payload": {}})
    new = Schedule("new", every=60, values={"task": "work", "payload": {}})
    (before,) = _schedulers(engine, 1, [old])
    (after,) = _schedulers(engine, 1, [new])
    assert before.scheduler is not None and after.scheduler is not None
    try:
        before.scheduler.run_due(minute(0))
        before.scheduler.run_due(minute(1))
        after.scheduler.run_due(minute(5))
        after.scheduler.run_due(minute(6))
    finally:
        _close([before, after])
    assert [job.run_after for job in _jobs(engine)] == [minute(1), minute(6)]
    with engine.connect() as conn:
        assert [r.name for r in conn.execute(q.schedule_states(Task))] == ["new", "old"]


# -- real workers ---------------------------------------------------------------------------


def test_workers_enqueue_each_second_once_on_both_runtimes(engine: Engine, make_worker: Any) -> None:
    tasks = Tasks()
    seen: list[Any] = []

    # backfill: a round delayed past the next tick (a loaded machine) catches up, skips nothing
    @tasks.periodic(every=1, payload={"from": "periodic"}, backfill=30)
    def beat(job: Any) -> None:
        seen.append(job.run_after)

    # a second schedule given as the worker option, beside the registry's
    other = Schedule("other", every=2, values={"task": "beat", "payload": {"from": "option"}}, backfill=30)
    workers = [
        make_worker(engine, Task, tasks, schedules=[other], poll_interval=0.5, backoff=FAST, shutdown_grace=2)
        for _ in range(3)
    ]
    for worker in workers:
        worker.start()
    try:
        wait_for(lambda: _done_ticks(engine) >= 6, timeout=30, what="six jobs run")
    finally:
        for worker in workers:
            worker.stop(grace=2)
    jobs = _jobs(engine)
    assert {job.task for job in jobs} == {"beat"}
    for source, step in (("periodic", 1), ("option", 2)):
        runs = Counter(job.run_after for job in jobs if job.payload == {"from": source})
        assert runs and max(runs.values()) == 1, (source, runs)
        ticks = sorted(runs)
        assert ticks == [ticks[0] + timedelta(seconds=step * n) for n in range(len(ticks))]  # none skipped
    assert sum(w.stats.scheduled for w in workers) == len(jobs)


def _done_ticks(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).where(TASKS.c.status == "done")) or 0)


def test_periodic_false_turns_the_scheduler_off(engine: Engine) -> None:
    tasks = Tasks()
    tasks.periodic(every=1)(lambda job: None)
    assert Worker(engine, Task, tasks).scheduler is not None
    assert Worker(engine, Task, tasks, periodic=False).scheduler is None
    assert Worker(engine, Task, lambda job: None).scheduler is None


class _Other(DeclarativeBase):
    pass


class UnscheduledJob(_Other, JobMixin):
    __tablename__ = "periodic_unscheduled_jobs"
    note: Mapped[str | None] = mapped_column(String(20))


def test_a_worker_with_schedules_needs_the_watermark_table(engine: Engine, make_worker: Any) -> None:
    table = table_of(UnscheduledJob)
    table.create(engine)
    schedule = Schedule("s", every=1, values={"note": "beat"})
    try:
        worker = make_worker(engine, UnscheduledJob, lambda job: None, schedules=[schedule])
        with pytest.raises(WorkerStartError, match="periodic_unscheduled_jobs_schedules' does not exist"):
            worker.start()
        schedules_table(UnscheduledJob).create(engine)
        worker = make_worker(engine, UnscheduledJob, lambda job: None, schedules=[schedule], poll_interval=0.5)
        worker.start()
        try:
            wait_for(lambda: _jobs(engine, table), timeout=10, what="a tick enqueued")
        finally:
            worker.stop(grace=1)
        assert {job.note for job in _jobs(engine, table)} == {"beat"}
    finally:
        _Other.metadata.drop_all(engine)


def test_killing_the_process_that_claimed_a_tick_loses_nothing_and_doubles_nothing(
    engine: Engine, worker_processes: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three worker processes on a one-second schedule; the first to claim a tick hangs
    inside its transaction (watermark moved, job not inserted) and is SIGKILLed there.
    Its transaction rolls back, another process claims that tick, and from the database:
    every tick has exactly one job, none missing."""
    hang = tmp_path / "hang"
    monkeypatch.setenv("SQLA_QUEUE_TEST_HANG", str(hang))
    processes = [worker_processes(target="tests.periodic_app:make_worker") for _ in range(3)]
    wait_for(hang.exists, timeout=30, what="a process to claim a tick and hang")
    wait_for(lambda: " " in hang.read_text(), what="the hung tick")
    pid_text, tick_text = hang.read_text().split(" ")
    (victim,) = [p for p in processes if p.pid == int(pid_text)]
    victim.signal(signal.SIGKILL)
    victim.wait(10)
    hung = datetime.fromisoformat(tick_text)
    wait_for(lambda: _ticks_after(engine, hung) >= 3, timeout=30, what="three ticks after the hung one")
    for process in processes:
        if process is not victim:
            process.signal(signal.SIGTERM)
    for process in processes:
        process.wait(20)
    jobs = _jobs(engine)
    runs = Counter(job.run_after for job in jobs)
    assert max(runs.values()) == 1, runs
    ticks = sorted(runs)
    assert ticks == [ticks[0] + timedelta(seconds=n) for n in range(len(ticks))]
    (of_hung,) = [job for job in jobs if job.run_after == hung]
    assert of_hung.payload["pid"] != victim.pid


def test_a_process_frozen_inside_its_claim_holds_the_tick_only_for_a_bounded_time(
    engine: Engine, worker_processes: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two worker processes on a one-second schedule; the first to claim a tick stops
    itself (SIGSTOP) inside its transaction, its watermark row locked. The server ends
    that transaction once it has sat idle for TICK_IDLE_TIMEOUT, and the other process,
    whose claims give up on the held row after TICK_LOCK_TIMEOUT and are tried again,
    enqueues the tick within the sum of those bounds. Sent SIGCONT, the frozen process
    finds its transaction gone, enqueues nothing twice, and goes on with later ticks."""
    hang = tmp_path / "hang"
    monkeypatch.setenv("SQLA_QUEUE_TEST_HANG", str(hang))
    monkeypatch.setenv("SQLA_QUEUE_TEST_HANG_STOP", "1")
    processes = [worker_processes(target="tests.periodic_app:make_worker") for _ in range(2)]
    wait_for(hang.exists, timeout=30, what="a process to claim a tick and freeze")
    wait_for(lambda: " " in hang.read_text(), what="the frozen tick")
    pid_text, tick_text = hang.read_text().split(" ")
    (victim,) = [p for p in processes if p.pid == int(pid_text)]
    (other,) = [p for p in processes if p is not victim]
    hung = datetime.fromisoformat(tick_text)
    with ConnectLag(engine.url) as lag:
        wait_for(lambda: psutil.Process(victim.pid).status() == psutil.STATUS_STOPPED, what="the process stopped")
        frozen = time.monotonic()
        wait_for(lambda: _ticks_from(engine, hung) >= 1, timeout=60, what="the frozen tick enqueued")
        took = time.monotonic() - frozen
        # The server's timer, one claim that gave up, the retry, and a claim that commits.
        bound = TICK_IDLE_TIMEOUT + TICK_LOCK_TIMEOUT + BUSY_RETRY + 1.0 + 3 * lag.worst
        assert took <= bound, (took, bound, lag.worst)
    wait_for(lambda: _ticks_from(engine, hung) >= 3, timeout=30, what="ticks after the frozen one")
    victim.signal(signal.SIGCONT)
    other.signal(signal.SIGTERM)
    other.wait(20)
    # Alone now, the process that was frozen enqueues the next ticks itself.
    wait_for(lambda: _ticks_by(engine, victim.pid) >= 2, timeout=30, what="ticks of the process thawed")
    victim.signal(signal.SIGTERM)
    victim.wait(20)
    jobs = _jobs(engine)
    runs = Counter(job.run_after for job in jobs)
    assert max(runs.values()) == 1, runs
    ticks = sorted(runs)
    assert ticks == [ticks[0] + timedelta(seconds=n) for n in range(len(ticks))]
    (of_hung,) = [job for job in jobs if job.run_after == hung]
    assert of_hung.payload["pid"] == other.pid


def _ticks_from(engine: Engine, tick: datetime) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).where(TASKS.c.run_after >= tick)) or 0)


def _ticks_by(engine: Engine, pid: int) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).where(TASKS.c.payload["pid"].as_integer() == pid)) or 0)


def _ticks_after(engine: Engine, tick: datetime) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).where(TASKS.c.run_after > tick)) or 0)


def test_schedules_table_follows_the_schema_translate_map(engine: Engine) -> None:
    """Each tenant's schema has its own watermarks: one schedule ticks in each."""
    with engine.begin() as conn:
        for schema in ("periodic_a", "periodic_b"):
            conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
            conn.execute(text(f"CREATE SCHEMA {schema}"))
    try:
        engines = []
        for schema in ("periodic_a", "periodic_b"):
            tenant = create_engine(engine.url, execution_options={"schema_translate_map": {None: schema}})
            engines.append(tenant)
            with tenant.begin() as conn:
                TASKS.create(conn)
                TASK_SCHEDULES.create(conn)
        schedule = Schedule("s", every=60, values={"task": "work", "payload": {}})
        workers = [Worker(tenant, Task, lambda job: None, schedules=[schedule]) for tenant in engines]
        try:
            for worker in workers:
                assert worker.scheduler is not None
                worker.scheduler.run_due(minute(0))
                assert len(worker.scheduler.run_due(minute(1))["s"]) == 1
        finally:
            _close(workers)
        for tenant in engines:
            assert [job.run_after for job in _jobs(tenant)] == [minute(1)]
            tenant.dispose()
    finally:
        with engine.begin() as conn:
            conn.execute(text("DROP SCHEMA periodic_a CASCADE"))
            conn.execute(text("DROP SCHEMA periodic_b CASCADE"))
