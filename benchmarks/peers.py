"""sqla_queue beside the other PostgreSQL queues for Python, same server, same workload, one run.

    python benchmarks/peers.py [--quick] [--url URL] [--output PATH]

The peers are **pgqueuer** (asyncpg driver) and **procrastinate** (psycopg 3 connector),
each used through its own documented API: its schema installed by its own installer
(``Queries.install()``, ``app.schema_manager.apply_schema_async()``), jobs enqueued with
``Queries.enqueue`` / ``Task.defer_async``, processed by its own worker (``PgQueuer.run``
with an entrypoint, ``App.run_worker_async``). A peer that is not installed is skipped
with a line saying so; ``pip install -e '.[bench]'`` installs both.

Each measure runs sqla_queue and every peer in the same run, alternating sides and taking
medians, as ``benchmarks/run.py`` does (on the harness both share, ``benchmarks/harness.py``):

- **processing**: N no-op jobs queued beforehand, the library's own worker in fresh
  processes (1, then 2), connected before the start signal and timed until no job is left
  to run. Each library is swept over a few of its own settings (sqla_queue: ``concurrency``
  with every other option at its default; pgqueuer: ``batch_size``; procrastinate:
  ``concurrency``) and the best median is reported with the setting that reached it, and
  the CPU time its worker processes spent per job. The harness's hand-written psycopg loop
  at its best setting (one thread a process, swept over its batch) runs in the same
  rounds, and sqla_queue's best is also given as a ratio to it.
- **enqueue, 1 job per transaction**: sqla_queue's ``QueueSession``, ``enqueue(job)``,
  ``commit()``; pgqueuer's ``Queries.enqueue`` on an autocommit asyncpg connection (one
  statement, one transaction, its trigger sends the NOTIFY); procrastinate's
  ``defer_async()``.
- **pickup latency**: an idle worker of each library at its default options, woken by
  its own LISTEN/NOTIFY; one job at a time is enqueued through the library's API, 10-30
  ms apart, alternately for each, timed from the return of the producer's commit to the
  first line of the handler.

``--quick`` runs everything with tiny sizes, to check the harness (the test suite runs it
when the peers are installed); its figures mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.metadata
import logging
import os
import queue as queue_module
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import URL, Engine, create_engine, make_url
from sqlalchemy.orm import sessionmaker

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as bench  # benchmarks/harness.py: the shared harness

from sqla_queue import QueueSession, enqueue_values

SQLA = "sqla_queue"
SQLA_FAST = "sqla_queue (enqueue_values)"
PGQUEUER = "pgqueuer"
PROCRASTINATE = "procrastinate"
PEERS = (PGQUEUER, PROCRASTINATE)
#: The harness's hand-written psycopg loop at its best setting (one thread a process), swept
#: over its batch beside the libraries: the processing figures are also held to it.
RAW_BEST = "raw psycopg"
INSTALL_HINT = "pip install -e '.[bench]'"
#: The entrypoint / task name of the no-op job, and of the pickup job.
NOOP = "bench_noop"
PICKUP = "bench_pickup"


@dataclass(frozen=True)
class Plan:
    jobs: int
    rounds: int
    processes: tuple[int, ...]
    #: Each library's settings swept for processing: sqla_queue ``concurrency``,
    #: pgqueuer ``batch_size``, procrastinate ``concurrency``.
    settings: dict[str, tuple[int, ...]] = field(hash=False)
    #: Fewer jobs for a side too slow to drain ``jobs`` in a bearable time (the rate of a
    #: no-op job is steady once the worker runs; the run only has to be long enough).
    fewer_jobs: dict[str, int] = field(default_factory=dict, hash=False)
    enqueue_rounds: int = 3
    enqueue_txns: int = 300
    pickup_jobs: int = 200
    pickup_gap: float = 0.02
    timeout: float = 300
    #: The raw loop's batches swept (the harness's ``RAW_BEST_BATCH`` first).
    raw_best_batches: tuple[int, ...] = (bench.RAW_BEST_BATCH,)


FULL = Plan(
    jobs=20_000,
    rounds=3,
    processes=(1, 2),
    settings={SQLA: (4, 16, 32, 64), PGQUEUER: (10, 100, 500, 1000), PROCRASTINATE: (10, 50)},
    # procrastinate fetches and finishes one job per statement: some 200 jobs/s here.
    fewer_jobs={PROCRASTINATE: 4_000},
    raw_best_batches=(bench.RAW_BEST_BATCH, 500),
)

QUICK = Plan(
    jobs=200,
    rounds=1,
    processes=(1, 2),
    settings={SQLA: (4,), PGQUEUER: (10,), PROCRASTINATE: (10,)},
    enqueue_rounds=1,
    enqueue_txns=20,
    pickup_jobs=8,
    pickup_gap=0.01,
    timeout=120,
)


def jobs_for(plan: Plan, side: str) -> int:
    return plan.fewer_jobs.get(side, plan.jobs)


def plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def available(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def dsn(url: URL) -> str:
    """The libpq URI both peers' drivers take."""
    return bench.conninfo(url)


