"""The harness every benchmark script shares: the table, the raw baseline, the runners.

``benchmarks/run.py`` and each script beside it (``cost.py``, ``peers.py``,
``async_enqueue.py``, ...) measure on the same ``bench_jobs`` table (a ``JobMixin`` model
with two user columns) in a scratch database of their own, against the same baseline
written by hand on psycopg 3, and print the same kind of table. Those common parts live
here, and this module imports none of the scripts: each of them, ``run.py`` included,
imports it (``import harness as bench``) and none imports ``run.py``.

- the models and the raw SQL of the baseline (``BenchJob``, ``RAW_NOTIFY``,
  ``RAW_COMPLETE``, ``claim_sql``), the batch constants the figures are named by;
- the sizes of a full and a quick run (``Plan``, ``FULL``, ``QUICK``);
- the results table (``Row``, ``throughput_row``, ``markdown``) and the timers;
- the processing runner: jobs loaded beforehand, worker processes from one fork server,
  started, connected and ready before the start signal, timed until no job is left
  (``run_processing``, the raw thread loop, the idle LISTEN consumer of pickup latency);
- the scratch database, the machine's description and ``run_alone``, the command line
  of a benchmark module run on its own.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import queue as queue_module
import resource
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import date
from typing import Any

import psycopg
import sqlalchemy
from sqlalchemy import URL, BigInteger, Engine, Identity, String, create_engine, make_url, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqla_queue import JobMixin, Worker
from sqla_queue import sql as q
from sqla_queue.model import queue_table


class Base(DeclarativeBase):
    pass


class Order(Base):
    """The business row of the web-request enqueue ("an order and its e-mail")."""

    __tablename__ = "bench_orders"
    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    customer: Mapped[str] = mapped_column(String(100))


class BenchJob(Base, JobMixin):
    """The queue table both sides use: the mixin's columns and indexes, two user columns."""

    __tablename__ = "bench_jobs"
    order_id: Mapped[int | None] = mapped_column(BigInteger)
    recipient: Mapped[str] = mapped_column(String(200))


TABLE = BenchJob.__table__
CHANNEL = queue_table(BenchJob).channel
#: Where ``id`` is in a claimed row (the claim returns every column, in table order).
ID_INDEX = list(TABLE.c.keys()).index("id")
RAW_NOTIFY = "SELECT pg_notify(%s, %s)"
RAW_COMPLETE = (
    "UPDATE bench_jobs SET status = 'done', finished_at = clock_timestamp(), "
    "lease_expires_at = NULL "
    "WHERE id = ANY(%s) AND status = 'running' AND lease_owner = %s"
)


#: The baseline's batch when sqla_queue runs at its default ``batch_size`` (the most a
#: Worker's thread claims at once by default; the baseline has no default of its own).
BASELINE_BATCH = 32
#: The raw loop at its best: one thread a process, each claim taking this many rows a
#: statement (sqla_queue's claim SQL, SKIP LOCKED) in a transaction of its own, then one
#: completing UPDATE. 100 is the batch the issue's figures name; on the development machine
#: (2 cores, PostgreSQL 15, shared) 500 and 1,000 ran faster still, and 50 slower
#: (2026-12-07, 1 and 2 processes). A full run measures each of ``Plan.raw_best_batches``
#: in the same rounds and holds every processing figure to the fastest: what this machine
#: can do, beside the matched baseline.
RAW_BEST_BATCH = 100


@dataclass(frozen=True)
class Processing:
    """One processing configuration: OS processes x handler threads, jobs per claim.

    ``batch`` 0 leaves the Worker's ``batch_size`` at its default (the baseline has no
    default and needs a batch)."""

    processes: int
    concurrency: int
    batch: int
    jobs: int

    @property
    def label(self) -> str:
        procs = f"{self.processes} processes" if self.processes > 1 else "1 process"
        threads = f"{self.concurrency} threads" if self.concurrency > 1 else "1 thread"
        batch = self.batch or f"default (baseline {BASELINE_BATCH})"
        return f"{procs} x {threads}, batch {batch}"


