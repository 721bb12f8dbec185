"""What one no-op job costs in Python: a profile of the whole path, per job.

    python benchmarks/job_cost.py [--jobs N] [--side thread|async|raw ...] [--top K] [--url URL]

Each side drains ``--jobs`` preloaded jobs (the harness's table and loader) in this very
process, under ``cProfile`` timed by the thread's CPU clock (``time.thread_time``: the
wall clock counts the waits, and a busy machine's), and prints the Python calls per job
and the functions that took the most CPU per job (own, or ``--cumulative``), then the
functions called once a job or more:

- ``thread``: the thread ``Worker`` at default options but ``concurrency=1`` (one
  executor thread: the claim's rows to the instances, the handler call, the completion
  and the next claim, all on that thread), the profile taken in that thread;
- ``async``: the ``AsyncWorker``, ``concurrency=1``, an ``async def`` no-op, the profile
  taken in the event loop's thread (its executor's greenlet and the loop);
- ``raw``: the hand-written psycopg loop at its best batch (the harness's
  ``RAW_BEST_BATCH`` rows a claim, one transaction each, then one completing UPDATE).

Without ``--profile`` it only times: jobs/s, CPU µs per job of this process (user +
system) and of the thread that ran the jobs (``time.thread_time``), for each side in
turn, ``--rounds`` interleaved rounds. The figures of one
process on a shared machine are noisy: compare sides of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as bench  # benchmarks/harness.py: the shared harness
from sqlalchemy import URL, Engine, create_engine

from sqla_queue import AsyncWorker, Worker
from sqla_queue.worker import executor as executor_module

#: Seconds between two looks at the table while a side drains it: the look runs in the
#: measured process, so it must cost next to nothing against the jobs' CPU time.
WATCH_INTERVAL = 0.02


def _drain_wait(url: URL, jobs: int) -> None:
    """Until every job is done (checks the count: every job once)."""
    with bench.raw_connect(url, autocommit=True) as watch:
        deadline = time.monotonic() + 300
        while bench.unfinished(watch):
            if time.monotonic() > deadline:
                raise RuntimeError("jobs are stuck")
            time.sleep(WATCH_INTERVAL)
        row = watch.execute("SELECT count(*) FILTER (WHERE status = 'done') FROM bench_jobs").fetchone()
    if not row or row[0] != jobs:
        raise RuntimeError(f"{row} of {jobs} done")


#: The CPU seconds (``time.thread_time``) of the thread that ran the jobs, by the last run
#: of each side: the executor thread, the event loop's thread, the raw loop's. Beside the
#: process's CPU, it leaves out the other threads and the watcher, and a busy machine's
#: waits: the figure a cut of the per-job path moves.
JOB_THREAD_CPU: dict[str, float] = {}
#: Options of both workers beyond ``concurrency=1`` (``--batch-size``).
WORKER_OPTIONS: dict[str, Any] = {}


def run_thread(url: URL, jobs: int, profile: cProfile.Profile | None) -> float:
    """The thread Worker, one executor; returns the seconds to drain."""
    engine = create_engine(url)
    worker = Worker(engine, bench.BenchJob, bench.noop, concurrency=1, **WORKER_OPTIONS)
    original = executor_module.ExecutorPool._thread

    def measured(self: Any, index: int) -> None:
        cpu = time.thread_time()
        try:
            if profile is not None:
                profile.runcall(original, self, index)
            else:
                original(self, index)
        finally:
            JOB_THREAD_CPU["thread"] = time.thread_time() - cpu

    executor_module.ExecutorPool._thread = measured  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        worker.start()
        _drain_wait(url, jobs)
        took = time.perf_counter() - start
        worker.stop(grace=10)
    finally:
        executor_module.ExecutorPool._thread = original  # type: ignore[method-assign]
        engine.dispose()
    return took


async def _anoop(job: Any) -> None:
    pass


def run_async(url: URL, jobs: int, profile: cProfile.Profile | None) -> float:
    """The AsyncWorker, one executor task; the profile covers the loop's thread."""
    from sqlalchemy.ext.asyncio import create_async_engine

    async def main() -> float:
        engine = create_async_engine(url.set(drivername="postgresql+psycopg"))
        worker = AsyncWorker(engine, bench.BenchJob, _anoop, concurrency=1, **WORKER_OPTIONS)
        start = time.perf_counter()
        cpu = time.thread_time()
        await worker.start()
        await asyncio.to_thread(_drain_wait, url, jobs)
        took = time.perf_counter() - start
        JOB_THREAD_CPU["async"] = time.thread_time() - cpu
        await worker.stop(grace=10)
        await engine.dispose()
        return took

    if profile is None:
        return asyncio.run(main())
    result: list[float] = []
    profile.runcall(lambda: result.append(asyncio.run(main())))
    return result[0]


def run_raw(url: URL, jobs: int, profile: cProfile.Profile | None) -> float:
    """The raw loop at its best batch, one connection."""
    sql, params = bench.claim_sql(create_engine(url), "raw", bench.RAW_BEST_BATCH)
    conn = bench.raw_connect(url)
    try:
        start = time.perf_counter()
        cpu = time.thread_time()
        if profile is not None:
            profile.runcall(bench.raw_processing_loop, conn, sql, params, "raw")
        else:
            bench.raw_processing_loop(conn, sql, params, "raw")
        JOB_THREAD_CPU["raw"] = time.thread_time() - cpu
        took = time.perf_counter() - start
    finally:
        conn.close()
    return took