def setting_label(side: str, value: int) -> str:
    """The one option swept: pgqueuer's ``batch_size`` (its worker runs every picked job as
    an asyncio task), procrastinate's and sqla_queue's ``concurrency`` (every other
    option of sqla_queue's Worker at its default), the raw loop's batch."""
    if side == PGQUEUER:
        return f"batch_size {value}"
    if side == RAW_BEST:
        return f"batch {value}"
    return f"concurrency {value}"


def settings_of(plan: Plan, side: str) -> tuple[int, ...]:
    return plan.raw_best_batches if side == RAW_BEST else plan.settings[side]


class _TopLevelAppWarning(logging.Filter):
    """procrastinate warns when its App is built in ``__main__``, because a worker finds a
    task by its import path. Every task here is registered on the App that runs it, so
    the warning does not apply."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "instantiated in the main Python module" not in record.getMessage()


logging.getLogger("procrastinate.blueprints").addFilter(_TopLevelAppWarning())


# -- each peer: schema, jobs, probes -----------------------------------------------------


async def pgqueuer_queries(url: URL) -> tuple[Any, Any]:
    """An autocommit asyncpg connection and pgqueuer's ``Queries`` over it."""
    import asyncpg
    from pgqueuer import AsyncpgDriver, Queries

    conn = await asyncpg.connect(dsn(url))
    return conn, Queries(AsyncpgDriver(conn))


def procrastinate_app(url: URL, **pool: Any) -> tuple[Any, Any, Any]:
    """A procrastinate ``App`` on its psycopg connector, with the no-op and the pickup task.

    The pickup task puts ``(tag, time.time())`` into ``out`` (set by the consumer)."""
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn(url), **pool))
    sink: dict[str, Any] = {}

    @app.task(name=NOOP)
    async def noop() -> None:
        pass

    @app.task(name=PICKUP, queue="pickup")
    async def pickup(tag: int) -> None:
        sink["out"].put((tag, time.time()))

    return app, noop, (pickup, sink)


async def install(side: str, url: URL) -> None:
    if side == PGQUEUER:
        conn, queries = await pgqueuer_queries(url)
        try:
            await queries.install()
        finally:
            await conn.close()
    elif side == PROCRASTINATE:
        app, _, _ = procrastinate_app(url)
        async with app.open_async():
            await app.schema_manager.apply_schema_async()


async def uninstall(side: str, url: URL) -> None:
    """Remove the peer's schema (the scratch database is dropped at the end anyway)."""
    if side == PGQUEUER:
        conn, queries = await pgqueuer_queries(url)
        try:
            await queries.uninstall()
        finally:
            await conn.close()
    elif side == PROCRASTINATE:  # no uninstaller: drop what its schema created
        with bench.raw_connect(url, autocommit=True) as conn:
            for kind, catalog in PROCRASTINATE_OBJECTS.items():
                names = [row[0] for row in conn.execute(catalog).fetchall()]
                if names:
                    conn.execute(f"DROP {kind} IF EXISTS {', '.join(names)} CASCADE")


#: What procrastinate's schema creates in ``public``, by the kind of DROP each needs.
PROCRASTINATE_OBJECTS = {
    "TABLE": (
        "SELECT quote_ident(tablename) FROM pg_tables "
        "WHERE schemaname = 'public' AND tablename LIKE 'procrastinate%'"
    ),
    "FUNCTION": (
        "SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
        "WHERE n.nspname = 'public' AND p.proname LIKE 'procrastinate%'"
    ),
    "TYPE": (
        "SELECT quote_ident(t.typname) FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace "
        "WHERE n.nspname = 'public' AND t.typname LIKE 'procrastinate%' AND t.typtype IN ('e', 'c', 'd')"
    ),
}

