"""Workflows' cost: jobs without dependencies on a table that keeps workflows against a
plain table, a fan-out of one parent into N children and a fan-in of N parents into one
child against N plain jobs, and the time from a parent's completion to its child's start.

    python benchmarks/workflows.py [--quick] [--url URL] [--jobs N] [--rounds R]

Two tables with the mixin's columns: ``wf_plain_jobs`` (``JobMixin``) and
``wf_flow_jobs`` (``JobMixin`` + ``WorkflowMixin``). The rows are written by SQL (the
edges as ``enqueue_workflow()`` writes them), so what is measured is the processing:
the same worker processes (``--processes``, four executors each, default batch, a no-op
handler) drain each load, the kinds in turn, their order alternating by round.
Reported: jobs/s from the first start to the last job done, the worker processes' CPU
per job, medians of the rounds, and each ratio to the plain drain of the same round
(the target for jobs without dependencies: at least 0.97).

**Release latency**: one chain of ``--chain`` jobs, each waiting for the one before, so
one runs at a time on otherwise idle workers; for each job, its ``started_at`` minus its
parent's ``finished_at`` (the completion that released it, a moment before its
commit), p50 and p99.

It reuses ``benchmarks/harness.py``'s scratch database and process helpers.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as bench
from sqlalchemy import create_engine, make_url
from sqlalchemy.engine import URL
from sqlalchemy.orm import DeclarativeBase

from sqla_queue import JobMixin, Worker, WorkflowMixin


class Base(DeclarativeBase):
    pass


class PlainJob(Base, JobMixin):
    __tablename__ = "wf_plain_jobs"


class FlowJob(Base, JobMixin, WorkflowMixin):
    __tablename__ = "wf_flow_jobs"


MODELS: dict[str, Any] = {"plain": PlainJob, "flow": FlowJob}
WAITING = "'9999-12-30 00:00:00+00'"
#: What each load is: the table, and the SQL that writes ``n`` jobs into it.
LOADS: dict[str, tuple[str, str]] = {
    "plain": ("plain", "INSERT INTO wf_plain_jobs (queue) SELECT 'default' FROM generate_series(1, {n})"),
    "no dependencies": ("flow", "INSERT INTO wf_flow_jobs (queue) SELECT 'default' FROM generate_series(1, {n})"),
    # One parent (id 1) and n - 1 children waiting for it.
    "fan-out": ("flow", (
        "INSERT INTO wf_flow_jobs (id, child_ids) OVERRIDING SYSTEM VALUE "
        "SELECT 1, array(SELECT generate_series(2, {n})::bigint);"
        "INSERT INTO wf_flow_jobs (id, parent_ids, waiting_on, run_after) OVERRIDING SYSTEM VALUE "
        "SELECT i, ARRAY[1]::bigint[], 1, " + WAITING + " FROM generate_series(2, {n}) AS i;"
        "SELECT setval(pg_get_serial_sequence('wf_flow_jobs', 'id'), {n})"
    )),
    # n - 1 parents and one child (id n) waiting for all of them.
    "fan-in": ("flow", (
        "INSERT INTO wf_flow_jobs (id, child_ids) OVERRIDING SYSTEM VALUE "
        "SELECT i, ARRAY[{n}]::bigint[] FROM generate_series(1, {n} - 1) AS i;"
        "INSERT INTO wf_flow_jobs (id, parent_ids, waiting_on, run_after) OVERRIDING SYSTEM VALUE "
        "SELECT {n}, array(SELECT generate_series(1, {n} - 1)::bigint), {n} - 1, " + WAITING + ";"
        "SELECT setval(pg_get_serial_sequence('wf_flow_jobs', 'id'), {n})"
    )),
    # The same parents' shape spread over 100 children (parent i into child i mod 100):
    # the statements of "fan-in" without one row that every completion writes, so the
    # ratio of the two is what sharing that row costs.
    "fan-in x100": ("flow", (
        "INSERT INTO wf_flow_jobs (id, child_ids) OVERRIDING SYSTEM VALUE "
        "SELECT i, ARRAY[{n} - 100 + 1 + i % 100]::bigint[] FROM generate_series(1, {n} - 100) AS i;"
        "INSERT INTO wf_flow_jobs (id, parent_ids, waiting_on, run_after) OVERRIDING SYSTEM VALUE "
        "SELECT {n} - 100 + 1 + k, "
        "array(SELECT i FROM generate_series(1, {n} - 100) AS i WHERE i % 100 = k)::bigint[], "
        "(SELECT count(*) FROM generate_series(1, {n} - 100) AS i WHERE i % 100 = k), " + WAITING + " "
        "FROM generate_series(0, 99) AS k;"
        "SELECT setval(pg_get_serial_sequence('wf_flow_jobs', 'id'), {n})"
    )),
    # One chain of n jobs: job i waits for job i - 1, so one runs at a time and each
    # start is a release's latency with the workers otherwise idle.
    "chain": ("flow", (
        "INSERT INTO wf_flow_jobs (id, child_ids, parent_ids, waiting_on, run_after) OVERRIDING SYSTEM VALUE "
        "SELECT i, CASE WHEN i < {n} THEN ARRAY[i + 1]::bigint[] END, "
        "CASE WHEN i > 1 THEN ARRAY[i - 1]::bigint[] END, (i > 1)::int, "
        "CASE WHEN i > 1 THEN " + WAITING + "::timestamptz ELSE now() END "
        "FROM generate_series(1, {n}) AS i;"
        "SELECT setval(pg_get_serial_sequence('wf_flow_jobs', 'id'), {n})"
    )),
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


def drain(url: URL, load: str, jobs: int, processes: int) -> tuple[float, float, float]:
    """Jobs/s and CPU µs per job of ``processes`` workers draining ``load`` of ``jobs``, and
    how many of their connections waited for a lock, on average over the drain (sampled
    from ``pg_stat_activity``): a completion waiting for another's row shows there."""
    kind, sql = LOADS[load]
    table = MODELS[kind].__tablename__
    with bench.raw_connect(url, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {table} RESTART IDENTITY")
        for statement in sql.format(n=jobs).split(";"):
            conn.execute(statement)
        conn.execute(f"VACUUM ANALYZE {table}")
    ctx = mp.get_context("spawn")
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
            samples = waiting = 0
            while True:
                row = watch.execute(
                    f"SELECT EXISTS (SELECT 1 FROM {table} WHERE status IN ('pending', 'running')), "
                    "(SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock')"
                ).fetchone()
                if not (row and row[0]):
                    break
                samples, waiting = samples + 1, waiting + int(row[1])
                if time.perf_counter() - start > 600 or any(p.exitcode is not None for p in procs):
                    raise RuntimeError(f"{load}: a process died or jobs are stuck")
                time.sleep(0.005)
            done = watch.execute(
                f"SELECT count(*), extract(epoch FROM max(finished_at) - min(started_at)) FROM {table} "
                "WHERE status = 'done'"
            ).fetchone()
        if not done or done[0] != jobs:
            raise RuntimeError(f"{load}: {done} of {jobs} done")
        elapsed = float(done[1])
        stop.set()
        cpu = sum(ready.get(timeout=60) for _ in procs)
    finally:
        bench.end_processes(procs, stop)
    return jobs / elapsed, cpu / jobs * 1e6, waiting / max(samples, 1)


def release_latencies(url: URL) -> list[float]:
    """Each job's start after its parent's completion, in ms, from the last ``chain``."""
    with bench.raw_connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT extract(epoch FROM c.started_at - p.finished_at) * 1000 FROM wf_flow_jobs AS c "
            "JOIN wf_flow_jobs AS p ON p.id = c.parent_ids[1] ORDER BY 1"
        ).fetchall()
    return [float(r[0]) for r in rows]


