"""The dashboard's overview with its charts on a table of ten million finished jobs.

    python benchmarks/dashboard_charts.py [--quick] [--url URL] [--jobs N] [--days D]

The table holds ``--jobs`` (default 10,000,000) finished jobs written by the server with
``generate_series``, finished at an even pace over the last ``--days`` (default 10, so
the last 24 hours hold a tenth of them: 1,000,000, about 12 a second), over three queues:
98.7% done, 1% failed, 0.3% cancelled, each with a pickup latency and a run time drawn
from exponential distributions; plus 3,000 runnable pending jobs. Vacuumed and analyzed.

It times, as the median of 5 runs after a warm-up, the overview page through Flask's
test client (the last hour, the last 24 hours, and the live parts ``/live``) and each
statement the page runs, twice:

1. **from the queue table** (no activity table): the charts read the window's finished
   jobs through the index of finished jobs (``<table>_finished_idx``);
2. **from the activity table** the workers record (``activity_table()``): recorded with
   the workers' own statement first (``sql.record_activity``, caught up bucket by bucket
   as a worker's sweeper does), then the page reads the recorded rows and, from the
   queue table, the buckets not recorded yet. The recording of the last two buckets
   that hold jobs is taken back first, so that read is what it is on a busy table: the
   bucket in progress and the one that ended within its grace, full of jobs.

It also times one worker's recording of a bucket full of jobs (a minute, a quarter of an
hour): what declaring the activity table costs the workers, once a bucket.

It reuses ``benchmarks/harness.py``'s scratch database and table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as bench
from sqlalchemy import Engine, create_engine, func, select

from sqla_queue import admin
from sqla_queue import sql as q
from sqla_queue.activity import RESOLUTIONS, activity_table, bucket_start, declared_activity_table, due_range
from sqla_queue.dashboard import create_app
from sqla_queue.dashboard.activity import WINDOWS

PENDING = 3000


def load(url: Any, jobs: int, days: float) -> None:
    """Setup, not measured: ``jobs`` finished jobs, evenly over the last ``days``, and a
    backlog of runnable pending ones."""
    with bench.raw_connect(url) as conn:
        conn.execute(
            "INSERT INTO bench_jobs (queue, status, recipient, order_id, attempts, run_after, created_at, "
            "                        started_at, finished_at, last_error) "
            "SELECT CASE i %% 3 WHEN 0 THEN 'mail' WHEN 1 THEN 'default' ELSE 'reports' END, "
            "       CASE WHEN i %% 100 = 0 THEN 'failed' WHEN i %% 331 = 0 THEN 'cancelled' ELSE 'done' END, "
            "       'user' || i || '@example.com', i, 1, "
            "       fin - run - waited, fin - run - waited, fin - run, fin, "
            "       CASE WHEN i %% 100 = 0 THEN 'SMTPError: 550 mailbox ' || i || ' unavailable' END "
            "FROM (SELECT i, now() - (%(n)s - i) * (%(span)s / %(n)s) * interval '1 second' AS fin, "
            "             -ln(1 - random()) * 0.2 * interval '1 second' AS run, "
            "             -ln(1 - random()) * 0.05 * interval '1 second' AS waited "
            "      FROM generate_series(1, %(n)s) AS i) AS jobs",
            {"n": jobs, "span": days * 86400.0},
        )
        conn.execute(
            "INSERT INTO bench_jobs (queue, recipient, order_id, run_after) "
            "SELECT CASE i %% 3 WHEN 0 THEN 'mail' WHEN 1 THEN 'default' ELSE 'reports' END, "
            "       'later' || i || '@example.com', i, now() - i * interval '10 milliseconds' "
            "FROM generate_series(1, %(n)s) AS i",
            {"n": PENDING},
        )
    bench.vacuum_analyze(url)


def median_ms(run: Callable[[], Any], repeat: int = 7) -> float:
    run()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def record_everything(engine: Engine) -> int:
    """What the workers' sweepers do once a bucket has ended, repeated until caught up
    (the first recording goes back 24 hours, a chunk per statement): the statements of
    ``sql.record_activity``, their ranges from ``activity.due_range``."""
    model = bench.BenchJob
    statements = 0
    while True:
        with engine.begin() as conn:
            now, *marks = conn.execute(q.activity_marks(model)).one()
            due = [(r, due_range(now, mark, r)) for r, mark in zip(RESOLUTIONS, marks, strict=True)]
            due = [(r, d) for r, d in due if d is not None]
            if not due:
                return statements
            for resolution, (since, until, sample) in due:
                conn.execute(q.record_activity(model, seconds=resolution.seconds), {
                    q.ACTIVITY_SINCE_PARAM: since, q.ACTIVITY_UNTIL_PARAM: until, q.ACTIVITY_SAMPLE_PARAM: sample,
                })
                statements += 1


def cases(engine: Engine, client: Any) -> list[tuple[str, Callable[[], Any]]]:
    """The overview's requests, then each statement of its charts, of each window."""
    model = bench.BenchJob
    found: list[tuple[str, Callable[[], Any]]] = [
        ("page: overview, last hour", lambda: _get(client, "/?window=1h")),
        ("page: overview, last 24 hours", lambda: _get(client, "/?window=24h")),
        ("page: live parts, last hour", lambda: _get(client, "/live?window=1h")),
        ("page: live parts, last 24 hours", lambda: _get(client, "/live?window=24h")),
        ("statement: counts now (queue_depth)", lambda: admin.queue_depth(engine, model)),
        ("statement: waiting now (waiting_jobs)", lambda: _rows(engine, q.waiting_jobs(model))),
    ]
    with engine.connect() as conn:
        now = conn.scalar(select(func.now()))
    assert now is not None
    recorded = declared_activity_table(bench.TABLE) is not None
    if recorded:
        with engine.connect() as conn:
            _, *latest = conn.execute(q.activity_marks(model)).one()
        marks = dict(zip((r.seconds for r in RESOLUTIONS), latest, strict=True))
        found.append(("statement: marks (activity_marks)", lambda: _rows(engine, q.activity_marks(model))))
    for window in WINDOWS.values():
        width = timedelta(seconds=window.seconds)
        current = bucket_start(now, window.seconds)
        start = current - (window.buckets - 1) * width
        if recorded:
            mark = marks[window.seconds]
            found.append((
                f"statement: recorded rows, {window.label} (activity_rows)",
                lambda s=window.seconds, a=start, b=mark: _rows(engine, q.activity_rows(model, seconds=s, since=a,
                                                                                     until=b)),
            ))
            found.append((
                f"statement: the buckets not recorded yet, {window.label} (finished_activity)",
                lambda s=window.seconds, a=mark + width, b=current: _rows(
                    engine, q.finished_activity(model, seconds=s, since=a, until=b + timedelta(seconds=s))),
            ))
        else:
            found.append((
                f"statement: the whole window, {window.label} (finished_activity)",
                lambda s=window.seconds, a=start, b=current: _rows(
                    engine, q.finished_activity(model, seconds=s, since=a, until=b + timedelta(seconds=s))),
            ))
    return found