PEER_TABLES = {
    PGQUEUER: "pgqueuer, pgqueuer_log, pgqueuer_statistics",
    PROCRASTINATE: "procrastinate_jobs, procrastinate_events, procrastinate_workers",
}
PEER_QUEUE_TABLE = {PGQUEUER: "pgqueuer", PROCRASTINATE: "procrastinate_jobs"}


def reset_peer(side: str, url: URL) -> None:
    with bench.raw_connect(url, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {PEER_TABLES[side]} RESTART IDENTITY CASCADE")


async def load_peer(side: str, url: URL, n: int) -> None:
    """Setup, not measured: ``n`` no-op jobs through the peer's own batch API."""
    chunk = 5_000
    if side == PGQUEUER:
        conn, queries = await pgqueuer_queries(url)
        try:
            for start in range(0, n, chunk):
                k = min(chunk, n - start)
                await queries.enqueue([NOOP] * k, [None] * k, [0] * k)
        finally:
            await conn.close()
    else:
        app, noop, _ = procrastinate_app(url)
        async with app.open_async():
            for start in range(0, n, chunk):
                await noop.batch_defer_async(*({} for _ in range(min(chunk, n - start))))
    with bench.raw_connect(url, autocommit=True) as conn:
        conn.execute(f"VACUUM ANALYZE {PEER_QUEUE_TABLE[side]}")


def peer_unfinished(side: str, conn: Any) -> bool:
    """Any job still to run? Probes of the peer's own partial indexes, as the harness's are."""
    if side == PGQUEUER:  # a finished job is moved to pgqueuer_log
        sql = (
            "SELECT EXISTS (SELECT 1 FROM pgqueuer WHERE status = 'queued') "
            "OR EXISTS (SELECT 1 FROM pgqueuer WHERE status = 'picked')"
        )
    else:
        sql = (
            "SELECT EXISTS (SELECT 1 FROM procrastinate_jobs WHERE status = 'todo') "
            "OR EXISTS (SELECT 1 FROM procrastinate_jobs WHERE status = 'doing')"
        )
    row = conn.execute(sql).fetchone()
    return bool(row and row[0])


def peer_done(side: str, conn: Any) -> tuple[int, int]:
    """(jobs that succeeded, distinct jobs that succeeded): both must be N."""
    if side == PGQUEUER:
        sql = "SELECT count(*), count(DISTINCT job_id) FROM pgqueuer_log WHERE status = 'successful'"
    else:
        sql = (
            "SELECT count(*), count(*) FILTER (WHERE attempts = 1) FROM procrastinate_jobs "
            "WHERE status = 'succeeded'"
        )
    row = conn.execute(sql).fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


# -- processing ----------------------------------------------------------------------------


def _wait_go(go: Any, stop: Any) -> bool:
    """Wait for the start signal; False if the run was called off before it came."""
    while not go.wait(0.1):
        if stop.is_set():
            return False
    return True


def _peer_processing_child(side: str, url_text: str, value: int, ready: Any, go: Any, stop: Any) -> None:
    """One peer worker process: connected, then told to go; runs until told to stop.

    Reports its CPU time from the start signal to the stop signal, as the harness's children do."""
    url = make_url(url_text)

    async def pgqueuer_main() -> float:
        import asyncpg
        from pgqueuer import PgQueuer

        conn = await asyncpg.connect(dsn(url))
        pgq = PgQueuer.from_asyncpg_connection(conn)

        @pgq.entrypoint(NOOP)
        async def noop(job: Any) -> None:
            pass

        ready.put(os.getpid())
        if not await asyncio.to_thread(_wait_go, go, stop):
            await conn.close()
            return 0.0
        cpu = bench.cpu_seconds()
        task = asyncio.create_task(pgq.run(batch_size=value))
        await asyncio.to_thread(stop.wait)
        cpu = bench.cpu_seconds() - cpu
        pgq.shutdown.set()
        await asyncio.wait_for(task, 30)
        await conn.close()
        return cpu

    async def procrastinate_main() -> float:
        app, _, _ = procrastinate_app(url, min_size=4, max_size=max(4, min(value + 2, 20)))
        async with app.open_async():
            ready.put(os.getpid())
            if not await asyncio.to_thread(_wait_go, go, stop):
                return 0.0
            cpu = bench.cpu_seconds()
            task = asyncio.create_task(
                app.run_worker_async(concurrency=value, wait=True, install_signal_handlers=False)
            )
            await asyncio.to_thread(stop.wait)
            cpu = bench.cpu_seconds() - cpu
            task.cancel()
            with suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, 30)
        return cpu

    cpu = asyncio.run(pgqueuer_main() if side == PGQUEUER else procrastinate_main())
    ready.put(cpu)


