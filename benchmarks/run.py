"""sqla_queue against the same work written by hand on psycopg, in one run, as ratios.

    python benchmarks/run.py [--quick] [--url URL] [--output PATH]

``--url`` (or ``DATABASE_URL``) names an admin connection to a PostgreSQL server; without
either, an embedded PostgreSQL is started. A scratch database is created beside it and
dropped at the end (as ``bulk_crossover.py`` does).

Both sides use the same table (a ``JobMixin`` model with two user columns, created by
SQLAlchemy with the mixin's partial indexes). The baseline is what a competent engineer
would write directly on psycopg 3: ``INSERT`` + ``SELECT pg_notify`` + commit; ``COPY …
FROM STDIN``; pipelined ``executemany``; the claim SQL text compiled from
``sqla_queue.sql.claim`` (so the very same statement), executed as a prepared statement;
a plain batched completion ``UPDATE``; a plain ``LISTEN`` loop. The table, that SQL, the
worker-process runner and the results table are ``benchmarks/harness.py``'s, shared with
the other scripts; the async rows come from ``async_enqueue.py`` and ``async_processing.py``.

Every benchmark alternates sqla_queue and baseline runs and reports medians, because this
kind of machine is shared and noisy: only the ratios of figures measured side by side in
the same run mean anything. ``--quick`` runs every benchmark with tiny sizes, to check the
harness (CI runs it as a smoke test); its figures mean nothing.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import async_enqueue
import async_processing
import sqlalchemy
from harness import (
    CHANNEL,
    FULL,
    PICKUP_QUEUES,
    QUICK,
    QUICK_NOTE,
    RAW_BEST_BATCH,
    RAW_NOTIFY,
    Base,
    BenchJob,
    CpuClock,
    Order,
    Plan,
    Processing,
    Row,
    claim_sql,
    end_processes,
    load_pending,
    machine_info,
    markdown,
    percentile,
    pickup_child,
    process_context,
    raw_connect,
    reset,
    run_processing,
    say,
    scratch_database,
    throughput_row,
    vacuum_analyze,
    wait_ready,
)
from sqlalchemy import URL, Engine, create_engine, text
from sqlalchemy.orm import Session, sessionmaker

from sqla_queue import QueueSession, enqueue_many, enqueue_values
from sqla_queue import sql as q

# -- enqueue, one job per transaction ------------------------------------------------------


def bench_enqueue(engine: Engine, url: URL, plan: Plan) -> list[Row]:
    """The web-request pattern: one short transaction per job, with or without a business row.

    sqla_queue: a ``QueueSession`` per request, ``session.enqueue(job)`` (the ORM insert)
    and ``commit()``, whose ``before_commit`` hook sends the NOTIFY. Baseline: one open
    psycopg connection, ``INSERT``, ``SELECT pg_notify`` and ``commit()``. A third side,
    the same ORM insert and NOTIFY in a plain ``Session`` without sqla_queue, shows how
    much of the gap is SQLAlchemy's ORM itself.
    """
    factory = sessionmaker(engine, class_=QueueSession)
    raw = raw_connect(url)

    def ours(n: int, with_order: bool) -> float:
        start = time.perf_counter()
        for i in range(n):
            with factory() as session:
                if with_order:
                    order = Order(customer="ada")
                    session.add(order)
                    session.flush()
                    session.enqueue(BenchJob(order_id=order.id, recipient=f"u{i}@example.com"))
                else:
                    session.enqueue(BenchJob(recipient=f"u{i}@example.com"))
                session.commit()
        return n / (time.perf_counter() - start)

    def base(n: int, with_order: bool) -> float:
        start = time.perf_counter()
        for i in range(n):
            order_id = None
            if with_order:
                row = raw.execute(
                    "INSERT INTO bench_orders (customer) VALUES (%s) RETURNING id", ("ada",)
                ).fetchone()
                order_id = row[0] if row else None
            raw.execute(
                "INSERT INTO bench_jobs (order_id, recipient) VALUES (%s, %s)",
                (order_id, f"u{i}@example.com"),
            )
            raw.execute(RAW_NOTIFY, (CHANNEL, "default"))
            raw.commit()
        return n / (time.perf_counter() - start)

    notify = text("SELECT pg_notify(:channel, :queue)")

    def fast(n: int, with_order: bool) -> float:
        """The fast path: enqueue_values() in a plain Session, joining its transaction."""
        start = time.perf_counter()
        for i in range(n):
            with Session(engine) as session:
                order_id = None
                if with_order:
                    order = Order(customer="ada")
                    session.add(order)
                    session.flush()
                    order_id = order.id
                enqueue_values(session, BenchJob, {"order_id": order_id, "recipient": f"u{i}@example.com"})
                session.commit()
        return n / (time.perf_counter() - start)

    def plain_orm(n: int, with_order: bool) -> float:
        """The floor: the same ORM insert and NOTIFY without sqla_queue (a reference)."""
        start = time.perf_counter()
        for i in range(n):
            with Session(engine) as session:
                session.add(BenchJob(recipient=f"u{i}@example.com"))
                session.execute(notify, {"channel": CHANNEL, "queue": "default"})  # autoflushes
                session.commit()
        return n / (time.perf_counter() - start)

    def fast_conn(n: int, with_order: bool) -> float:
        """The fast path on a Core connection: ``with engine.begin() as conn``."""
        start = time.perf_counter()
        for i in range(n):
            with engine.begin() as conn:
                order_id = conn.execute(order_insert).scalar_one() if with_order else None
                enqueue_values(conn, BenchJob, {"order_id": order_id, "recipient": f"u{i}@example.com"})
        return n / (time.perf_counter() - start)

    order_insert = sqlalchemy.insert(Order).values(customer="ada").returning(Order.id)
    held = engine.connect()

    def fast_held(n: int, with_order: bool) -> float:
        """The fast path on one Connection kept open, as the baseline keeps its psycopg
        connection: the same transactions without a pool checkout and a Connection each."""
        start = time.perf_counter()
        for i in range(n):
            with held.begin():
                order_id = held.execute(order_insert).scalar_one() if with_order else None
                enqueue_values(held, BenchJob, {"order_id": order_id, "recipient": f"u{i}@example.com"})
        return n / (time.perf_counter() - start)

    rows = []
    try:
        for with_order in (False, True):
            sides: list[Callable[[int, bool], float]] = [ours, base, fast, fast_conn]
            if not with_order:
                sides += [plain_orm, fast_held]
            for side in sides:
                side(20, with_order)  # warm caches and prepared statements
            results: dict[Any, list[float]] = {side: [] for side in sides}
            clock = CpuClock()
            for r in range(plan.enqueue_rounds):
                for side in sides[r % len(sides):] + sides[: r % len(sides)]:
                    results[side].append(clock.timed(side, plan.enqueue_txns, with_order))
            cpu = clock.cpu
            suffix = " + ORM business row" if with_order else ""
            found = [
                throughput_row(f"enqueue, 1 job per transaction{suffix}", results[ours], results[base], "txn/s", None,
                               cpu[ours], cpu[base]),
                throughput_row(
                    f"enqueue, 1 job per transaction{suffix}, fast path (enqueue_values) in a Session",
                    results[fast], results[base], "txn/s", 0.8, cpu[fast], cpu[base],
                ),
                throughput_row(
                    f"enqueue, 1 job per transaction{suffix}, fast path (enqueue_values) on a Connection",
                    results[fast_conn], results[base], "txn/s", 0.8, cpu[fast_conn], cpu[base],
                ),
            ]
            if not with_order:
                found.append(throughput_row(
                    "enqueue, 1 job per transaction, fast path (enqueue_values) on one open Connection, "
                    "as the baseline keeps one (reference)",
                    results[fast_held], results[base], "txn/s", None, cpu[fast_held], cpu[base],
                ))
                found.append(throughput_row(
                    "enqueue, 1 job per transaction: plain SQLAlchemy ORM insert + pg_notify, "
                    "no sqla_queue (reference)",
                    results[plain_orm], results[base], "txn/s", None, cpu[plain_orm], cpu[base],
                ))
                # The target of session.enqueue(): at most 10 % slower than the plain ORM.
                vs_orm = throughput_row(
                    "enqueue, 1 job per transaction: session.enqueue() vs the plain ORM reference",
                    results[ours], results[plain_orm], "txn/s", 0.9, cpu[ours], cpu[plain_orm],
                )
                vs_orm.base = vs_orm.base + " (the reference)"
                found.append(vs_orm)
            for row in found:
                say(f"  {row.name}: {row.cells()[1:4]}")
            rows += found
            reset(engine)
    finally:
        held.close()
        raw.close()
    return rows


# -- bulk enqueue --------------------------------------------------------------------------


def bench_bulk(engine: Engine, url: URL, plan: Plan) -> list[Row]:
    """100k jobs in one transaction, from a list of dicts, committed, with the NOTIFY.

    sqla_queue: ``enqueue_many(session, BenchJob, rows, method=...)`` then ``commit()``.
    Baseline: ``COPY bench_jobs (order_id, recipient) FROM STDIN`` (server defaults fill
    the rest), or psycopg's pipelined ``executemany`` of one ``INSERT``; then
    ``pg_notify`` and ``commit()``. The table is emptied between runs.
    """
    n = plan.bulk_rows
    data = [{"order_id": i, "recipient": f"user{i}@example.com"} for i in range(n)]

    def ours(n: int, method: str) -> float:
        start = time.perf_counter()
        with Session(engine) as session:
            enqueue_many(session, BenchJob, data, method=method)  # type: ignore[call-overload]
            session.commit()
        return n / (time.perf_counter() - start)

    def base(n: int, method: str) -> float:
        with raw_connect(url) as conn:
            conn.execute("SELECT 1")
            conn.commit()
            start = time.perf_counter()
            with conn.cursor() as cur:
                if method == "copy":
                    with cur.copy("COPY bench_jobs (order_id, recipient) FROM STDIN") as copy:
                        for row in data:
                            copy.write_row((row["order_id"], row["recipient"]))
                else:
                    cur.executemany(
                        "INSERT INTO bench_jobs (order_id, recipient) VALUES (%s, %s)",
                        [(row["order_id"], row["recipient"]) for row in data],
                    )
                cur.execute(RAW_NOTIFY, (CHANNEL, "default"))
            conn.commit()
            return n / (time.perf_counter() - start)

    rows = []
    for method, label in (("copy", "COPY"), ("insert", "INSERT executemany")):
        a: list[float] = []
        b: list[float] = []
        clock = CpuClock()
        for r in range(plan.bulk_rounds):
            for side in ((ours, base) if r % 2 == 0 else (base, ours)):
                reset(engine)
                vacuum_analyze(url)
                (a if side is ours else b).append(clock.timed(side, n, method))
        reset(engine)
        name = f"bulk enqueue {n:,} jobs, {label}"
        rows.append(throughput_row(name, a, b, "rows/s", 0.8 if method == "copy" else None,
                                   clock.cpu[ours], clock.cpu[base]))
        say(f"  {name}: {rows[-1].cells()[1:4]}")
    return rows


# -- processing throughput -----------------------------------------------------------------


def bench_processing(engine: Engine, url: URL, plan: Plan) -> list[Row]:
    """Throughput with a no-op handler, preloaded jobs, the real ``Worker`` in fresh processes.

    Baseline: in the same number of processes and threads, each thread claims
    ``batch`` jobs with the same claim SQL (prepared), runs the no-op on each and
    completes them in one UPDATE (as the Worker's completer does, a batch at a time).
    Each baseline thread holds up to ``batch`` jobs, the Worker up to
    ``max(concurrency, batch)`` through its single claim loop. Beside the rate, the CPU
    time the worker processes used per job (Python and driver; the server's is not in
    it): on a small machine shared with PostgreSQL, that is what limits the rate.

    Every row is also held to the raw loop at its best setting (:class:`RawBest`), which
    does not match sqla_queue's threads or batch but what this machine can do at all.
    """
    rows = []
    best = RawBest(plan, max(cfg.jobs for cfg in plan.processing))
    for cfg in plan.processing:
        rates: dict[str, list[float]] = {"sqla_queue": [], "raw": []}
        cpus: dict[str, list[float]] = {"sqla_queue": [], "raw": []}
        for r in range(plan.processing_rounds):
            for kind in (("sqla_queue", "raw") if r % 2 == 0 else ("raw", "sqla_queue")):
                rate, cpu = run_processing(url, engine, kind, cfg)
                rates[kind].append(rate)
                cpus[kind].append(cpu)
            best.run_round(url, engine, cfg.processes)  # beside them, in the same rounds
        name = f"processing, {cfg.label}"
        # The target is at default options; an explicit batch size is shown for reference.
        row = throughput_row(name, rates["sqla_queue"], rates["raw"], "jobs/s", None if cfg.batch else 0.8,
                             cpus["sqla_queue"], cpus["raw"])
        best.hold(row, cfg.processes, rates["sqla_queue"])
        rows.append(row)
        say(f"  {name}: {rows[-1].cells(True)[1:]}")
    reset(engine)
    return rows


class RawBest:
    """The raw loop at its best setting (``RAW_BEST_BATCH``, one thread a process), run
    in the rounds of the figures it is held against: every batch of
    ``plan.raw_best_batches`` at each process count, the fastest median kept. It runs in
    the rounds of the first configuration of each process count (``rounds`` times), and
    the later ones are held to the same figure."""

    def __init__(self, plan: Plan, jobs: int) -> None:
        self.batches = plan.raw_best_batches
        self.rounds = plan.processing_rounds
        self.jobs = jobs
        self.rates: dict[tuple[int, int], list[float]] = {}
        self.cpus: dict[tuple[int, int], list[float]] = {}
        self._turn = 0

    def run_round(self, url: URL, engine: Engine, processes: int) -> None:
        """One run of every batch at ``processes``, in an order that turns round to round
        (nothing once it ran ``rounds`` times at ``processes``)."""
        batches = list(self.batches)
        if len(self.rates.get((processes, batches[0]), [])) >= self.rounds:
            return
        shift = self._turn % len(batches)
        self._turn += 1
        for batch in batches[shift:] + batches[:shift]:
            rate, cpu = run_processing(url, engine, "raw", Processing(processes, 1, batch, self.jobs))
            self.rates.setdefault((processes, batch), []).append(rate)
            self.cpus.setdefault((processes, batch), []).append(cpu)

    def hold(self, row: Row, processes: int, ours: list[float]) -> None:
        """Put the best batch's figure (and its name) and the ratio to it on ``row``."""
        found = [b for b in self.batches if (processes, b) in self.rates]
        if not found:
            return
        batch = max(found, key=lambda b: statistics.median(self.rates[processes, b]))
        row.against_best(ours, self.rates[processes, batch], self.cpus[processes, batch])
        row.best += f", batch {batch}" if batch != RAW_BEST_BATCH else ""


# -- pickup latency ------------------------------------------------------------------------

#: Pickup latency targets, as sqla_queue / baseline ratios of the percentile.
PICKUP_TARGETS = {50: 1.5, 99: 2.0}


def bench_pickup(engine: Engine, url: URL, plan: Plan) -> list[Row]:
    """Commit-to-handler-start latency of an idle consumer, woken by NOTIFY.

    Both consumers run at once, each on a queue of its own; the producer (raw psycopg:
    INSERT, pg_notify, commit) alternates between them, one job at a time, waiting for
    the handler to start and then a short pause so the consumer is idle again.
    """
    reset(engine)
    ctx = process_context()
    out = ctx.Queue()
    ready = ctx.Queue()
    stop = ctx.Event()
    url_text = url.render_as_string(hide_password=False)
    procs = [
        ctx.Process(target=pickup_child, args=(kind, url_text, out, ready, stop), daemon=True)
        for kind in PICKUP_QUEUES
    ]
    for proc in procs:
        proc.start()
    latencies: dict[str, list[float]] = {kind: [] for kind in PICKUP_QUEUES}
    try:
        wait_ready(ready, procs)
        with raw_connect(url) as producer:
            kinds = list(PICKUP_QUEUES)
            for i in range(plan.pickup_jobs * 2 + 10):
                kind = kinds[i % 2]
                job_id = producer.execute(
                    "INSERT INTO bench_jobs (queue, recipient) VALUES (%s, 'x') RETURNING id",
                    (PICKUP_QUEUES[kind],),
                ).fetchone()
                producer.execute(RAW_NOTIFY, (CHANNEL, PICKUP_QUEUES[kind]))
                producer.commit()
                committed = time.time()
                got_id, started = out.get(timeout=30)
                if job_id is None or got_id != job_id[0]:
                    raise RuntimeError(f"pickup: expected job {job_id}, got {got_id}")
                if i >= 10:  # the first few warm up both consumers
                    latencies[kind].append((started - committed) * 1000)
                time.sleep(plan.pickup_gap * random.uniform(0.5, 1.5))
    finally:
        end_processes(procs, stop)
    rows = []
    for pct in (50, 95, 99):
        a = percentile(latencies["sqla_queue"], pct)
        b = percentile(latencies["raw"], pct)
        name = f"pickup latency p{pct} (idle, LISTEN)"
        limit = PICKUP_TARGETS.get(pct)  # lower is better: sqla_queue / baseline at most this
        target = f"<= {limit:.1f}x" if limit is not None else ""
        rows.append(Row(name, f"{a:.2f} ms", f"{b:.2f} ms", a / b, target, (a / b <= limit) if limit else None))
        say(f"  {rows[-1].cells()[:4]}")
    reset(engine)
    return rows


# -- claim latency -------------------------------------------------------------------------


def bench_claim(engine: Engine, url: URL, plan: Plan) -> list[Row]:
    """Single claims against a table holding more and more finished rows.

    A steady set of pending jobs and 10k, 100k, 1M ``done`` rows (written by the server,
    then VACUUM ANALYZE). Each claim takes 1 job and is rolled back, so the pending set
    never changes. sqla_queue: ``conn.execute(claim).all()`` through SQLAlchemy Core, the
    statement built once (as the worker does); baseline: the same SQL text, prepared,
    through psycopg. Alternating, many times; the median and p95 are reported.
    """
    reset(engine)
    load_pending(url, plan.claim_pending)
    sql, params = claim_sql(engine, "raw", 1)
    raw = raw_connect(url)
    medians: dict[str, dict[int, float]] = {"sqla_queue": {}, "raw": {}}
    rows = []
    loaded = 0
    try:
        with engine.connect() as conn:

            # Built once, as the Worker does.
            claim = q.claim(BenchJob, owner="bench", limit=1, lease=60)

            def ours() -> float:
                start = time.perf_counter()
                got = conn.execute(claim).all()
                elapsed = time.perf_counter() - start
                conn.rollback()
                if len(got) != 1:
                    raise RuntimeError("claim found no job")
                return elapsed * 1000

            def base() -> float:
                start = time.perf_counter()
                got = raw.execute(sql, params, prepare=True).fetchall()
                elapsed = time.perf_counter() - start
                raw.rollback()
                if len(got) != 1:
                    raise RuntimeError("claim found no job")
                return elapsed * 1000

            for size in plan.claim_sizes:
                with raw_connect(url) as filler:
                    filler.execute(
                        "INSERT INTO bench_jobs (recipient, status, attempts, finished_at) "
                        "SELECT 'done' || i, 'done', 1, now() FROM generate_series(1, %s) AS i",
                        (size - loaded,),
                    )
                loaded = size
                vacuum_analyze(url)
                for _ in range(50):  # warm up: prepared statements, caches, pages
                    ours(), base()
                a: list[float] = []
                b: list[float] = []
                for i in range(plan.claims):
                    if i % 2 == 0:
                        a.append(ours())
                        b.append(base())
                    else:
                        b.append(base())
                        a.append(ours())
                medians["sqla_queue"][size] = ma = statistics.median(a)
                medians["raw"][size] = mb = statistics.median(b)
                rows.append(
                    Row(
                        f"claim latency, {human(size)} finished rows (p50 / p95)",
                        f"{ma:.3f} / {percentile(a, 95):.3f} ms",
                        f"{mb:.3f} / {percentile(b, 95):.3f} ms",
                        ma / mb,
                    )
                )
                say(f"  {rows[-1].cells()[:4]}")
    finally:
        raw.close()
    small, large = plan.claim_sizes[0], plan.claim_sizes[-1]
    growth = medians["sqla_queue"][large] / medians["sqla_queue"][small]
    base_growth = medians["raw"][large] / medians["raw"][small]
    rows.append(
        Row(
            f"claim latency growth, {human(large)} vs {human(small)} finished rows (p50)",
            f"{growth:.2f}x",
            f"{base_growth:.2f}x",
            None,
            "sqla_queue <= 1.5x",
            growth <= 1.5,
        )
    )
    reset(engine)
    return rows


def human(n: int) -> str:
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n >= 1_000 and n % 1_000 == 0:
        return f"{n // 1_000}k"
    return str(n)


# -- main ----------------------------------------------------------------------------------


BENCHMARKS: dict[str, Callable[[Engine, URL, Plan], list[Row]]] = {
    "enqueue": bench_enqueue,
    "async-enqueue": async_enqueue.bench_async_enqueue,
    "bulk": bench_bulk,
    "processing": bench_processing,
    "async-processing": async_processing.bench_async_processing,
    "pickup": bench_pickup,
    "claim": bench_claim,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the harness")
    parser.add_argument(
        "--url", help="admin URL of the server (default: DATABASE_URL, else embedded)"
    )
    parser.add_argument(
        "--only", action="append", choices=list(BENCHMARKS), help="run only these (repeatable)"
    )
    parser.add_argument(
        "--output",
        help="also write the table here (default: benchmarks/results/latest.md for a full run)",
    )
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    started = time.perf_counter()
    with scratch_database(args.url or os.environ.get("DATABASE_URL")) as url:
        engine = create_engine(url, pool_size=10)
        try:
            Base.metadata.create_all(engine)
            info = machine_info(engine)
            results: list[Row] = []
            for name, bench in BENCHMARKS.items():
                if args.only and name not in args.only:
                    continue
                say(f"{name}...")
                results += bench(engine, url, plan)
        finally:
            engine.dispose()
    took = time.perf_counter() - started
    report = (
        f"## sqla_queue vs raw psycopg{QUICK_NOTE if args.quick else ''}\n\n"
        f"{info}\n- the whole run took {took:.0f} s\n\n{markdown(results)}\n"
    )
    print(report)
    output = args.output or (None if args.quick or args.only else "benchmarks/results/latest.md")
    if output:
        path = Path(output)
        if not path.is_absolute():
            path = Path(__file__).resolve().parent.parent / path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
