"""A worker draining a large backlog, and throughput as worker processes are added.

    python benchmarks/drain.py [--quick] [--url URL] [--jobs N]

- **drain**: ``--jobs`` (default 1,000,000) jobs loaded by COPY, one worker process at
  default options (``concurrency=4``, a no-op handler) drains them; reported: jobs/s, CPU
  per job, and the process's peak RSS, beside the peak RSS of the same worker draining a
  tenth of the backlog (memory must not grow with the backlog).
- **scaling**: 1, 2, 3 and 4 worker processes (``concurrency=4`` each) drain the same
  number of jobs; throughput must not collapse as processes are added.

It reuses ``benchmarks/harness.py``'s scratch database, table and process runner.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as bench
from sqlalchemy import Engine, create_engine, make_url
from sqlalchemy.engine import URL

from sqla_queue import Worker


def _child(url_text: str, concurrency: int, ready: Any, go: Any, stop: Any) -> None:
    """One worker process: connected and ready, then works until told to stop."""
    engine = create_engine(make_url(url_text))
    worker = Worker(engine, bench.BenchJob, bench.noop, concurrency=concurrency)
    engine.connect().close()
    ready.put(os.getpid())
    go.wait()
    cpu = bench.cpu_seconds()
    worker.start()
    stop.wait()
    cpu = bench.cpu_seconds() - cpu
    worker.stop(grace=10)
    engine.dispose()
    ready.put((cpu, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))  # KiB on Linux


def drain(url: URL, engine: Engine, jobs: int, processes: int, concurrency: int = 4) -> tuple[float, float, int]:
    """(jobs/s, µs of CPU per job, largest peak RSS of a worker process in MiB)."""
    ctx = bench.process_context()
    ready = ctx.Queue()
    go, stop = ctx.Event(), ctx.Event()
    url_text = url.render_as_string(hide_password=False)
    bench.reset(engine)
    bench.load_pending(url, jobs)
    procs = [
        ctx.Process(target=_child, args=(url_text, concurrency, ready, go, stop), daemon=True)
        for _ in range(processes)
    ]
    for proc in procs:
        proc.start()
    try:
        bench.wait_ready(ready, procs)
        with bench.raw_connect(url, autocommit=True) as watch:
            go.set()
            start = time.perf_counter()
            deadline = time.monotonic() + 1800
            while bench.unfinished(watch):
                if time.monotonic() > deadline or any(p.exitcode is not None for p in procs):
                    raise RuntimeError("a worker process died or jobs are stuck")
                time.sleep(0.05)
            elapsed = time.perf_counter() - start
        stop.set()
        reports = [ready.get(timeout=120) for _ in procs]
    finally:
        bench.end_processes(procs, stop)
    cpu = sum(r[0] for r in reports)
    rss = max(r[1] for r in reports) // 1024
    return jobs / elapsed, cpu / jobs * 1e6, rss


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the harness")
    parser.add_argument("--url", help="admin URL of the server (default: DATABASE_URL, else embedded)")
    parser.add_argument("--jobs", type=int, default=1_000_000, help="the backlog to drain")
    args = parser.parse_args(argv)
    jobs = 2_000 if args.quick else args.jobs
    scaling_jobs = 1_000 if args.quick else 100_000
    lines = ["| benchmark | jobs/s | CPU per job | peak RSS of a worker |", "|---|---|---|---|"]
    with bench.scratch_database(args.url or os.environ.get("DATABASE_URL")) as url:
        engine = create_engine(url, pool_size=5)
        try:
            bench.Base.metadata.create_all(engine)
            info = bench.machine_info(engine)
            for n in (jobs // 10, jobs):
                rate, cpu, rss = drain(url, engine, n, 1)
                lines.append(f"| drain {n:,} jobs, 1 process x 4 threads | {rate:,.0f} | {cpu:,.0f} µs | {rss:,} MiB |")
                bench.say(lines[-1])
            for processes in (1, 2, 3, 4):
                rate, cpu, rss = drain(url, engine, scaling_jobs, processes)
                lines.append(
                    f"| {scaling_jobs:,} jobs, {processes} process{'es' if processes > 1 else ''} x 4 threads "
                    f"| {rate:,.0f} | {cpu:,.0f} µs | {rss:,} MiB |"
                )
                bench.say(lines[-1])
        finally:
            engine.dispose()
    print(f"## Draining a backlog{bench.QUICK_NOTE if args.quick else ''}\n\n{info}\n\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
