"""Activity over time (``sqla_queue.sql``'s activity builders and the activity table) on
real PostgreSQL: jobs finished per queue and bucket, the p50 and p99 of their pickup
latency and run time against the same percentiles computed here, the jobs waiting; the
workers' recording (each bucket once, whoever records it, on both runtimes), its mark
and pruning; and the plans, which read a time range of the index of finished jobs."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, func, insert, select, text
from sqlalchemy.orm import DeclarativeBase

from sqla_queue import JobMixin, WorkerStartError, activity_table
from sqla_queue import sql as q
from sqla_queue.activity import GRACE, MINUTES, QUARTERS, RESOLUTIONS, bucket_start, due_range

from .helpers import Server, table_of, wait_for
from .models import CHART_ACTIVITY, ChartJob, EmailJob
from .test_sql import _generic_plan, _plan

JOBS = table_of(ChartJob)
MINUTE = timedelta(minutes=1)
QUARTER = timedelta(minutes=15)


def db_now(engine: Engine) -> datetime:
    with engine.connect() as conn:
        now: datetime | None = conn.scalar(select(func.now()))
    assert now is not None
    return now


def finished(minute: datetime, queue: str, status: str, waits: list[float], runs: list[float]) -> list[dict[str, Any]]:
    """Rows of jobs that finished in ``minute``: each waited ``waits[i]`` seconds after it
    became runnable and ran ``runs[i]`` seconds."""
    rows = []
    for i, (waited, ran) in enumerate(zip(waits, runs, strict=True)):
        end = minute + timedelta(seconds=10 + i * 0.5)
        started = end - timedelta(seconds=ran)
        ready = started - timedelta(seconds=waited)
        rows.append({"queue": queue, "status": status, "attempts": 1, "run_after": ready, "created_at": ready,
                     "started_at": started, "finished_at": end})
    return rows


def p(values: list[float], percent: int) -> float:
    """PostgreSQL's ``percentile_cont``: linear between the two nearest ranks."""
    return statistics.quantiles(values, n=100, method="inclusive")[percent - 1]


WAITS = [0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.3, 2.1, 3.4, 9.0]
RUNS = [0.5, 0.25, 1.5, 0.75, 2.0, 0.1, 4.0, 0.3, 12.0, 0.6]


def test_finished_activity_counts_each_minute_and_its_percentiles(engine: Engine) -> None:
    minute = bucket_start(db_now(engine), 60) - 5 * MINUTE
    late = finished(minute, "mail", "done", WAITS[:2], RUNS[:2])
    late[0]["run_after"] = minute - timedelta(hours=2)  # an enqueue that set a run_after in the past:
    late[0]["created_at"] = late[0]["started_at"] - timedelta(seconds=0.05)  # it waited from its creation
    with engine.begin() as conn:
        conn.execute(insert(JOBS), [
            *finished(minute, "mail", "done", WAITS[2:8], RUNS[2:8]),
            *finished(minute, "mail", "failed", WAITS[8:], RUNS[8:]),
            *late,
            *finished(minute, "mail", "cancelled", [60.0], [60.0]),  # no latency nor run time of its own
            *finished(minute + MINUTE, "mail", "done", [1.0], [1.0]),
            *finished(minute, "sms", "failed", [7.0], [3.0]),
            *finished(minute - 10 * MINUTE, "mail", "done", [1.0], [1.0]),  # before the range
        ])
        conn.execute(insert(JOBS), [{"queue": "mail"}])  # pending: not finished
        rows = conn.execute(q.finished_activity(ChartJob, seconds=60, since=minute - MINUTE,
                                                until=minute + 2 * MINUTE)).all()
    got = {(r.queue, r.bucket): r for r in rows}
    assert sorted(got) == [("mail", minute), ("mail", minute + MINUTE), ("sms", minute)]
    mail = got[("mail", minute)]
    assert (mail.done, mail.failed, mail.cancelled, mail.waiting) == (8, 2, 1, None)
    assert mail.pickup_p50 == pytest.approx(p(WAITS, 50), abs=1e-6)
    assert mail.pickup_p99 == pytest.approx(p(WAITS, 99), abs=1e-6)
    assert mail.run_p50 == pytest.approx(p(RUNS, 50), abs=1e-6)
    assert mail.run_p99 == pytest.approx(p(RUNS, 99), abs=1e-6)
    sms = got[("sms", minute)]
    assert (sms.failed, sms.pickup_p50, sms.pickup_p99, sms.run_p50) == (1, pytest.approx(7.0), pytest.approx(7.0),
                                                                          pytest.approx(3.0))
    # A quarter of an hour takes the minutes together; its percentiles are over all its jobs.
    with engine.connect() as conn:
        quarters = conn.execute(q.finished_activity(ChartJob, seconds=900, since=minute - 20 * MINUTE,
                                                    until=minute + 20 * MINUTE)).all()
    assert sum(r.done for r in quarters if r.queue == "mail") == 10
    assert all(r.bucket == bucket_start(r.bucket, 900) for r in quarters)