@dataclass(frozen=True)
class Plan:
    """How much of everything to do: the full run or the quick smoke test."""

    enqueue_rounds: int
    enqueue_txns: int
    bulk_rows: int
    bulk_rounds: int
    processing: tuple[Processing, ...]
    processing_rounds: int
    pickup_jobs: int
    pickup_gap: float
    claim_sizes: tuple[int, ...]
    claim_pending: int
    claims: int
    #: The AsyncWorker's configurations (``concurrency`` is its number of asyncio tasks),
    #: run ``processing_rounds`` times; pgqueuer's ``batch_size`` swept beside them.
    async_processing: tuple[Processing, ...]
    pgqueuer_batch_sizes: tuple[int, ...]
    pgqueuer_jobs: int
    #: The raw loop's batches measured as "raw best" (one thread a process).
    raw_best_batches: tuple[int, ...] = (RAW_BEST_BATCH,)


FULL = Plan(
    enqueue_rounds=6,
    enqueue_txns=300,
    bulk_rows=100_000,
    bulk_rounds=3,
    processing=(
        Processing(1, 1, 0, 10_000),
        Processing(1, 4, 0, 20_000),
        Processing(1, 16, 0, 30_000),
        Processing(2, 4, 0, 30_000),
        Processing(1, 16, 128, 30_000),
    ),
    processing_rounds=5,
    pickup_jobs=200,
    pickup_gap=0.02,
    claim_sizes=(10_000, 100_000, 1_000_000),
    claim_pending=1_000,
    claims=500,
    async_processing=(
        Processing(1, 1, 0, 10_000),
        Processing(1, 4, 0, 20_000),
        Processing(1, 16, 0, 30_000),
    ),
    pgqueuer_batch_sizes=(100, 1000),
    pgqueuer_jobs=20_000,
    raw_best_batches=(RAW_BEST_BATCH, 500),
)

QUICK = Plan(
    enqueue_rounds=2,
    enqueue_txns=20,
    bulk_rows=2_000,
    bulk_rounds=1,
    processing=tuple(Processing(p.processes, p.concurrency, p.batch, 200) for p in FULL.processing),
    processing_rounds=1,
    pickup_jobs=10,
    pickup_gap=0.005,
    claim_sizes=(1_000, 3_000, 10_000),
    claim_pending=50,
    claims=20,
    # One configuration: every spawned process costs half a second of imports.
    async_processing=(Processing(1, 4, 0, 200),),
    pgqueuer_batch_sizes=(100,),
    pgqueuer_jobs=200,
)


# -- results -------------------------------------------------------------------------------


@dataclass
class Row:
    """One line of the results table."""

    name: str
    ours: str
    base: str
    ratio: float | None = None
    target: str = ""
    met: bool | None = None
    #: The raw loop at its best setting, measured in the same rounds (processing rows).
    best: str = ""
    best_ratio: float | None = None

    def cells(self, with_best: bool = False) -> list[str]:
        ratio = f"{self.ratio:.2f}x" if self.ratio is not None else "—"
        met = {True: "met", False: "**missed**", None: "—"}[self.met]
        cells = [self.name, self.ours, self.base, ratio, self.target or "—", met]
        if with_best:
            cells += [self.best or "—", f"{self.best_ratio:.2f}x" if self.best_ratio is not None else "—"]
        return cells

    def against_best(self, ours: list[float], best: list[float], best_cpu: list[float] | None = None) -> None:
        """Also hold the row's sqla_queue figure to the raw loop at its best setting."""
        b = statistics.median(best)
        self.best = f"{b:,.0f} jobs/s" + (f" ({statistics.median(best_cpu):,.1f} µs CPU/job)" if best_cpu else "")
        self.best_ratio = statistics.median(ours) / b


def markdown(rows: Sequence[Row]) -> str:
    header = ["benchmark", "sqla_queue", "baseline (psycopg)", "ratio", "target", ""]
    with_best = any(row.best for row in rows)
    if with_best:
        header += ["raw best (psycopg, 1 thread a process, batch 100 unless named)", "ratio to raw best"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row.cells(with_best)) + " |" for row in rows]
    return "\n".join(lines)


def with_cpu(figure: str, cpu: list[float] | None) -> str:
    """A throughput cell with the CPU time per job beside it (median, µs)."""
    return figure if not cpu else f"{figure} ({statistics.median(cpu):,.1f} µs CPU/job)"


def throughput_row(
    name: str, ours: list[float], base: list[float], unit: str, target: float | None,
    ours_cpu: list[float] | None = None, base_cpu: list[float] | None = None,
) -> Row:
    """Higher is better; the ratio is sqla_queue / baseline of the medians. ``*_cpu``:
    the CPU µs per job of each run (shown beside the rate)."""
    a, b = statistics.median(ours), statistics.median(base)
    ratio = a / b
    return Row(
        name,
        with_cpu(f"{a:,.0f} {unit}", ours_cpu),
        with_cpu(f"{b:,.0f} {unit}", base_cpu),
        ratio,
        f">= {target:.2f}x" if target is not None else "",
        (ratio >= target) if target is not None else None,
    )