def run_peer_processing(url: URL, side: str, value: int, processes: int, plan: Plan) -> tuple[float, float]:
    """Jobs per second from the start signal until no job is left, and CPU µs per job."""
    n = jobs_for(plan, side)
    reset_peer(side, url)
    asyncio.run(load_peer(side, url, n))
    ctx = bench.process_context()
    ready = ctx.Queue()
    go, stop = ctx.Event(), ctx.Event()
    url_text = url.render_as_string(hide_password=False)
    procs = [
        ctx.Process(
            target=_peer_processing_child,
            args=(side, url_text, value, ready, go, stop),
            daemon=True,
        )
        for _ in range(processes)
    ]
    for proc in procs:
        proc.start()
    label = f"{side} {setting_label(side, value)} x {processes}"
    try:
        bench.wait_ready(ready, procs)
        with bench.raw_connect(url, autocommit=True) as watch:
            go.set()
            start = time.perf_counter()
            deadline = time.monotonic() + plan.timeout
            while peer_unfinished(side, watch):
                if time.monotonic() > deadline or any(p.exitcode is not None for p in procs):
                    raise RuntimeError(f"{label}: a process died or jobs are stuck")
                time.sleep(0.005)
            elapsed = time.perf_counter() - start
            # Each peer records a success in the statement that finishes the job; the wait
            # only guards against a reader that sees one before the other.
            for _ in range(100):
                done, distinct = peer_done(side, watch)
                if done >= n:
                    break
                time.sleep(0.05)
        if done != n or distinct != n:
            raise RuntimeError(f"{label}: {done} succeeded ({distinct} distinct/first try) of {n}")
        stop.set()
        cpu = sum(ready.get(timeout=60) for _ in procs)
    finally:
        bench.end_processes(procs, stop)
    return n / elapsed, cpu / n * 1e6


def run_sqla_processing(url: URL, engine: Engine, concurrency: int, processes: int, plan: Plan) -> tuple[float, float]:
    """The harness's processing run of the real Worker, at default options but ``concurrency``."""
    cfg = bench.Processing(processes, concurrency, 0, plan.jobs)
    return bench.run_processing(url, engine, "sqla_queue", cfg)


@dataclass
class Best:
    rate: float
    cpu: float
    setting: str
    all: dict[str, float]


def bench_processing(url: URL, engine: Engine, sides: Sequence[str], plan: Plan) -> dict[int, dict[str, Best]]:
    """For each process count: every (side, setting) run ``rounds`` times, in rotating
    order; the best median rate of each side, with the setting that reached it."""
    out: dict[int, dict[str, Best]] = {}
    for processes in plan.processes:
        runs = [(side, value) for side in sides for value in plan.settings[side]]
        runs += [(RAW_BEST, batch) for batch in plan.raw_best_batches]
        rates: dict[tuple[str, int], list[float]] = {run: [] for run in runs}
        cpus: dict[tuple[str, int], list[float]] = {run: [] for run in runs}
        for r in range(plan.rounds):
            shift = r % len(runs)
            for side, value in runs[shift:] + runs[:shift]:
                if side == SQLA:
                    rate, cpu = run_sqla_processing(url, engine, value, processes, plan)
                elif side == RAW_BEST:
                    cfg = bench.Processing(processes, 1, value, plan.jobs)
                    rate, cpu = bench.run_processing(url, engine, "raw", cfg)
                else:
                    rate, cpu = run_peer_processing(url, side, value, processes, plan)
                rates[side, value].append(rate)
                cpus[side, value].append(cpu)
                bench.say(f"    {side}, {setting_label(side, value)}, {processes} proc: {rate:,.0f} jobs/s")
        out[processes] = {}
        for side in [*sides, RAW_BEST]:
            medians = {value: statistics.median(rates[side, value]) for value in settings_of(plan, side)}
            value = max(medians, key=lambda v: medians[v])
            out[processes][side] = Best(
                medians[value],
                statistics.median(cpus[side, value]),
                setting_label(side, value),
                {setting_label(side, v): m for v, m in medians.items()},
            )
            bench.say(f"  processing, {processes} proc, {side}: best {out[processes][side].setting}")
        bench.reset(engine)
        for side in sides:
            if side != SQLA:
                reset_peer(side, url)
    return out