def _get(client: Any, path: str) -> bytes:
    response = client.get(path)
    assert response.status_code == 200, response.status_code
    data: bytes = response.data
    return data


def _rows(engine: Engine, stmt: Any) -> int:
    with engine.connect() as conn:
        return len(conn.execute(stmt).all())


def last_finished(engine: Engine) -> Any:
    with engine.connect() as conn:
        return conn.scalar(select(func.max(bench.TABLE.c.finished_at)))


def recording_costs(engine: Engine) -> list[tuple[str, float]]:
    """One worker's recording of a bucket full of jobs, a minute and a quarter of an hour:
    the statement run again on a bucket recorded already (its reads are the same; ON
    CONFLICT writes nothing)."""
    model = bench.BenchJob
    results = []
    end = last_finished(engine)
    for resolution in RESOLUTIONS:
        until = bucket_start(end, resolution.seconds)
        since = until - timedelta(seconds=resolution.seconds)

        def record(s: int = resolution.seconds, a: Any = since, b: Any = until) -> None:
            with engine.begin() as conn:
                conn.execute(q.record_activity(model, seconds=s), {
                    q.ACTIVITY_SINCE_PARAM: a, q.ACTIVITY_UNTIL_PARAM: b, q.ACTIVITY_SAMPLE_PARAM: True,
                })

        name = "a minute" if resolution.seconds == 60 else "a quarter of an hour"
        results.append((f"worker: record {name} (record_activity)", median_ms(record)))
    return results


def take_back_the_latest(engine: Engine) -> None:
    """Delete the recording of the last two buckets that hold jobs (and later ones), as
    if the workers had not recorded them yet: the bucket in progress on a busy table,
    and the one still in its grace."""
    table = declared_activity_table(bench.TABLE)
    assert table is not None
    end = last_finished(engine)
    with engine.begin() as conn:
        for resolution in RESOLUTIONS:
            width = timedelta(seconds=resolution.seconds)
            conn.execute(table.delete().where(table.c.seconds == resolution.seconds,
                                              table.c.bucket >= bucket_start(end, resolution.seconds) - width))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="20,000 jobs: checks the harness")
    parser.add_argument("--url", help="admin URL of the server (default: DATABASE_URL, else embedded)")
    parser.add_argument("--jobs", type=int, default=10_000_000)
    parser.add_argument("--days", type=float, default=10.0)
    args = parser.parse_args(argv)
    jobs = 20_000 if args.quick else args.jobs
    model = bench.BenchJob
    results: list[tuple[str, str, float]] = []
    with bench.scratch_database(args.url or os.environ.get("DATABASE_URL")) as url:
        engine = create_engine(url)
        try:
            bench.Base.metadata.create_all(engine)
            info = bench.machine_info(engine)
            bench.say(f"loading {jobs:,} finished jobs over {args.days:g} days")
            load(url, jobs, args.days)
            with engine.connect() as conn:
                in_day = conn.scalar(select(func.count()).where(
                    bench.TABLE.c.finished_at >= func.now() - timedelta(days=1)))
            client = create_app(engine, [model]).test_client()
            for name, run in cases(engine, client):
                results.append(("queue table", name, median_ms(run)))
                bench.say(f"queue table: {name}: {results[-1][2]:.1f} ms")
            activity_table(model).create(engine)
            bench.say("recording the activity table, as the workers do")
            started = time.perf_counter()
            statements = record_everything(engine)
            caught_up = time.perf_counter() - started
            for name, ms in recording_costs(engine):
                results.append(("activity table", name, ms))
            take_back_the_latest(engine)
            client = create_app(engine, [model]).test_client()  # the model now has its activity table
            for name, run in cases(engine, client):
                results.append(("activity table", name, median_ms(run)))
                bench.say(f"activity table: {name}: {results[-1][2]:.1f} ms")
        finally:
            engine.dispose()
    print(f"{info}\n\n{jobs:,} finished jobs over {args.days:g} days, {in_day:,} of them in the last 24 hours; "
          f"{PENDING:,} pending\n")
    print(f"The first recording of the activity table (24 hours back): {statements} statements, "
          f"{caught_up:.1f} s\n")
    print("| read from | what | median ms |\n|---|---|---:|")
    for source, name, ms in results:
        print(f"| {source} | {name} | {ms:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