def percentile(values: list[float], p: float) -> float:
    return values[min(len(values) - 1, int(p / 100 * len(values)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the harness")
    parser.add_argument("--url", help="admin URL of the server (default: DATABASE_URL, else embedded)")
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--chain", type=int, default=500, help="the chain's length (0: no latency measured)")
    parser.add_argument("--loads", default="plain,no dependencies,fan-out,fan-in,fan-in x100",
                        help="which loads, comma-separated (plain is always one: the ratios' base)")
    args = parser.parse_args(argv)
    jobs, rounds, chain = (400, 1, 30) if args.quick else (args.jobs, args.rounds, args.chain)
    chosen = [name.strip() for name in args.loads.split(",")]
    unknown = set(chosen) - (set(LOADS) - {"chain"})
    if unknown:
        parser.error(f"unknown loads: {', '.join(sorted(unknown))}")
    loads = tuple(dict.fromkeys(["plain", *chosen]))
    rates: dict[str, list[float]] = {k: [] for k in loads}
    cpus: dict[str, list[float]] = {k: [] for k in loads}
    locks: dict[str, list[float]] = {k: [] for k in loads}
    ratios: dict[str, list[float]] = {k: [] for k in loads}
    latencies: list[float] = []
    with bench.scratch_database(args.url or os.environ.get("DATABASE_URL")) as url:
        engine = create_engine(url)
        Base.metadata.create_all(engine)
        engine.dispose()
        for r in range(rounds):
            order = loads if r % 2 == 0 else tuple(reversed(loads))
            for load in order:
                rate, cpu, waiting = drain(url, load, jobs, args.processes)
                rates[load].append(rate)
                cpus[load].append(cpu)
                locks[load].append(waiting)
                bench.say(f"  round {r + 1} {load}: {rate:,.0f} jobs/s, {cpu:,.0f} µs CPU/job, "
                          f"{waiting:.2f} connections waiting for a lock")
            if chain:
                drain(url, "chain", chain, args.processes)
                latencies.extend(release_latencies(url))
            for load in loads:
                ratios[load].append(rates[load][-1] / rates["plain"][-1])
    print(f"\n## Workflows: {jobs:,} jobs a load, {args.processes} worker process(es) x 4, {rounds} round(s)\n")
    print("| load | jobs/s (median; range) | CPU µs/job (median) | ratio to plain (median of rounds) "
          "| connections waiting for a lock (mean) |")
    print("|---|---:|---:|---:|---:|")
    labels = {
        "plain": "plain table", "no dependencies": "workflow table, no dependencies",
        "fan-out": f"fan-out 1 -> {jobs - 1:,}", "fan-in": f"fan-in {jobs - 1:,} -> 1",
        "fan-in x100": f"fan-in {jobs - 100:,} -> 100 (parent i into child i mod 100)",
    }
    for load in loads:
        print(f"| {labels[load]} | {statistics.median(rates[load]):,.0f} "
              f"({min(rates[load]):,.0f}-{max(rates[load]):,.0f}) | {statistics.median(cpus[load]):,.0f} "
              f"| {statistics.median(ratios[load]):.2f} | {statistics.median(locks[load]):.2f} |")
    if "no dependencies" in loads:
        print(f"\nno dependencies to plain: {statistics.median(ratios['no dependencies']):.2f} (target at least 0.97)")
    latencies.sort()
    if not latencies:
        return 0
    print(f"\nrelease latency, a parent's completion to its child's start (a chain of {chain:,}): "
          f"p50 {percentile(latencies, 50):.1f} ms, p99 {percentile(latencies, 99):.1f} ms "
          f"({len(latencies):,} releases)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