# -- enqueue, one job per transaction -------------------------------------------------------


def _closer(conn: Any) -> Callable[[], Any]:
    async def close() -> None:
        conn.close()

    return close


async def bench_enqueue(url: URL, engine: Engine, sides: Sequence[str], plan: Plan) -> dict[str, float]:
    """Jobs per second, one job per transaction, through each library's enqueue API."""
    factory = sessionmaker(engine, class_=QueueSession)
    closers: list[Callable[[], Any]] = []
    runners: dict[str, Callable[[int], Any]] = {}

    async def sqla(n: int) -> None:
        for i in range(n):
            with factory() as session:
                session.enqueue(bench.BenchJob(recipient=f"u{i}@example.com"))
                session.commit()

    runners[SQLA] = sqla
    autocommit = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
    closers.append(_closer(autocommit))

    async def sqla_fast(n: int) -> None:
        """The fast path, on an autocommit connection as pgqueuer enqueues: one statement."""
        for i in range(n):
            enqueue_values(autocommit, bench.BenchJob, {"recipient": f"u{i}@example.com"})

    runners[SQLA_FAST] = sqla_fast
    if PGQUEUER in sides:
        conn, queries = await pgqueuer_queries(url)
        closers.append(conn.close)

        async def pgqueuer(n: int) -> None:
            for _ in range(n):
                await queries.enqueue(NOOP, None)

        runners[PGQUEUER] = pgqueuer
    if PROCRASTINATE in sides:
        app, noop, _ = procrastinate_app(url)
        await app.open_async()
        closers.append(app.close_async)

        async def procrastinate(n: int) -> None:
            for _ in range(n):
                await noop.defer_async()

        runners[PROCRASTINATE] = procrastinate
    order = [*sides, SQLA_FAST]
    results: dict[str, list[float]] = {side: [] for side in order}
    try:
        for side in order:
            await runners[side](20)  # warm up: connections, prepared statements
        for r in range(plan.enqueue_rounds):
            shift = r % len(order)
            for side in list(order[shift:]) + list(order[:shift]):
                start = time.perf_counter()
                await runners[side](plan.enqueue_txns)
                results[side].append(plan.enqueue_txns / (time.perf_counter() - start))
    finally:
        for close in closers:
            await close()
    medians = {side: statistics.median(values) for side, values in results.items()}
    for side, rate in medians.items():
        bench.say(f"  enqueue, {side}: {rate:,.0f} jobs/s")
    bench.reset(engine)
    for side in sides:
        if side != SQLA:
            reset_peer(side, url)
    return medians


# -- pickup latency ------------------------------------------------------------------------


def _peer_pickup_child(side: str, url_text: str, out: Any, ready: Any, stop: Any) -> None:
    """An idle worker of the peer at its default options, until told to stop."""
    url = make_url(url_text)

    async def pgqueuer_main() -> None:
        import asyncpg
        from pgqueuer import PgQueuer

        conn = await asyncpg.connect(dsn(url))
        pgq = PgQueuer.from_asyncpg_connection(conn)

        @pgq.entrypoint(PICKUP)
        async def pickup(job: Any) -> None:
            out.put((job.id, time.time()))

        task = asyncio.create_task(pgq.run())
        await asyncio.sleep(0.5)  # listening
        ready.put(os.getpid())
        await asyncio.to_thread(stop.wait)
        pgq.shutdown.set()
        await asyncio.wait_for(task, 30)
        await conn.close()

    async def procrastinate_main() -> None:
        app, _, (_, sink) = procrastinate_app(url)
        sink["out"] = out
        async with app.open_async():
            task = asyncio.create_task(
                app.run_worker_async(queues=["pickup"], install_signal_handlers=False)
            )
            await asyncio.sleep(0.5)  # listening
            ready.put(os.getpid())
            await asyncio.to_thread(stop.wait)
            task.cancel()
            with suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, 30)

    asyncio.run(pgqueuer_main() if side == PGQUEUER else procrastinate_main())