def test_an_empty_range_and_the_jobs_waiting(engine: Engine) -> None:
    now = db_now(engine)
    with engine.begin() as conn:
        assert conn.execute(q.finished_activity(ChartJob, since=now - MINUTE, until=now + MINUTE)).all() == []
        assert conn.execute(q.waiting_jobs(ChartJob)).all() == []
        conn.execute(insert(JOBS), [{"queue": "a"}] * 3 + [{"queue": "b"}])
        conn.execute(insert(JOBS).values(queue="a", run_after=func.now() + timedelta(hours=1)))  # not runnable yet
        conn.execute(insert(JOBS).values(queue="a", status="running"))
        assert [tuple(r) for r in conn.execute(q.waiting_jobs(ChartJob))] == [("a", 3), ("b", 1)]


def record(engine: Engine, seconds: int, since: datetime, until: datetime, sample: bool) -> list[Any]:
    with engine.begin() as conn:
        return list(conn.execute(q.record_activity(ChartJob, seconds=seconds), {
            q.ACTIVITY_SINCE_PARAM: since, q.ACTIVITY_UNTIL_PARAM: until, q.ACTIVITY_SAMPLE_PARAM: sample,
        }))


def recorded(engine: Engine, seconds: int = 60) -> dict[tuple[str, datetime], Any]:
    with engine.connect() as conn:
        rows = conn.execute(select(CHART_ACTIVITY).where(CHART_ACTIVITY.c.seconds == seconds)).all()
    return {(r.queue, r.bucket): r for r in rows}


def test_record_activity_writes_each_bucket_once_with_its_mark(engine: Engine) -> None:
    minute = bucket_start(db_now(engine), 60) - 5 * MINUTE
    with engine.begin() as conn:
        conn.execute(insert(JOBS), [*finished(minute, "mail", "done", WAITS, RUNS),
                                    *finished(minute + 2 * MINUTE, "sms", "failed", [1.0], [2.0])])
        conn.execute(insert(JOBS), [{"queue": "idle"}] * 2 + [{"queue": "mail"}])
    written = record(engine, 60, minute, minute + 3 * MINUTE, sample=True)
    rows = recorded(engine)
    # A mark per bucket, a row per queue with finished jobs, and the waiting jobs on the last bucket.
    assert sorted((queue, bucket - minute) for queue, bucket in rows) == [
        ("", timedelta(0)), ("", MINUTE), ("", 2 * MINUTE),
        ("idle", 2 * MINUTE), ("mail", timedelta(0)), ("mail", 2 * MINUTE), ("sms", 2 * MINUTE),
    ]
    assert len(written) == len(rows)
    mail = rows[("mail", minute)]
    assert (mail.done, mail.failed, mail.waiting) == (10, 0, None)
    assert mail.pickup_p99 == pytest.approx(p(WAITS, 99)) and mail.run_p50 == pytest.approx(p(RUNS, 50))
    assert (rows[("idle", minute + 2 * MINUTE)].waiting, rows[("idle", minute + 2 * MINUTE)].done) == (2, 0)
    assert rows[("mail", minute + 2 * MINUTE)].waiting == 1 and rows[("sms", minute + 2 * MINUTE)].waiting == 0
    assert rows[("", minute + 2 * MINUTE)].waiting == 3  # the mark: counted, 3 in all
    assert rows[("", minute + MINUTE)].waiting is None and rows[("", minute)].waiting is None  # not counted
    # Recorded again (another worker at the same moment): nothing changes.
    assert record(engine, 60, minute, minute + 3 * MINUTE, sample=True) == []
    assert recorded(engine) == rows
    with engine.connect() as conn:
        _, mark_60, mark_900 = conn.execute(q.activity_marks(ChartJob)).one()
        shown = conn.execute(q.activity_rows(ChartJob, seconds=60, since=minute, until=mark_60)).all()
    assert mark_60 == minute + 2 * MINUTE and mark_900 is None
    assert [(r.queue, r.bucket) for r in shown] == sorted(rows)  # the marks first
    # Without the sample, a catching-up range counts no waiting jobs.
    record(engine, 60, minute + 3 * MINUTE, minute + 4 * MINUTE, sample=False)
    assert [k for k in recorded(engine) if k[1] == minute + 3 * MINUTE] == [("", minute + 3 * MINUTE)]


