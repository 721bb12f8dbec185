"""Flow control's cost: a worker draining jobs spread over 1,000 keys, with a
concurrency rule on the key and without one; and how close a rate limit's achieved
rate comes to its limit.

    python benchmarks/flow.py [--quick] [--url URL] [--jobs N] [--rounds R]

Two tables with the same columns (the mixin's and an ``account`` key): one plain, one
declaring ``Concurrency(1, key="account")``. Each round loads ``--jobs`` pending jobs
over 1,000 accounts into each, and the same worker processes (``--processes``, four
executors each, default batch, a no-op handler) drain them, the two tables in turn,
alternating which goes first. Reported: jobs/s and the worker processes' CPU per job,
medians of the rounds, and the ratio of the rule's rate to the plain one (the target:
at least 0.7).

**Rate**: a table with ``RateLimit(RATE, per=1.0)`` (strict, then the default mode)
and more jobs than ``RATE_WINDOWS`` seconds let start; one worker process drains it.
The achieved rate is the starts within the first ``RATE_WINDOWS`` whole seconds after
the first start, over that time, from the rows' ``started_at`` (the target: within 5 %
of the limit, never above it in strict mode).

It reuses ``benchmarks/harness.py``'s scratch database and process helpers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as bench
from sqlalchemy import BigInteger, create_engine, make_url
from sqlalchemy.engine import URL
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqla_queue import Concurrency, JobMixin, RateLimit, Worker

KEYS = 1000
RATE = 500
RATE_WINDOWS = 8


class Base(DeclarativeBase):
    pass


class PlainJob(Base, JobMixin):
    __tablename__ = "flow_plain_jobs"
    account: Mapped[int] = mapped_column(BigInteger)


class KeyedJob(Base, JobMixin):
    __tablename__ = "flow_keyed_jobs"
    __queue_flow__ = Concurrency(1, key="account")
    account: Mapped[int] = mapped_column(BigInteger)


class StrictRatedJob(Base, JobMixin):
    __tablename__ = "flow_strict_rated_jobs"
    __queue_flow__ = RateLimit(RATE, per=1.0, strict=True)
    account: Mapped[int] = mapped_column(BigInteger)


class RatedJob(Base, JobMixin):
    __tablename__ = "flow_rated_jobs"
    __queue_flow__ = RateLimit(RATE, per=1.0)
    account: Mapped[int] = mapped_column(BigInteger)


MODELS: dict[str, Any] = {
    "plain": PlainJob, "keyed": KeyedJob, "strict rate": StrictRatedJob, "rate": RatedJob,
}


def _child(kind: str, url_text: str, concurrency: int, ready: Any, go: Any, stop: Any) -> None:
    engine = create_engine(make_url(url_text), pool_size=concurrency + 3)
    worker = Worker(engine, MODELS[kind], bench.noop, concurrency=concurrency)
    engine.connect().close()
    ready.put(os.getpid())
    go.wait()
    cpu = bench.cpu_seconds()
    worker.start()
    stop.wait()
    cpu = bench.cpu_seconds() - cpu
    worker.stop(grace=10)
    engine.dispose()
    ready.put(cpu)


def drain(url: URL, kind: str, jobs: int, processes: int) -> tuple[float, float]:
    """Jobs/s and CPU µs per job of ``processes`` workers draining ``jobs`` of ``kind``."""
    table = MODELS[kind].__tablename__
    with bench.raw_connect(url, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {table} RESTART IDENTITY")
        conn.execute(f"INSERT INTO {table} (account) SELECT i %% {KEYS} FROM generate_series(1, %s) AS i", (jobs,))
        conn.execute(f"VACUUM ANALYZE {table}")
    ctx = bench.process_context()
    ready = ctx.Queue()
    go, stop = ctx.Event(), ctx.Event()
    url_text = url.render_as_string(hide_password=False)
    procs = [ctx.Process(target=_child, args=(kind, url_text, 4, ready, go, stop), daemon=True)
             for _ in range(processes)]
    for proc in procs:
        proc.start()
    try:
        bench.wait_ready(ready, procs)
        with bench.raw_connect(url, autocommit=True) as watch:
            go.set()
            start = time.perf_counter()
            while True:
                row = watch.execute(
                    f"SELECT EXISTS (SELECT 1 FROM {table} WHERE status = 'pending') "
                    f"OR EXISTS (SELECT 1 FROM {table} WHERE status = 'running')"
                ).fetchone()
                if not (row and row[0]):
                    break
                if time.perf_counter() - start > 600 or any(p.exitcode is not None for p in procs):
                    raise RuntimeError(f"{kind}: a process died or jobs are stuck")
                time.sleep(0.005)
            elapsed = time.perf_counter() - start
            done = watch.execute(f"SELECT count(*) FROM {table} WHERE status = 'done'").fetchone()
        if not done or done[0] != jobs:
            raise RuntimeError(f"{kind}: {done} of {jobs} done")
        stop.set()
        cpu = sum(ready.get(timeout=60) for _ in procs)
    finally:
        bench.end_processes(procs, stop)
    return jobs / elapsed, cpu / jobs * 1e6


def achieved_rate(url: URL, kind: str, processes: int, windows: int = RATE_WINDOWS) -> tuple[float, int]:
    """Starts per second within the first ``windows`` whole seconds after the first
    start, and the most starts of any one-second window, from ``started_at``."""
    jobs = RATE * (windows + 2)
    drain(url, kind, jobs, processes)
    table = MODELS[kind].__tablename__
    with bench.raw_connect(url, autocommit=True) as conn:
        starts = sorted(float(r[0]) for r in conn.execute(f"SELECT extract(epoch FROM started_at) FROM {table}"))
    first = starts[0]
    within = sum(1 for t in starts if t < first + windows)
    most, low = 0, 0
    for high, moment in enumerate(starts):
        while moment - starts[low] >= 1.0:
            low += 1
        most = max(most, high - low + 1)
    return within / windows, most


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the harness")
    parser.add_argument("--url", help="admin URL of the server (default: DATABASE_URL, else embedded)")
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args(argv)
    jobs, rounds = (2000, 1) if args.quick else (args.jobs, args.rounds)
    rates: dict[str, list[float]] = {k: [] for k in MODELS}
    cpus: dict[str, list[float]] = {k: [] for k in MODELS}
    rate_rows: dict[str, list[tuple[float, int]]] = {"strict rate": [], "rate": []}
    with bench.scratch_database(args.url or os.environ.get("DATABASE_URL")) as url:
        engine = create_engine(url)
        Base.metadata.create_all(engine)
        engine.dispose()
        for r in range(rounds):
            for kind in (("plain", "keyed") if r % 2 == 0 else ("keyed", "plain")):
                rate, cpu = drain(url, kind, jobs, args.processes)
                rates[kind].append(rate)
                cpus[kind].append(cpu)
                bench.say(f"  round {r + 1} {kind}: {rate:,.0f} jobs/s, {cpu:,.0f} µs CPU/job")
        for r in range(1 if args.quick else 2):
            for kind in rate_rows:
                rate_rows[kind].append(achieved_rate(url, kind, args.processes, 2 if args.quick else RATE_WINDOWS))
                bench.say(f"  rate round {r + 1} {kind}: {rate_rows[kind][-1]}")
    plain, keyed = (statistics.median(rates[k]) for k in ("plain", "keyed"))
    print(f"\n## Flow control: {jobs:,} jobs over {KEYS:,} keys, {args.processes} worker process(es) x 4\n")
    print("| table | jobs/s (median; range) | CPU µs/job (median) |")
    print("|---|---:|---:|")
    for kind, label in (("plain", "no rule"), ("keyed", 'Concurrency(1, key="account")')):
        print(f"| {label} | {statistics.median(rates[kind]):,.0f} ({min(rates[kind]):,.0f}-{max(rates[kind]):,.0f}) "
              f"| {statistics.median(cpus[kind]):,.0f} |")
    print(f"\nratio with the rule to without: {keyed / plain:.2f} (target at least 0.70)")
    if rate_rows:
        print(f"\n## Rate limits: RateLimit({RATE}, per=1.0), {args.processes} worker process(es) x 4\n")
        print("| mode | achieved starts/s (rounds) | ratio to the limit | most starts in any second |")
        print("|---|---:|---:|---:|")
        for kind, results in rate_rows.items():
            achieved = [r[0] for r in results]
            print(f"| {kind} | {statistics.median(achieved):,.0f} ({', '.join(f'{a:,.0f}' for a in achieved)}) "
                  f"| {statistics.median(achieved) / RATE:.3f} | {max(r[1] for r in results)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