async def bench_pickup(url: URL, engine: Engine, sides: Sequence[str], plan: Plan) -> dict[str, tuple[float, float]]:
    """p50 and p99 in ms of commit-return to handler-start, for an idle worker of each side."""
    ctx = bench.process_context()
    ready = ctx.Queue()
    stop = ctx.Event()
    url_text = url.render_as_string(hide_password=False)
    outs = {side: ctx.Queue() for side in sides}
    procs = []
    for side in sides:
        if side == SQLA:
            target, args = bench.pickup_child, ("sqla_queue", url_text, outs[side], ready, stop)
        else:
            target, args = _peer_pickup_child, (side, url_text, outs[side], ready, stop)
        procs.append(ctx.Process(target=target, args=args, daemon=True))
    for proc in procs:
        proc.start()
    latencies: dict[str, list[float]] = {side: [] for side in sides}
    factory = sessionmaker(engine, class_=QueueSession, expire_on_commit=False)
    closers: list[Callable[[], Any]] = []
    try:
        bench.wait_ready(ready, procs)
        producers: dict[str, Callable[[int], Any]] = {}

        async def sqla(i: int) -> tuple[Any, float]:
            with factory() as session:
                job = session.enqueue(
                    bench.BenchJob(recipient=f"p{i}"), queue=bench.PICKUP_QUEUES["sqla_queue"]
                )
                session.commit()
                committed = time.time()
            return job.id, committed

        producers[SQLA] = sqla
        if PGQUEUER in sides:
            conn, queries = await pgqueuer_queries(url)
            closers.append(conn.close)

            async def pgqueuer(i: int) -> tuple[Any, float]:
                ids = await queries.enqueue(PICKUP, None)
                return ids[0], time.time()

            producers[PGQUEUER] = pgqueuer
        if PROCRASTINATE in sides:
            app, _, (pickup, _) = procrastinate_app(url)
            await app.open_async()
            closers.append(app.close_async)

            async def procrastinate(i: int) -> tuple[Any, float]:
                await pickup.defer_async(tag=i)
                return i, time.time()

            producers[PROCRASTINATE] = procrastinate
        warmup = 5 * len(sides)
        for i in range(plan.pickup_jobs * len(sides) + warmup):
            side = sides[i % len(sides)]
            expected, committed = await producers[side](i)
            try:
                got, started = outs[side].get(timeout=30)
            except queue_module.Empty:
                raise RuntimeError(f"pickup: {side} did not run job {expected} within 30 s") from None
            if got != expected:
                raise RuntimeError(f"pickup: {side} expected job {expected}, got {got}")
            if i >= warmup:
                latencies[side].append((started - committed) * 1000)
            await asyncio.sleep(plan.pickup_gap * random.uniform(0.5, 1.5))
    finally:
        for close in closers:
            await close()
        bench.end_processes(procs, stop)
    result = {side: (bench.percentile(v, 50), bench.percentile(v, 99)) for side, v in latencies.items()}
    for side, (p50, p99) in result.items():
        bench.say(f"  pickup, {side}: p50 {p50:.2f} ms, p99 {p99:.2f} ms")
    bench.reset(engine)
    for side in sides:
        if side != SQLA:
            reset_peer(side, url)
    return result


# -- the report ----------------------------------------------------------------------------


def ratio_cell(ours: float, theirs: float, target: float, higher_is_better: bool) -> str:
    ratio = ours / theirs
    met = ratio >= target if higher_is_better else ratio <= target
    sign = ">=" if higher_is_better else "<="
    return f"{ratio:.2f}x ({sign} {target:g}x: {'met' if met else '**missed**'})"