def test_prune_activity_keeps_each_resolution_for_its_time(engine: Engine) -> None:
    now = db_now(engine)
    with engine.begin() as conn:
        conn.execute(insert(CHART_ACTIVITY), [
            {"seconds": 60, "bucket": now - timedelta(seconds=MINUTES.keep + 60), "queue": "old"},
            {"seconds": 60, "bucket": now - timedelta(seconds=MINUTES.keep - 600), "queue": "kept"},
            {"seconds": 900, "bucket": now - timedelta(seconds=MINUTES.keep + 900), "queue": "kept"},
            {"seconds": 900, "bucket": now - timedelta(seconds=QUARTERS.keep + 900), "queue": "old"},
        ])
        conn.execute(q.prune_activity(ChartJob))
        left = conn.execute(select(CHART_ACTIVITY.c.seconds, CHART_ACTIVITY.c.queue)).all()
    assert sorted(tuple(r) for r in left) == [(60, "kept"), (900, "kept")]


def test_the_builders_refuse_a_table_without_one_and_a_bad_width() -> None:
    with pytest.raises(TypeError, match=r"has no activity table: call sqla_queue.activity_table\(Model\)"):
        q.record_activity(EmailJob)
    with pytest.raises(ValueError, match="seconds must be a whole number"):
        q.finished_activity(EmailJob, seconds=0)
    with pytest.raises(ValueError, match="seconds must be a whole number"):
        q.finished_activity(EmailJob, seconds=1.5)  # type: ignore[arg-type]


@pytest.mark.timeout(300)
def test_the_reads_take_a_time_range_of_the_finished_jobs_index(engine: Engine) -> None:
    """Among 100,000 finished jobs of ten days, the last hour (the charts' read, the
    workers' recording, custom and generic plans) is a range of ``<table>_finished_idx``."""
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO chart_jobs (queue, status, started_at, finished_at) "
            "SELECT 'q' || (i % 3), 'done', now() - i * interval '9 seconds', now() - i * interval '9 seconds' "
            "FROM generate_series(1, 100000) AS i"
        ))
        conn.execute(insert(JOBS), [{"queue": "q1"}] * 20)
        conn.execute(text("ANALYZE chart_jobs"))
    now = db_now(engine)
    hour = q.finished_activity(ChartJob, since=now - timedelta(hours=1), until=now + MINUTE)
    with engine.connect() as conn:
        plans = {
            "chart": _plan(conn, hour),
            "generic chart": _generic_plan(conn, hour),
            "recording": _plan_of(conn, q.record_activity(ChartJob), {
                q.ACTIVITY_SINCE_PARAM: now - MINUTE, q.ACTIVITY_UNTIL_PARAM: now, q.ACTIVITY_SAMPLE_PARAM: True}),
            "generic recording": _generic_plan(conn, q.record_activity(ChartJob)),
        }
        waiting = _plan(conn, q.waiting_jobs(ChartJob))
    for name, plan in plans.items():
        assert "chart_jobs_finished_idx" in plan, (name, plan)
        assert "Seq Scan on chart_jobs" not in plan, (name, plan)
    assert "Seq Scan on chart_jobs" not in waiting and "chart_jobs_claim" in waiting, waiting


def _plan_of(conn: Any, stmt: Any, values: dict[str, Any]) -> str:
    """The plan of ``stmt`` with ``values`` for its parameters bound at execution."""
    compiled = stmt.compile(dialect=conn.dialect)
    rows = conn.exec_driver_sql("EXPLAIN " + str(compiled), {**compiled.params, **values})
    return "\n".join(r[0] for r in rows)


# -- when to record -------------------------------------------------------------------------