class CpuClock:
    """Runs of in-process sides, each with this process's CPU time per unit of work
    (user + system, every thread: the benchmark process runs no other work meanwhile)."""

    def __init__(self) -> None:
        self.cpu: dict[Any, list[float]] = {}

    def timed(self, side: Callable[..., float], n: int, *args: Any) -> float:
        """``side(n, *args)`` (a rate); its CPU µs per unit of ``n`` is kept under ``side``."""
        cpu = cpu_seconds()
        rate = side(n, *args)
        self.cpu.setdefault(side, []).append((cpu_seconds() - cpu) / n * 1e6)
        return rate


def percentile(values: Sequence[float], pct: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * pct / 100
    low = int(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- the database --------------------------------------------------------------------------


def conninfo(url: URL) -> str:
    """The SQLAlchemy URL as a libpq URI, for raw psycopg connections."""
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def raw_connect(url: URL, autocommit: bool = False) -> psycopg.Connection[tuple[Any, ...]]:
    return psycopg.connect(conninfo(url), autocommit=autocommit)


def reset(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE bench_jobs, bench_orders RESTART IDENTITY"))


def vacuum_analyze(url: URL) -> None:
    with raw_connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE bench_jobs")


def load_pending(url: URL, n: int, queue: str = "default") -> None:
    """Setup, not measured: ``n`` runnable jobs, written by the server itself."""
    with raw_connect(url) as conn:
        conn.execute(
            "INSERT INTO bench_jobs (queue, recipient, order_id) "
            "SELECT %s, 'user' || i || '@example.com', i FROM generate_series(1, %s) AS i",
            (queue, n),
        )
    vacuum_analyze(url)


def unfinished(conn: psycopg.Connection[tuple[Any, ...]]) -> bool:
    """Any job still pending or running? Two probes of the partial indexes: cheap."""
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM bench_jobs WHERE status = 'pending') "
        "OR EXISTS (SELECT 1 FROM bench_jobs WHERE status = 'running')"
    ).fetchone()
    return bool(row and row[0])


def claim_sql(
    engine: Engine, owner: str, limit: int, queues: Sequence[str] | None = None
) -> tuple[str, dict[str, Any]]:
    """sqla_queue's claim statement as SQL text and parameters, for the raw side."""
    compiled = q.claim(BenchJob, owner=owner, limit=limit, lease=60, queues=queues).compile(
        dialect=engine.dialect
    )
    return str(compiled), dict(compiled.params)


def noop(job: Any) -> None:
    """The no-op handler: what is measured is the queue, not the work."""



# -- processing ----------------------------------------------------------------------------


def _processing_child(
    kind: str, url_text: str, concurrency: int, batch: int, ready: Any, go: Any, stop: Any
) -> None:
    """One worker process: ready (connected, caches warm), then work until told to stop.

    Reports the CPU time the process spent working (from the start signal to the end of
    its work), which says whether the Python side or the database is the bottleneck.
    """
    url = make_url(url_text)
    if kind == "sqla_queue":
        engine = create_engine(url, pool_size=concurrency + 3)
        # batch 0: the Worker's default batch size (only ``concurrency`` set).
        options: dict[str, Any] = {"batch_size": batch} if batch else {}
        worker = Worker(engine, BenchJob, noop, concurrency=concurrency, **options)
        engine.connect().close()  # warm: the first connection of a process costs more
        ready.put(os.getpid())
        go.wait()
        cpu = cpu_seconds()
        worker.start()
        stop.wait()
        cpu = cpu_seconds() - cpu
        worker.stop(grace=10)
        engine.dispose()
    else:
        owner = f"raw-{os.getpid()}"
        sql, params = claim_sql(create_engine(url), owner, batch or BASELINE_BATCH)
        raw_connect(url).close()  # warm: the first connection of a process costs more
        ready.put(os.getpid())
        go.wait()
        cpu = cpu_seconds()
        # Connected after the start signal, as the Worker's threads connect when it starts.
        conns = [raw_connect(url) for _ in range(concurrency)]
        threads = [
            threading.Thread(target=raw_processing_loop, args=(conn, sql, params, owner))
            for conn in conns
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        cpu = cpu_seconds() - cpu
        for conn in conns:
            conn.close()
        stop.wait()
    ready.put(cpu)


def end_processes(procs: Sequence[Any], stop: Any) -> None:
    """Tell the benchmark's processes to stop (``stop``, their event) and wait for each
    for 30 s, killing (and reaping) one still alive then: a run never leaves a process
    behind."""
    stop.set()
    for proc in procs:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def wait_ready(ready: Any, procs: Sequence[Any], timeout: float = 60) -> None:
    """Wait until every child said it is ready; fail fast if one died meanwhile."""
    deadline = time.monotonic() + timeout
    waiting = len(procs)
    while waiting:
        try:
            ready.get(timeout=0.2)
            waiting -= 1
        except queue_module.Empty:
            dead = [p.exitcode for p in procs if p.exitcode is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"a benchmark process failed to start (exit codes {dead})") from None


def process_context() -> Any:
    """Where every benchmark's worker processes come from: a fork server that has imported
    this harness (and so SQLAlchemy, psycopg and sqla_queue) once.

    A spawned interpreter spends most of a second importing them again, for each process
    of each run: most of a quick run's time, and a CPU taken from the server at the start
    of every full one. A child of the fork server starts in milliseconds and still starts
    clean: the server opens no connection and starts no thread, and every figure is taken
    after each child has connected and said it is ready. (The preload names ``harness``,
    not ``__main__``, which Python 3.11-3.13 ignore there; a child still runs the benchmark
    script's top level, as a spawned one does, on modules already imported.)"""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["harness"])
    return ctx


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def raw_processing_loop(
    conn: psycopg.Connection[tuple[Any, ...]], sql: str, params: dict[str, Any], owner: str
) -> None:
    """The hand-written worker loop: claim a batch, run the no-op on each, complete the batch
    in one UPDATE. It stops when a claim finds nothing (the jobs were all loaded before)."""
    with conn.cursor() as cur:
        while True:
            jobs = cur.execute(sql, params, prepare=True).fetchall()
            conn.commit()
            if not jobs:
                return
            for job in jobs:
                noop(job)
            cur.execute(RAW_COMPLETE, ([job[ID_INDEX] for job in jobs], owner), prepare=True)
            conn.commit()



def run_processing(
    url: URL, engine: Engine, kind: str, cfg: Processing, child: Callable[..., None] | None = None
) -> tuple[float, float]:
    """Jobs per second from the start signal until no job is pending or running, and
    the worker processes' CPU time per job (microseconds).

    ``child`` is the process's function (default :func:`_processing_child`), called with
    ``(kind, url_text, concurrency, batch, ready, go, stop)``."""
    ctx = process_context()
    ready = ctx.Queue()
    go, stop = ctx.Event(), ctx.Event()
    url_text = url.render_as_string(hide_password=False)
    procs = [
        ctx.Process(
            target=child or _processing_child,
            args=(kind, url_text, cfg.concurrency, cfg.batch, ready, go, stop),
            daemon=True,
        )
        for _ in range(cfg.processes)
    ]
    reset(engine)
    load_pending(url, cfg.jobs)
    for proc in procs:
        proc.start()
    try:
        wait_ready(ready, procs)
        with raw_connect(url, autocommit=True) as watch:
            go.set()
            start = time.perf_counter()
            deadline = time.monotonic() + 300
            while unfinished(watch):
                if time.monotonic() > deadline or any(p.exitcode is not None for p in procs):
                    raise RuntimeError(f"{kind} {cfg.label}: a process died or jobs are stuck")
                time.sleep(0.005)
            elapsed = time.perf_counter() - start
            done, most = watch.execute(
                "SELECT count(*) FILTER (WHERE status = 'done'), max(attempts) FROM bench_jobs"
            ).fetchone() or (0, 0)
        if done != cfg.jobs or most != 1:
            raise RuntimeError(f"{kind} {cfg.label}: {done}/{cfg.jobs} done, max attempts {most}")
        stop.set()
        cpu = sum(ready.get(timeout=60) for _ in procs)
    finally:
        end_processes(procs, stop)
    return cfg.jobs / elapsed, cpu / cfg.jobs * 1e6



# -- pickup latency: the idle consumer -----------------------------------------------------

PICKUP_QUEUES = {"sqla_queue": "pickup_sqla", "raw": "pickup_raw"}


def pickup_child(kind: str, url_text: str, out: Any, ready: Any, stop: Any) -> None:
    """An idle consumer: the real Worker (defaults), or a raw LISTEN loop claiming on NOTIFY."""
    url = make_url(url_text)
    queue_name = PICKUP_QUEUES[kind]

    def handler(job: Any) -> None:
        out.put((job.id if kind == "sqla_queue" else job[ID_INDEX], time.time()))

    if kind == "sqla_queue":
        engine = create_engine(url)
        worker = Worker(engine, BenchJob, handler, queues=(queue_name,))
        worker.start()
        # Started: the listener has connected when it has polled once (its first wake-up).
        time.sleep(0.5)
        ready.put(os.getpid())
        stop.wait()
        worker.stop(grace=5)
        engine.dispose()
        return
    owner = f"raw-{os.getpid()}"
    sql, params = claim_sql(create_engine(url), owner, 1, queues=[queue_name])
    listen = raw_connect(url, autocommit=True)
    listen.execute(f'LISTEN "{CHANNEL}"')
    work = raw_connect(url)
    ready.put(os.getpid())
    with work.cursor() as cur:
        while not stop.is_set():
            for note in listen.notifies(timeout=0.25, stop_after=1):
                if note.payload != queue_name:
                    continue
                while True:  # claim until empty: one NOTIFY may stand for several jobs
                    jobs = cur.execute(sql, params, prepare=True).fetchall()
                    work.commit()
                    if not jobs:
                        break
                    for job in jobs:
                        handler(job)
                    ids = [job[ID_INDEX] for job in jobs]
                    cur.execute(RAW_COMPLETE, (ids, owner), prepare=True)
                    work.commit()
    listen.close()
    work.close()


# -- the scratch database and the command line ---------------------------------------------


@contextmanager
def scratch_database(admin_text: str | None) -> Iterator[URL]:
    """A database of our own on the given server, or on an embedded one; dropped at the end."""
    embedded = None
    if admin_text:
        admin = make_url(admin_text)
        if admin.drivername in ("postgresql", "postgres"):
            admin = admin.set(drivername="postgresql+psycopg")
    else:
        from sqla_queue.embedded import EmbeddedPostgres

        say("no --url nor DATABASE_URL: starting an embedded PostgreSQL")
        embedded = EmbeddedPostgres().start()
        admin = embedded.url
    name = f"sqla_queue_bench_{uuid.uuid4().hex[:8]}"
    admin_engine = create_engine(admin, isolation_level="AUTOCOMMIT")
    try:
        with admin_engine.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        try:
            yield admin.set(database=name)
        finally:
            with admin_engine.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin_engine.dispose()
        if embedded is not None:
            embedded.stop()


def machine_info(engine: Engine) -> str:
    with engine.connect() as conn:
        version = conn.scalar(text("SHOW server_version"))
        rows = conn.execute(
            text(
                "SELECT name, setting FROM pg_settings WHERE name IN "
                "('fsync', 'synchronous_commit', 'shared_buffers')"
            )
        ).all()
        settings: dict[str, str] = {str(name): str(value) for name, value in rows}
    host = engine.url.host or engine.url.query.get("host") or "?"
    return (
        f"- {date.today().isoformat()}, {os.cpu_count()} CPUs ({platform.machine()}, "
        f"{platform.system()}), Python {platform.python_version()}, SQLAlchemy "
        f"{sqlalchemy.__version__}, psycopg {psycopg.__version__}\n"
        f"- PostgreSQL {version} at {host} (fsync={settings.get('fsync')}, "
        f"synchronous_commit={settings.get('synchronous_commit')}, "
        f"shared_buffers={int(settings.get('shared_buffers', 0)) * 8 // 1024} MB)"
    )


QUICK_NOTE = " (QUICK: sizes too small to mean anything)"


def run_alone(
    benchmark: Callable[[Engine, URL, Plan], list[Row]], doc: str | None, argv: Sequence[str] | None
) -> int:
    """The command line of a benchmark module run on its own (``--quick``, ``--url``):
    its rows on a scratch database, printed as ``run.py`` prints them."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the harness")
    parser.add_argument("--url", help="admin URL of the server (default: DATABASE_URL, else embedded)")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    with scratch_database(args.url or os.environ.get("DATABASE_URL")) as url:
        engine = create_engine(url)
        try:
            Base.metadata.create_all(engine)
            info = machine_info(engine)
            rows = benchmark(engine, url, plan)
        finally:
            engine.dispose()
    print(f"{info}\n\n{markdown(rows)}")
    return 0