def report(
    sides: Sequence[str],
    processing: dict[int, dict[str, Best]],
    enqueue: dict[str, float],
    pickup: dict[str, tuple[float, float]],
) -> str:
    header = ["benchmark", *sides]
    vs = PGQUEUER in sides
    if vs:
        header.append("sqla_queue / pgqueuer (target)")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def row(name: str, cells: list[str], extra: str | None) -> None:
        lines.append("| " + " | ".join([name, *cells] + ([extra or "—"] if vs else [])) + " |")

    for processes, best in processing.items():
        procs = f"{processes} processes" if processes > 1 else "1 process"
        raw = best[RAW_BEST]
        row(
            f"processing, {procs}, best setting",
            [f"{best[s].rate:,.0f} jobs/s ({best[s].cpu:,.1f} µs CPU/job; {best[s].setting})"
             + (f"; {best[s].rate / raw.rate:.2f}x raw best" if s == SQLA else "") for s in sides],
            ratio_cell(best[SQLA].rate, best[PGQUEUER].rate, 2, True) if vs else None,
        )
    row(
        "enqueue, 1 job per transaction (sqla_queue: session.enqueue)",
        [f"{enqueue[s]:,.0f} jobs/s" for s in sides],
        ratio_cell(enqueue[SQLA], enqueue[PGQUEUER], 1, True) if vs else None,
    )
    row(
        "enqueue, 1 job per transaction (sqla_queue: enqueue_values, autocommit)",
        [f"{enqueue[SQLA_FAST if s == SQLA else s]:,.0f} jobs/s" for s in sides],
        ratio_cell(enqueue[SQLA_FAST], enqueue[PGQUEUER], 1, True) if vs else None,
    )
    for i, pct in enumerate((50, 99)):
        row(
            f"pickup latency p{pct} (idle worker, LISTEN)",
            [f"{pickup[s][i]:.2f} ms" for s in sides],
            ratio_cell(pickup[SQLA][i], pickup[PGQUEUER][i], 1, False) if vs else None,
        )
    lines.append("")
    lines.append("Processing, every setting swept (median jobs/s):")
    lines.append("")
    for processes, best in processing.items():
        raw = best[RAW_BEST]
        lines.append(f"- {processes} process{'es' if processes > 1 else ''}, raw best ({RAW_BEST}, one thread a "
                     f"process): {raw.rate:,.0f} jobs/s ({raw.cpu:,.1f} µs CPU/job; {raw.setting})")
        for side in [*sides, RAW_BEST]:
            swept = ", ".join(f"{k}: {v:,.0f}" for k, v in best[side].all.items())
            edge = ""
            if len(best[side].all) > 1 and best[side].setting == list(best[side].all)[-1]:
                edge = " (best at the largest setting swept: a larger one may do better)"
            lines.append(f"- {processes} process{'es' if processes > 1 else ''}, {side}: {swept}{edge}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the harness")
    parser.add_argument("--url", help="admin URL of the server (default: DATABASE_URL, else embedded)")
    parser.add_argument(
        "--output",
        help="also write the report here (default: benchmarks/results/peers.md for a full run)",
    )
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    peers = [p for p in PEERS if available(p)]
    skipped = [p for p in PEERS if p not in peers]
    for p in skipped:
        bench.say(f"{p}: not installed, skipped ({INSTALL_HINT} installs it)")
    sides = [SQLA, *peers]
    started = time.perf_counter()
    with bench.scratch_database(args.url or os.environ.get("DATABASE_URL")) as url:
        engine = create_engine(url, pool_size=10)
        try:
            bench.Base.metadata.create_all(engine)
            info = bench.machine_info(engine)
            for peer in peers:
                asyncio.run(install(peer, url))
            bench.say("processing...")
            processing = bench_processing(url, engine, sides, plan)
            bench.say("enqueue...")
            enqueue = asyncio.run(bench_enqueue(url, engine, sides, plan))
            bench.say("pickup...")
            pickup = asyncio.run(bench_pickup(url, engine, sides, plan))
            for peer in peers:
                asyncio.run(uninstall(peer, url))
        finally:
            engine.dispose()
    took = time.perf_counter() - started
    versions = ", ".join(f"{p} {version(p)}" for p in sides)
    lines = [
        f"## sqla_queue and its peers{bench.QUICK_NOTE if args.quick else ''}",
        "",
        info,
        f"- {versions}; {plan.jobs:,} jobs per processing run"
        + "".join(f" ({side}: {jobs_for(plan, side):,})" for side in sides if side in plan.fewer_jobs)
        + f", medians of {plural(plan.rounds, 'round')}; enqueue {plan.enqueue_txns} transactions x "
        f"{plural(plan.enqueue_rounds, 'round')}; pickup {plural(plan.pickup_jobs, 'job')} each",
    ]
    lines += [f"- {p}: skipped, not installed ({INSTALL_HINT})" for p in skipped]
    lines += [f"- the whole run took {took:.0f} s", "", report(sides, processing, enqueue, pickup), ""]
    text = "\n".join(lines)
    print(text)
    output = args.output or (None if args.quick else "benchmarks/results/peers.md")
    if output:
        path = Path(output)
        if not path.is_absolute():
            path = Path(__file__).resolve().parent.parent / path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