def test_due_range_waits_for_the_grace_then_catches_up_a_chunk_at_a_time() -> None:
    start = datetime.fromisoformat("2026-12-07T10:00:00+00:00")
    # 10:01:05: the minute 10:00 ended, but its grace has not passed.
    assert due_range(start + timedelta(seconds=65), start - MINUTE, MINUTES) is None
    assert due_range(start + timedelta(seconds=60 + GRACE + 1), start - MINUTE, MINUTES) == (
        start, start + MINUTE, True)
    # Never recorded: an hour back, in one statement; three hours behind: a chunk, no sample.
    first = due_range(start + timedelta(seconds=30), None, MINUTES)
    assert first == (start - 60 * MINUTE, start, True)
    behind = due_range(start + timedelta(seconds=30), start - 5 * 60 * MINUTE, MINUTES)
    assert behind == (start - 60 * MINUTE, start, True)  # no further back than the backfill
    quarters = due_range(start + timedelta(seconds=30), None, QUARTERS)
    assert quarters == (start - timedelta(hours=24), start - timedelta(hours=23), False)
    assert bucket_start(datetime.fromisoformat("2026-12-07T10:14:59.9+00:00"), 900) == start
    assert [r.seconds for r in RESOLUTIONS] == [60, 900]


# -- the workers ------------------------------------------------------------------------------


def contiguous(rows: dict[tuple[str, datetime], Any], width: timedelta) -> int:
    """How many marks ``rows`` has, checking they follow each other without a gap."""
    marks = sorted(bucket for queue, bucket in rows if queue == "")
    assert marks == [marks[0] + i * width for i in range(len(marks))], marks
    return len(marks)


def test_a_worker_records_the_ended_buckets_each_once(
    engine: Engine, start_worker: Callable[..., Any], runtime: Any
) -> None:
    """Its sweeper records the buckets that ended (the last hour, and the last 24 hours
    by quarter), the jobs waiting on the latest minute; a second worker records nothing
    twice."""
    now = db_now(engine)
    minute = bucket_start(now, 60) - 3 * MINUTE
    quarter = bucket_start(now, 900) - 2 * QUARTER  # one that ended a quarter of an hour ago at least
    with engine.begin() as conn:
        conn.execute(insert(JOBS), finished(minute, "mail", "done", WAITS, RUNS))
        conn.execute(insert(JOBS), finished(quarter + 5 * MINUTE, "report", "failed", WAITS[:3], RUNS[:3]))
        conn.execute(insert(JOBS), [{"queue": "backlog"}] * 4)
    start_worker(lambda job: None, ChartJob, queues=("elsewhere",))
    start_worker(lambda job: None, ChartJob, queues=("elsewhere",))

    def caught_up() -> Any:
        with engine.connect() as conn:
            now, mark_60, mark_900 = conn.execute(q.activity_marks(ChartJob)).one()
        return (mark_60 is not None and mark_900 is not None and due_range(now, mark_60, MINUTES) is None
                and due_range(now, mark_900, QUARTERS) is None)

    # The quarters of the last 24 hours take 24 statements (a chunk a sweep), the hour one.
    wait_for(caught_up, timeout=60, what="the workers to record the last hour and the last 24 hours")
    minutes = recorded(engine, 60)
    assert minutes[("mail", minute)].done == 10
    assert minutes[("mail", minute)].run_p99 == pytest.approx(p(RUNS, 99))
    latest = max(bucket for _, bucket in minutes)
    assert minutes[("backlog", latest)].waiting == 4
    assert contiguous(minutes, MINUTE) >= 60  # every minute of the hour (one more if a minute ended meanwhile)
    quarters = recorded(engine, 900)
    assert quarters[("report", quarter)].failed == 3
    assert contiguous(quarters, QUARTER) >= 96


def test_a_worker_refuses_to_start_when_the_declared_activity_table_is_missing(server: Server) -> None:
    class Base(DeclarativeBase):
        pass

    class SilentJob(Base, JobMixin):
        __tablename__ = "silent_jobs"

    activity_table(SilentJob)
    engine = create_engine(server.url)
    try:
        table_of(SilentJob).create(engine)
        from sqla_queue import Worker

        missing = r"has an activity table declared .* 'silent_jobs_activity' does not exist"
        with pytest.raises(WorkerStartError, match=missing):
            Worker(engine, SilentJob, lambda job: None).start()
    finally:
        table_of(SilentJob).drop(engine)
        engine.dispose()