SIDES: dict[str, Callable[[URL, int, cProfile.Profile | None], float]] = {
    "raw": run_raw,
    "thread": run_thread,
    "async": run_async,
}


def report(side: str, profile: cProfile.Profile, jobs: int, top: int, cumulative: bool = False) -> str:
    stats = pstats.Stats(profile)
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    calls = sum(nc for (_cc, nc, _tt, _ct, _callers) in raw.values())
    total = sum(tt for (_cc, _nc, tt, _ct, _callers) in raw.values())
    rows = sorted(raw.items(), key=lambda item: item[1][3 if cumulative else 2], reverse=True)[:top]
    lines = [
        (f"### {side}: {calls / jobs:.1f} Python calls per job, {total / jobs * 1e6:.1f} µs of profiled CPU "
         "time (thread_time, with the profiler's own) per job"),
        "",
        "| function | calls/job | own µs/job | cumulative µs/job |",
        "|---|---:|---:|---:|",
    ]
    for (filename, line, name), (_cc, nc, tt, ct, _callers) in rows:
        where = _where(filename, line, name)
        lines.append(f"| {where} | {nc / jobs:.2f} | {tt / jobs * 1e6:.2f} | {ct / jobs * 1e6:.2f} |")
    per_job = sorted(((nc, key) for key, (_cc, nc, _tt, _ct, _callers) in raw.items() if nc >= 0.5 * jobs),
                     key=lambda item: -item[0])
    lines += ["", "Called about once a job or more (calls/job, and from where): " + "; ".join(
        f"{_where(*key)} {nc / jobs:.1f}"
        + (" [" + ", ".join(f"{_where(*c)} {v[0] / jobs if isinstance(v, tuple) else v / jobs:.1f}"
                            for c, v in raw[key][4].items() if (v[0] if isinstance(v, tuple) else v) >= 0.2 * jobs)
           + "]" if nc >= 2 * jobs or key[0] == "~" else "")
        for nc, key in per_job)]
    return "\n".join(lines)


def _where(filename: str, line: int, name: str) -> str:
    return f"{Path(filename).name}:{line}({name})" if line else name


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--side", action="append", choices=list(SIDES))
    parser.add_argument("--profile", action="store_true", help="profile (else time: jobs/s, CPU µs/job)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per side (without --profile)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--cumulative", action="store_true", help="the top functions by cumulative time")
    parser.add_argument("--raw-batch", type=int, help=f"the raw loop's batch (default {bench.RAW_BEST_BATCH})")
    parser.add_argument("--batch-size", type=int, help="the workers' batch_size (default: theirs)")
    parser.add_argument("--url", help="admin URL of the server (default: DATABASE_URL, else embedded)")
    args = parser.parse_args(argv)
    sides = args.side or list(SIDES)
    if args.raw_batch:
        bench.RAW_BEST_BATCH = args.raw_batch
    if args.batch_size:
        WORKER_OPTIONS["batch_size"] = args.batch_size
    with bench.scratch_database(args.url or os.environ.get("DATABASE_URL")) as url:
        engine: Engine = create_engine(url)
        try:
            bench.Base.metadata.create_all(engine)
            # Warm every side once: imports, first connections, statement caches.
            for side in sides:
                bench.reset(engine)
                bench.load_pending(url, 500)
                SIDES[side](url, 500, None)
            if args.profile:
                for side in sides:
                    bench.reset(engine)
                    bench.load_pending(url, args.jobs)
                    # CPU time, steadier than the wall clock on a busy machine.
                    profile = cProfile.Profile(time.thread_time)
                    SIDES[side](url, args.jobs, profile)
                    print(report(side, profile, args.jobs, args.top, args.cumulative), "\n", flush=True)
            else:
                rates: dict[str, list[float]] = {side: [] for side in sides}
                cpus: dict[str, list[float]] = {side: [] for side in sides}
                own: dict[str, list[float]] = {side: [] for side in sides}
                for r in range(args.rounds):
                    for side in sides[r % len(sides):] + sides[: r % len(sides)]:
                        bench.reset(engine)
                        bench.load_pending(url, args.jobs)
                        cpu = bench.cpu_seconds()
                        took = SIDES[side](url, args.jobs, None)
                        cpus[side].append((bench.cpu_seconds() - cpu) / args.jobs * 1e6)
                        own[side].append(JOB_THREAD_CPU[side] / args.jobs * 1e6)
                        rates[side].append(args.jobs / took)
                print("| side | jobs/s | CPU µs/job (this process) | CPU µs/job (the jobs' thread) |")
                print("|---|---:|---:|---:|")
                for side in sides:
                    print(f"| {side} | {statistics.median(rates[side]):,.0f} | {statistics.median(cpus[side]):.1f} "
                          f"| {statistics.median(own[side]):.1f} |")
        finally:
            bench.reset(engine)
            engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
