"""A page of the dashboard's job list (``sqla-queue jobs``) on a table of a million jobs.

    python benchmarks/dashboard_page.py [--quick] [--url URL] [--jobs N]

The table holds ``--jobs`` (default 1,000,000) jobs written by the server: 97% done, 2%
pending, 1% failed with a ``last_error``, over two queues; vacuumed and analyzed. Each
query is :func:`sqla_queue.admin.list_jobs` (50 rows, keyset on the primary key), timed
as the median of 7 runs after a warm-up: the newest page, a page half-way down (``before=``
the middle key, which ``OFFSET`` would make read half the table), and the filters of the
dashboard. ``admin.queue_overview`` (counts per queue and status, the last hour's
throughput: the JSON API's overview) is timed too: it reads the whole table, as
``sqla-queue stats`` does. The overview page's charts have a benchmark of their own,
``dashboard_charts.py``.

It reuses ``benchmarks/harness.py``'s scratch database and table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as bench
from sqlalchemy import create_engine

from sqla_queue import admin
from sqla_queue.admin import JobFilters


def load(url: Any, n: int) -> None:
    """Setup, not measured."""
    with bench.raw_connect(url) as conn:
        conn.execute(
            "INSERT INTO bench_jobs (queue, status, recipient, order_id, attempts, last_error, finished_at) "
            "SELECT CASE WHEN i %% 3 = 0 THEN 'mail' ELSE 'default' END, "
            "       CASE WHEN i %% 100 = 0 THEN 'failed' WHEN i %% 50 = 1 THEN 'pending' ELSE 'done' END, "
            "       'user' || i || '@example.com', i, 1, "
            "       CASE WHEN i %% 100 = 0 THEN 'SMTPError: 550 mailbox ' || i || ' unavailable' END, "
            "       CASE WHEN i %% 50 = 1 THEN NULL ELSE now() - (i %% 7200) * interval '1 second' END "
            "FROM generate_series(1, %s) AS i",
            (n,),
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10,000 jobs: checks the harness")
    parser.add_argument("--url", help="admin URL of the server (default: DATABASE_URL, else embedded)")
    parser.add_argument("--jobs", type=int, default=1_000_000)
    args = parser.parse_args(argv)
    jobs = 10_000 if args.quick else args.jobs
    model = bench.BenchJob
    with bench.scratch_database(args.url or os.environ.get("DATABASE_URL")) as url:
        engine = create_engine(url)
        try:
            bench.Base.metadata.create_all(engine)
            info = bench.machine_info(engine)
            bench.say(f"loading {jobs:,} jobs")
            load(url, jobs)
            middle = jobs // 2
            cases: list[tuple[str, Callable[[], Any]]] = [
                ("newest page", lambda: admin.list_jobs(engine, model)),
                (f"page before id {middle:,}", lambda: admin.list_jobs(engine, model, before=middle)),
                ("status failed (1%)", lambda: admin.list_jobs(engine, model, JobFilters(statuses=("failed",)))),
                ("status failed, half-way down",
                 lambda: admin.list_jobs(engine, model, JobFilters(statuses=("failed",)), before=middle)),
                ("status pending (2%)", lambda: admin.list_jobs(engine, model, JobFilters(statuses=("pending",)))),
                ("queue mail, status failed or pending",
                 lambda: admin.list_jobs(engine, model, JobFilters(queues=("mail",), statuses=("failed", "pending")))),
                ("last_error contains 'mailbox 5'",
                 lambda: admin.list_jobs(engine, model, JobFilters(error_contains="mailbox 5"))),
                ("overview (counts and last hour)", lambda: admin.queue_overview(engine, model)),
            ]
            results = []
            for name, run in cases:
                page = run()
                rows = len(page.rows) if isinstance(page, admin.JobPage) else len(page)
                results.append((name, rows, median_ms(run)))
                bench.say(f"{name}: {results[-1][2]:.2f} ms")
        finally:
            engine.dispose()
    print(f"{info}\n\n{jobs:,} jobs in the table\n")
    print("| query | rows | median ms |\n|---|---:|---:|")
    for name, rows, ms in results:
        print(f"| {name} | {rows} | {ms:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
