"""Per-job cost in one table: sqla_queue against the raw psycopg loop at its best, one run.

    python benchmarks/cost.py [--quick] [--url URL] [--rounds N] [--jobs N]

The table of the per-job cost issue, every figure measured in the same run, in rounds
whose order turns from round to round (medians), each with the CPU time per job of the
processes that did the work (user + system; for processing, the worker processes only):

- processing, no-op handler, jobs loaded beforehand (the harness's ``run_processing``):
  the raw loop at its best (one thread a process, ``RAW_BEST_BATCH`` rows a claim, and
  500), the matched raw loop (4 threads a process, 32 rows a claim: the Worker's
  defaults), the thread ``Worker`` at its defaults (1 and 2 processes) and the
  ``AsyncWorker`` at its defaults (1 process);
- enqueue, one job per transaction: ``enqueue_values()`` on one open Connection (``with
  conn.begin()``) and in ``engine.begin()``, against ``INSERT`` + ``pg_notify`` +
  ``commit()`` on one psycopg connection;
- bulk: ``enqueue_many(method="copy")`` against a raw ``COPY`` of the same rows.

Each processing row gives its ratio to the raw best at its process count and to the
matched raw loop. A quiet machine matters: on a busy one the CPU per job is the steadier
figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import async_processing
import harness as bench  # benchmarks/harness.py: the shared harness
from sqlalchemy import URL, Engine, create_engine, insert
from sqlalchemy.orm import Session

from sqla_queue import enqueue_many, enqueue_values

#: The Worker's defaults: 4 executor threads, batches of up to 32.
DEFAULT_THREADS = 4


def processing_runs(jobs: int) -> dict[str, tuple[str, bench.Processing, Callable[..., None] | None]]:
    """Label -> (kind, configuration, child) of every processing run."""
    child = async_processing.async_child
    runs: dict[str, tuple[str, bench.Processing, Callable[..., None] | None]] = {}
    for procs in (1, 2):
        for batch in (bench.RAW_BEST_BATCH, 500):
            runs[f"raw best, batch {batch}, {procs}p"] = ("raw", bench.Processing(procs, 1, batch, jobs), None)
        runs[f"matched raw, {procs}p"] = (
            "raw", bench.Processing(procs, DEFAULT_THREADS, bench.BASELINE_BATCH, jobs), None,
        )
        runs[f"Worker, {procs}p"] = ("sqla_queue", bench.Processing(procs, DEFAULT_THREADS, 0, jobs), None)
    runs["AsyncWorker, 1p"] = ("async_sqla_queue", bench.Processing(1, DEFAULT_THREADS, 0, jobs), child)
    return runs


def bench_enqueue(engine: Engine, url: URL, txns: int, rounds: int) -> dict[str, tuple[list[float], list[float]]]:
    """One job per transaction: rates and CPU µs per job of each side, by label."""
    raw = bench.raw_connect(url)
    held = engine.connect()
    table = bench.BenchJob

    def base(n: int) -> float:
        start = time.perf_counter()
        for i in range(n):
            raw.execute("INSERT INTO bench_jobs (recipient) VALUES (%s)", (f"u{i}@example.com",))
            raw.execute(bench.RAW_NOTIFY, (bench.CHANNEL, "default"))
            raw.commit()
        return n / (time.perf_counter() - start)

    def on_held(n: int) -> float:
        start = time.perf_counter()
        for i in range(n):
            with held.begin():
                enqueue_values(held, table, {"recipient": f"u{i}@example.com"})
        return n / (time.perf_counter() - start)

    def in_begin(n: int) -> float:
        start = time.perf_counter()
        for i in range(n):
            with engine.begin() as conn:
                enqueue_values(conn, table, {"recipient": f"u{i}@example.com"})
        return n / (time.perf_counter() - start)

    sides = {"raw INSERT + NOTIFY": base, "enqueue_values, one open Connection": on_held,
             "enqueue_values, engine.begin()": in_begin}
    out: dict[str, tuple[list[float], list[float]]] = {label: ([], []) for label in sides}
    try:
        for side in sides.values():
            side(20)  # warm: caches, prepared statements
        labels = list(sides)
        for r in range(rounds):
            for label in labels[r % len(labels):] + labels[: r % len(labels)]:
                cpu = bench.cpu_seconds()
                out[label][0].append(sides[label](txns))
                out[label][1].append((bench.cpu_seconds() - cpu) / txns * 1e6)
    finally:
        held.close()
        raw.close()
    bench.reset(engine)
    return out


def bench_copy(engine: Engine, url: URL, rows: int, rounds: int) -> dict[str, tuple[list[float], list[float]]]:
    """The same rows by ``enqueue_many(method="copy")`` and by a raw COPY: rows/s, CPU µs a row."""
    data = [{"order_id": i, "recipient": f"user{i}@example.com"} for i in range(rows)]

    def ours() -> None:
        with Session(engine) as session:
            enqueue_many(session, bench.BenchJob, data, method="copy")
            session.commit()

    def base() -> None:
        with bench.raw_connect(url) as conn, conn.cursor() as cur:
            with cur.copy("COPY bench_jobs (order_id, recipient) FROM STDIN") as copy:
                for row in data:
                    copy.write_row((row["order_id"], row["recipient"]))
            cur.execute(bench.RAW_NOTIFY, (bench.CHANNEL, "default"))
            conn.commit()

    sides = {"raw COPY": base, "enqueue_many(method='copy')": ours}
    out: dict[str, tuple[list[float], list[float]]] = {label: ([], []) for label in sides}
    with engine.connect() as conn:  # warm: the model's statements, a pooled connection
        conn.execute(insert(bench.BenchJob).values(recipient="warm"))
        conn.rollback()
    labels = list(sides)
    for r in range(rounds):
        for label in labels[r % 2:] + labels[: r % 2]:
            bench.reset(engine)
            bench.vacuum_analyze(url)
            cpu = bench.cpu_seconds()
            start = time.perf_counter()
            sides[label]()
            out[label][0].append(rows / (time.perf_counter() - start))
            out[label][1].append((bench.cpu_seconds() - cpu) / rows * 1e6)
    bench.reset(engine)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the harness")
    parser.add_argument("--url", help="admin URL of the server (default: DATABASE_URL, else embedded)")
    parser.add_argument("--rounds", type=int, help="rounds of every measure (default 3, quick 1)")
    parser.add_argument("--jobs", type=int, help="jobs per processing run (default 20,000, quick 300)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    jobs = args.jobs or (300 if args.quick else 20_000)
    txns, copy_rows = (20, 2_000) if args.quick else (400, 50_000)
    started = time.perf_counter()
    with bench.scratch_database(args.url or os.environ.get("DATABASE_URL")) as url:
        engine = create_engine(url, pool_size=4)
        try:
            bench.Base.metadata.create_all(engine)
            info = bench.machine_info(engine)
            runs = processing_runs(jobs)
            rates: dict[str, list[float]] = {label: [] for label in runs}
            cpus: dict[str, list[float]] = {label: [] for label in runs}
            labels = list(runs)
            for r in range(rounds):
                shift = r * 3 % len(labels)
                for label in labels[shift:] + labels[:shift]:
                    kind, cfg, child = runs[label]
                    rate, cpu = bench.run_processing(url, engine, kind, cfg, child=child)
                    rates[label].append(rate)
                    cpus[label].append(cpu)
                    bench.say(f"  {label}: {rate:,.0f} jobs/s, {cpu:,.1f} µs CPU/job")
            enqueue = bench_enqueue(engine, url, txns, rounds)
            copy = bench_copy(engine, url, copy_rows, rounds)
        finally:
            engine.dispose()
    took = time.perf_counter() - started

    def med(values: list[float]) -> float:
        return statistics.median(values)

    best = {p: max((med(rates[f"raw best, batch {b}, {p}p"]), b) for b in (bench.RAW_BEST_BATCH, 500))
            for p in (1, 2)}
    lines = [
        f"## Per-job cost{bench.QUICK_NOTE if args.quick else ''}", "", info,
        (f"- {jobs:,} jobs a processing run, {txns} transactions an enqueue run, {copy_rows:,} rows a COPY, "
         f"medians of {rounds} round(s); the whole run took {took:.0f} s"), "",
        "| measure | rate | CPU µs/job | / raw best | / matched raw |", "|---|---:|---:|---:|---:|",
    ]
    for label in labels:
        procs = 2 if label.endswith("2p") else 1
        matched = med(rates[f"matched raw, {procs}p"])
        rate = med(rates[label])
        lines.append(f"| processing, {label} | {rate:,.0f} jobs/s | {med(cpus[label]):,.1f} | "
                     f"{rate / best[procs][0]:.2f}x | {rate / matched:.2f}x |")
    for results, unit, base_label in ((enqueue, "txn/s", "raw INSERT + NOTIFY"), (copy, "rows/s", "raw COPY")):
        base = med(results[base_label][0])
        for label, (values, cpu) in results.items():
            lines.append(f"| {label} | {med(values):,.0f} {unit} | {med(cpu):,.1f} | {med(values) / base:.2f}x | — |")
    lines += ["", f"Raw best: batch {best[1][1]} at 1 process, batch {best[2][1]} at 2 processes."]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
