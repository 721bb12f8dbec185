"""Production pressure: the queue beside long transactions, many writers and a big table.

    python benchmarks/pressure.py [--only NAMES] [--minutes M] [--finished N] [--quick]

Runs on a PostgreSQL cluster of its own (``initdb`` of the machine's newest server, on a
free port, in a temporary directory, removed at the end) with production settings:
autovacuum on at its default thresholds, ``fsync`` and ``synchronous_commit`` on, and
``pg_stat_statements`` for the claim's time. sqla_queue and the raw psycopg baseline run
side by side in one run; every ratio below is of the same run.

- ``producers``: N concurrent producers (1, 8, 32, 64 threads over up to 4 processes), one
  job per business transaction (an order row and its job), with and without the wake-up:
  commits per second. sqla_queue's sides: ``session.enqueue()`` and ``enqueue_values()`` on
  a Connection, each on three twin models that differ in ``__queue_wake__`` alone
  (``"with_commit"``, the default; ``"after_commit"``; ``"none"``, the reference); the
  baseline's: the INSERTs with and without ``pg_notify``.
- ``hold``: a steady offered load (``--rate``, 800 jobs/s, two producer processes) for
  ``--minutes`` (10), once clean and once with a ``REPEATABLE READ`` transaction held
  open from 20 % to 80 % of the run, each side, on a table with the per-table autovacuum
  settings the docs recommend (:data:`RECOMMENDED_STORAGE`): per minute (per tenth of a
  run shorter than 5 minutes), throughput, pickup p50/p99 and the claim's mean time, dead
  tuples and the sizes of the table and each index; the statements that took the most
  server time.
- ``big``: ``--finished`` (10M) finished rows and 100k pending: the claim's latency against
  the same pending jobs in an otherwise empty table, the enqueue rate, and pruning in
  bounded batches while claims run.
- ``processes``: worker processes 1-4 at default options against the baseline at the same
  process count (``benchmarks/harness.py``'s processing runner, on this cluster).
- ``settings``: the steady load (no held snapshot) beside ``--settings-finished`` (2M)
  finished rows for ``--settings-minutes`` (5), once per storage variant (the server's
  defaults, the recommended per-table autovacuum, and that with ``fillfactor`` 80): dead
  tuples, autovacuum runs, the sizes of the table and its indexes, throughput and pickup.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import pwd
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import URL, Engine, String, create_engine, insert, make_url, text
from sqlalchemy.orm import Mapped, mapped_column

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness as bench  # noqa: E402 - the harness's tables and helpers
from harness import Base, BenchJob, Order, Row, markdown, percentile, raw_connect, say  # noqa: E402

from sqla_queue import JobMixin, QueueSession, Worker, enqueue_values  # noqa: E402
from sqla_queue import sql as q  # noqa: E402
from sqla_queue.enqueue import waker  # noqa: E402
from sqla_queue.model import queue_table  # noqa: E402


class AfterCommitJob(Base, JobMixin):
    """bench_jobs' twin whose model sends its wake-ups after the commit, coalesced."""

    __tablename__ = "bench_jobs_after"
    __queue_wake__ = "after_commit"
    order_id: Mapped[int | None] = mapped_column()
    recipient: Mapped[str] = mapped_column(String(200))


class NoWakeJob(Base, JobMixin):
    """bench_jobs' twin that sends no wake-up: the same enqueue, without the NOTIFY."""

    __tablename__ = "bench_jobs_none"
    __queue_wake__ = "none"
    order_id: Mapped[int | None] = mapped_column()
    recipient: Mapped[str] = mapped_column(String(200))


#: The model of each wake-up mode.
WAKE_MODELS: dict[str, Any] = {"none": NoWakeJob, "with_commit": BenchJob, "after_commit": AfterCommitJob}


#: Targets (sqla_queue's ratios, same run).
PRODUCER_TARGET = 0.9  # the default wake-up (with_commit) / none, at 32 producers
HOLD_THROUGHPUT_TARGET = 0.9  # held / clean
HOLD_P99_TARGET = 2.0  # held / clean
HOLD_CLAIM_GROWTH_TARGET = 1.5  # the claim's mean time, last minute of the hold / first: no growth
BIG_CLAIM_TARGET = 1.2  # 10M finished rows / empty
PROCESSES_TARGET = 0.85  # sqla_queue / raw


#: The storage parameters the runs may set (each run resets them first).
STORAGE_PARAMETERS = (
    "autovacuum_vacuum_scale_factor", "autovacuum_vacuum_threshold", "autovacuum_vacuum_cost_delay", "fillfactor",
)
#: What docs/operations/monitoring.md recommends for a queue table: vacuum after a fixed
#: number of dead rows, not after a fifth of the table (which finished jobs kept for a
#: retention make large), at full speed (the passes are small and frequent).
RECOMMENDED_STORAGE: dict[str, Any] = {
    "autovacuum_vacuum_scale_factor": 0, "autovacuum_vacuum_threshold": 10_000, "autovacuum_vacuum_cost_delay": 0,
}
#: The variants ``settings`` compares.
SETTINGS_VARIANTS: dict[str, dict[str, Any]] = {
    "server defaults": {},
    "recommended autovacuum": RECOMMENDED_STORAGE,
    "recommended autovacuum, fillfactor 80": {**RECOMMENDED_STORAGE, "fillfactor": 80},
}


# -- the cluster -------------------------------------------------------------------------


def _bin_dir() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]), reverse=True)
    if found:
        return Path(found[0]).parent
    initdb = shutil.which("initdb")
    if initdb is None:
        raise SystemExit("pressure.py needs PostgreSQL's initdb and pg_ctl (Debian: postgresql)")
    return Path(initdb).parent


#: The running cluster's log (autovacuum's passes are read from it).
SERVER_LOG: Path | None = None


def _autovacuum_passes(since: int) -> list[float]:
    """Seconds each autovacuum pass of ``bench_jobs`` took, logged after byte ``since``."""
    if SERVER_LOG is None or not SERVER_LOG.exists():
        return []
    with SERVER_LOG.open("rb") as f:
        f.seek(since)
        text_ = f.read().decode(errors="replace")
    passes, inside = [], False
    for line in text_.splitlines():
        if "automatic vacuum of table" in line:
            inside = "bench_jobs\"" in line
        elif inside and "elapsed:" in line:
            passes.append(float(line.rsplit("elapsed:", 1)[1].split()[0]))
            inside = False
    return passes


def _log_size() -> int:
    return SERVER_LOG.stat().st_size if SERVER_LOG is not None and SERVER_LOG.exists() else 0


@contextlib.contextmanager
def cluster() -> Iterator[URL]:
    """A server of the benchmark's own with production settings; stopped and removed at
    the end. As root (PostgreSQL refuses to run as root), it runs as ``postgres``."""
    bin_dir = _bin_dir()
    root = Path(tempfile.mkdtemp(prefix="sqla_queue_pressure_"))
    as_postgres = os.geteuid() == 0
    if as_postgres:
        user = pwd.getpwnam("postgres")
        os.chown(root, user.pw_uid, user.pw_gid)

    def run(*cmd: str) -> None:
        full = ["runuser", "-u", "postgres", "--", *cmd] if as_postgres else list(cmd)
        done = subprocess.run(full, capture_output=True, text=True, timeout=300, cwd=root)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {done.stdout}{done.stderr}")

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    data = root / "data"
    run(str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-instructions")
    settings = {
        "port": str(port), "listen_addresses": "127.0.0.1", "unix_socket_directories": str(root),
        "max_connections": "300", "shared_buffers": "512MB", "autovacuum": "on",
        "shared_preload_libraries": "pg_stat_statements", "pg_stat_statements.track": "top",
        "log_autovacuum_min_duration": "0",  # every pass of autovacuum, with its time
    }
    conf = "".join(f"{key} = '{value}'\n" for key, value in settings.items())
    with (data / "postgresql.conf").open("a") as f:  # root may write the postgres user's file
        f.write(conf)
    global SERVER_LOG
    SERVER_LOG = root / "server.log"
    run(str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(SERVER_LOG), "-w", "-t", "60", "start")
    say(f"cluster: data in {root}")
    try:
        with psycopg.connect(f"host=127.0.0.1 port={port} user=postgres dbname=postgres", autocommit=True) as conn:
            conn.execute("CREATE DATABASE bench")
        with psycopg.connect(f"host=127.0.0.1 port={port} user=postgres dbname=bench", autocommit=True) as conn:
            conn.execute("CREATE EXTENSION pg_stat_statements")
        yield make_url(f"postgresql+psycopg://postgres@127.0.0.1:{port}/bench")
    finally:
        with contextlib.suppress(Exception):
            run(str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "-t", "60", "stop")
        shutil.rmtree(root, ignore_errors=True)


# -- 2. concurrent producers -------------------------------------------------------------

#: sqla_queue's sides: ``session.enqueue()`` (orm) and ``enqueue_values()`` on a Connection
#: (values), each at the three wake-up modes; the baseline's with and without pg_notify.
PRODUCER_SIDES = (*(f"{api} {mode}" for api in ("orm", "values") for mode in WAKE_MODELS), "raw none", "raw notify")


def _producer_child(side: str, url_text: str, threads: int, seconds: float, ready: Any, go: Any, out: Any) -> None:
    url = make_url(url_text)
    counts = [0] * threads
    channel = queue_table(BenchJob).channel
    api, _, mode = side.partition(" ")

    def orm_loop(i: int, engine: Engine, model: Any, deadline: float) -> None:
        n = 0
        while time.monotonic() < deadline:
            with QueueSession(engine) as session:
                session.add(Order(customer="c"))
                session.enqueue(model(recipient="user@example.com"))
                session.commit()
            n += 1
        counts[i] = n

    def values_loop(i: int, engine: Engine, model: Any, deadline: float) -> None:
        n = 0
        order = insert(Order)
        while time.monotonic() < deadline:
            with engine.connect() as conn:
                conn.execute(order, {"customer": "c"})
                enqueue_values(conn, model, {"recipient": "user@example.com"})
                conn.commit()
            n += 1
        counts[i] = n

    def raw_loop(i: int, conn: psycopg.Connection[Any], deadline: float) -> None:
        n = 0
        notify = mode == "notify"
        with conn.cursor() as cur:
            while time.monotonic() < deadline:
                cur.execute("INSERT INTO bench_orders (customer) VALUES ('c') RETURNING id", prepare=True)
                order_id = cur.fetchone()[0]  # type: ignore[index]
                cur.execute("INSERT INTO bench_jobs (queue, recipient, order_id) VALUES ('default', %s, %s)",
                            ("user@example.com", order_id), prepare=True)
                if notify:
                    cur.execute("SELECT pg_notify(%s, 'default')", (channel,), prepare=True)
                conn.commit()
                n += 1
        counts[i] = n

    if api == "raw":
        conns = [raw_connect(url) for _ in range(threads)]
        ready.put(os.getpid())
        go.wait()
        deadline = time.monotonic() + seconds
        workers = [threading.Thread(target=raw_loop, args=(i, conns[i], deadline)) for i in range(threads)]
    else:
        engine = create_engine(url, pool_size=threads + 2)
        engine.connect().close()
        ready.put(os.getpid())
        go.wait()
        deadline = time.monotonic() + seconds
        loop = orm_loop if api == "orm" else values_loop
        workers = [threading.Thread(target=loop, args=(i, engine, WAKE_MODELS[mode], deadline))
                   for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    waker.flush()
    out.put(sum(counts))


def run_producers(url: URL, side: str, producers: int, seconds: float) -> float:
    ctx = bench.process_context()
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    processes = min(producers, 4)
    per = [producers // processes + (1 if i < producers % processes else 0) for i in range(processes)]
    url_text = url.render_as_string(hide_password=False)
    procs = [ctx.Process(target=_producer_child, args=(side, url_text, n, seconds, ready, go, out), daemon=True)
             for n in per]
    for p in procs:
        p.start()
    try:
        bench.wait_ready(ready, procs)
        go.set()
        total = sum(out.get(timeout=seconds + 120) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return total / seconds


def bench_producers(engine: Engine, url: URL, args: argparse.Namespace) -> list[Row]:
    """Each round runs every API's sides back to back (in an order that turns by the
    round), and a ratio is the median of the rounds' own ratios: commits per second on
    this 2-CPU machine drift by ±10 % over minutes (checkpoints, the server's caches), more
    than the wake-up costs, and a side is compared with its reference of the same
    minute."""
    rows = []
    counts = (2,) if args.quick else tuple(int(n) for n in args.producers.split(","))
    groups = [[side for side in PRODUCER_SIDES if side.startswith(f"{api} ")] for api in ("orm", "values", "raw")]
    for n in counts:
        rates: dict[str, list[float]] = {side: [] for side in PRODUCER_SIDES}
        for r in range(args.rounds):
            for group in groups[r % 3:] + groups[:r % 3]:
                for side in group[r % len(group):] + group[:r % len(group)]:
                    _truncate(engine)
                    rates[side].append(run_producers(url, side, n, args.seconds))
        med = {side: statistics.median(v) for side, v in rates.items()}
        say(f"  producers {n}: " + ", ".join(f"{s} {m:,.0f}/s" for s, m in med.items()))

        def paired(side: str, reference: str, rates: dict[str, list[float]] = rates) -> float:
            return statistics.median(a / b for a, b in zip(rates[side], rates[reference], strict=True))

        raw = (f"notify {med['raw notify']:,.0f}/s, none {med['raw none']:,.0f}/s "
               f"({paired('raw notify', 'raw none'):.2f}x)")
        for api, what in (("orm", "session.enqueue()"), ("values", "enqueue_values()")):
            for mode in ("with_commit", "after_commit"):
                side, reference = f"{api} {mode}", f"{api} none"
                # The target is the default's, which keeps "no job waits for the poll";
                # after_commit is the opt-in trade, shown beside it.
                target = PRODUCER_TARGET if n == 32 and mode == "with_commit" else None
                ratio = paired(side, reference)
                each = ", ".join(f"{a / b:.2f}" for a, b in zip(rates[side], rates[reference], strict=True))
                rows.append(Row(
                    f"{n} producers, one job per transaction, {what}: wake-up {mode} / none",
                    f"{med[side]:,.0f} commits/s (none {med[reference]:,.0f}); rounds {each}", raw,
                    ratio, f">= {target:.2f}x" if target else "", None if target is None else ratio >= target,
                ))
    _truncate(engine)
    return rows


def _truncate(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE bench_jobs, bench_jobs_after, bench_jobs_none, bench_orders RESTART IDENTITY"))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE bench_jobs, bench_jobs_after, bench_jobs_none, bench_orders"))


# -- 1. steady load beside a held snapshot -----------------------------------------------


def _load_child(kind: str, url_text: str, rate: float, seconds: float, ready: Any, go: Any) -> None:
    """Producers: ``rate`` jobs/s, one per transaction, paced, over 2 threads.

    sqla_queue's enqueue with ``enqueue_values()`` on a Connection (its INSERT carries the
    wake-up), not ``session.enqueue()``: the ORM's Python time per job (about 900 µs)
    at 800 jobs/s takes most of a CPU of this 2-CPU machine, which the server and the
    worker share, and the offered rate was not met even in the clean run. What the
    producers cost is ``producers``' business; this run measures the consumers."""
    url = make_url(url_text)
    threads = 2
    channel = queue_table(BenchJob).channel
    engine = create_engine(url, pool_size=threads + 2) if kind == "sqla" else None
    ready.put(os.getpid())
    go.wait()
    start = time.monotonic()

    def loop(i: int) -> None:
        step = threads / rate
        due = start + i * step / threads
        conn = raw_connect(url) if kind == "raw" else None
        while due < start + seconds:
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if conn is None:
                assert engine is not None
                with engine.connect() as sa:
                    enqueue_values(sa, BenchJob, {"recipient": "user@example.com"})
                    sa.commit()
            else:
                conn.execute("INSERT INTO bench_jobs (queue, recipient) VALUES ('default', 'user@example.com')",
                             prepare=True)
                conn.execute("SELECT pg_notify(%s, 'default')", (channel,), prepare=True)
                conn.commit()
            due += step

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def _consume_child(kind: str, url_text: str, ready: Any, go: Any, stop: Any) -> None:
    """The consumers: the Worker at default options, or 4 raw threads that claim with the
    same statement, LISTEN between claims that find nothing and poll every second."""
    url = make_url(url_text)
    if kind == "sqla":
        engine = create_engine(url)
        worker = Worker(engine, BenchJob, bench.noop)
        engine.connect().close()
        ready.put(os.getpid())
        go.wait()
        worker.start()
        stop.wait()
        worker.stop(grace=10)
        engine.dispose()
        return
    channel = queue_table(BenchJob).channel
    owner = f"raw-{os.getpid()}"
    sql, params = bench.claim_sql(create_engine(url), owner, bench.BASELINE_BATCH)
    ready.put(os.getpid())
    go.wait()

    def loop() -> None:
        conn = raw_connect(url)
        listen = raw_connect(url, autocommit=True)
        listen.execute(f'LISTEN "{channel}"')
        with conn.cursor() as cur:
            while not stop.is_set():
                jobs = cur.execute(sql, params, prepare=True).fetchall()
                conn.commit()
                if not jobs:
                    for _ in listen.notifies(timeout=1.0, stop_after=1):
                        pass
                    continue
                for job in jobs:
                    bench.noop(job)
                cur.execute(bench.RAW_COMPLETE, ([j[bench.ID_INDEX] for j in jobs], owner), prepare=True)
                conn.commit()
        conn.close()
        listen.close()

    workers = [threading.Thread(target=loop) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def _sample(conn: psycopg.Connection[Any]) -> dict[str, float]:
    """The table's dead tuples and sizes, and the claims' calls and time so far."""
    dead, table_size, vacuums = conn.execute(
        "SELECT n_dead_tup, pg_relation_size('bench_jobs'), autovacuum_count FROM pg_stat_user_tables "
        "WHERE relname = 'bench_jobs'"
    ).fetchone() or (0, 0, 0)
    sample: dict[str, float] = {"dead": float(dead), "autovacuums": float(vacuums), "table MB": table_size / 2**20}
    for name, size in conn.execute(
        "SELECT indexrelname, pg_relation_size(indexrelid) FROM pg_stat_user_indexes WHERE relname = 'bench_jobs'"
    ):
        sample[f"{name} MB"] = size / 2**20
    calls, total = conn.execute(
        "SELECT coalesce(sum(calls), 0), coalesce(sum(total_exec_time), 0) FROM pg_stat_statements "
        "WHERE query ILIKE '%FOR UPDATE SKIP LOCKED%' AND dbid = (SELECT oid FROM pg_database WHERE datname = "
        "current_database())"
    ).fetchone() or (0, 0)
    sample["claim calls"], sample["claim ms"] = float(calls), float(total)
    return sample


def _statement_times(conn: psycopg.Connection[Any]) -> dict[int, tuple[float, float]]:
    """Each statement's calls and total server time (ms) so far."""
    return {
        int(queryid): (float(calls), float(total))
        for queryid, calls, total in conn.execute(
            "SELECT queryid, calls, total_exec_time FROM pg_stat_statements "
            "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
    }


def run_hold(
    url: URL, engine: Engine, kind: str, minutes: float, rate: float, held: bool, *, finished: int = 0,
    storage: dict[str, Any] | None = None,
) -> list[dict[str, float]]:
    """One steady-load run; per minute: throughput, pickup p50/p99, claim mean, dead
    tuples and sizes at the minute's end. ``finished``: rows of finished jobs loaded
    first (the jobs a retention keeps); ``storage``: the table's storage parameters
    (none: the server's defaults)."""
    seconds = minutes * 60
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE bench_jobs RESTART IDENTITY"))
        conn.execute(text(f"ALTER TABLE bench_jobs RESET ({', '.join(STORAGE_PARAMETERS)})"))
        if storage:
            conn.execute(text(f"ALTER TABLE bench_jobs SET ({', '.join(f'{k} = {v}' for k, v in storage.items())})"))
    if finished:
        _load_finished(url, finished)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE bench_jobs"))
        conn.execute(text("SELECT pg_stat_statements_reset()"))
        conn.execute(text("SELECT pg_stat_reset_single_table_counters('bench_jobs'::regclass)"))
    ctx = bench.process_context()
    ready, go, stop = ctx.Queue(), ctx.Event(), ctx.Event()
    url_text = url.render_as_string(hide_password=False)
    # The producers in processes of their own, two, so that the ORM's Python time per
    # enqueue cannot hold the offered rate down.
    procs = [ctx.Process(target=_consume_child, args=(kind, url_text, ready, go, stop), daemon=True)] + [
        ctx.Process(target=_load_child, args=(kind, url_text, rate / 2, seconds, ready, go), daemon=True)
        for _ in range(2)]
    for p in procs:
        p.start()
    samples: list[dict[str, float]] = []
    #: Per sample: each statement's (calls, total ms) so far, by queryid.
    statements: list[dict[int, tuple[float, float]]] = []
    holder = None
    try:
        bench.wait_ready(ready, procs)
        watch = raw_connect(url, autocommit=True)
        (began,) = watch.execute("SELECT now()").fetchone() or (None,)
        log_from = _log_size()
        go.set()
        start = time.monotonic()
        # A tenth of a short run; at least 0.1 s (a quick run's whole load lasts a second).
        minute = 60.0 if minutes >= 5 else max(seconds / 10, 0.1)
        next_sample = start + minute
        hold_from, hold_to = start + 0.2 * seconds, start + 0.8 * seconds
        while time.monotonic() < start + seconds:
            now = time.monotonic()
            if held and holder is None and hold_from <= now < hold_to:
                holder = raw_connect(url)
                holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                holder.execute("SELECT count(*) FROM bench_orders")  # takes the snapshot
            if holder is not None and now >= hold_to:
                holder.rollback()
                holder.close()
                holder = None
            if now >= next_sample:
                samples.append(_sample(watch))
                statements.append(_statement_times(watch))
                next_sample += minute
            time.sleep(0.05)
        samples.append(_sample(watch))
        statements.append(_statement_times(watch))
        # Per minute, from the rows: finished per minute, pickup by the minute enqueued.
        rows = watch.execute(
            "WITH t AS (SELECT extract(epoch FROM created_at - %s) AS at, "
            "extract(epoch FROM started_at - created_at) AS pickup FROM bench_jobs "
            "WHERE started_at IS NOT NULL AND created_at >= %s) "
            "SELECT floor(at / %s)::int AS m, count(*), percentile_cont(0.5) WITHIN GROUP (ORDER BY pickup), "
            "percentile_cont(0.99) WITHIN GROUP (ORDER BY pickup) FROM t GROUP BY 1 ORDER BY 1",
            (began, began, minute),
        ).fetchall()
        for queryid, calls, total, mean, query in watch.execute(
            "SELECT queryid, calls, total_exec_time, mean_exec_time, regexp_replace(query, '\\s+', ' ', 'g') "
            "FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "ORDER BY total_exec_time DESC LIMIT 10"
        ):
            kind = ("cursor claim: " if "same_priority" in query else
                    "head claim: " if "SKIP LOCKED" in query else "")
            say(f"    server time: {total / 1000:6.1f} s in {calls:7,} calls ({mean:.3f} ms): {kind}{query[:80]}")
            means = []
            for before, after in zip([{}, *statements], statements, strict=False):
                c0, t0 = before.get(queryid, (0.0, 0.0))
                c1, t1 = after.get(queryid, (0.0, 0.0))
                means.append(f"{(t1 - t0) / (c1 - c0):.2f}" if c1 > c0 else "-")
            say(f"      ms a call, per {minute:g} s: {' '.join(means)}")
        passes = _autovacuum_passes(log_from)
        if passes:
            say(f"    autovacuum of bench_jobs: {len(passes)} passes, " + ", ".join(f"{p:.2f}" for p in passes) + " s")
        watch.close()
    finally:
        if holder is not None:
            holder.close()
        stop.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    previous = {"claim calls": 0.0, "claim ms": 0.0}
    per_minute = []
    for i, sample in enumerate(samples[: len(rows)]):
        calls = sample["claim calls"] - previous["claim calls"]
        claim_ms = (sample["claim ms"] - previous["claim ms"]) / calls if calls else 0.0
        previous = sample
        m, count, p50, p99 = rows[i] if i < len(rows) else (i, 0, 0.0, 0.0)
        per_minute.append({"minute": float(m), "from s": float(m) * minute, "jobs/s": count / minute,
                           "p50 ms": (p50 or 0) * 1000, "p99 ms": (p99 or 0) * 1000, "claim ms": claim_ms,
                           **{k: v for k, v in sample.items() if not k.startswith("claim")}})
    return per_minute


def bench_hold(engine: Engine, url: URL, args: argparse.Namespace) -> list[Row]:
    rows = []
    results: dict[tuple[str, bool], list[dict[str, float]]] = {}
    kinds = tuple(k.strip() for k in args.sides.split(","))
    for kind in kinds:
        for held in (False, True):
            say(f"  hold: {kind} {'held' if held else 'clean'} ({args.minutes} min)")
            results[kind, held] = run_hold(url, engine, kind, args.minutes, args.rate, held,
                                           storage=RECOMMENDED_STORAGE)
            for m in results[kind, held]:
                say("    " + "  ".join(f"{k} {v:,.1f}" for k, v in m.items()))

    seconds = args.minutes * 60

    def overall(per: list[dict[str, float]], key: str) -> float:
        """The buckets wholly inside the hold's window (the same ones of the clean run):
        the median rate or claim time, the worst p99."""
        if len(per) < 2:
            return 0.0
        width = per[1]["from s"] - per[0]["from s"]
        chosen = [m for m in per if m["from s"] >= 0.2 * seconds and m["from s"] + width <= 0.8 * seconds]
        values = [m[key] for m in chosen] or [0.0]
        return max(values) if key == "p99 ms" else statistics.median(values)

    def ratio(a: float, b: float) -> float:
        return a / b if b else float("nan")

    def hold_buckets(per: list[dict[str, float]]) -> list[dict[str, float]]:
        if len(per) < 2:
            return per
        width = per[1]["from s"] - per[0]["from s"]
        return [m for m in per if m["from s"] >= 0.2 * seconds and m["from s"] + width <= 0.8 * seconds]

    deg: dict[str, tuple[float, float, float]] = {}
    for kind in kinds:
        clean_run, held_run = results[kind, False], results[kind, True]
        during = hold_buckets(held_run)
        growth = ratio(during[-1]["claim ms"], during[0]["claim ms"]) if during else float("nan")
        deg[kind] = (ratio(overall(held_run, "jobs/s"), overall(clean_run, "jobs/s")),
                     ratio(overall(held_run, "p99 ms"), overall(clean_run, "p99 ms")), growth)
    if "sqla" not in deg:
        return rows
    base = deg.get("raw")
    for i, (label, target) in enumerate((
        ("throughput during the hold / clean run", HOLD_THROUGHPUT_TARGET),
        ("pickup p99 during the hold / clean run", HOLD_P99_TARGET),
        ("claim's mean time, the hold's last minute / its first", HOLD_CLAIM_GROWTH_TARGET),
    )):
        ours = deg["sqla"][i]
        better = base is None or (ours >= base[i] if i == 0 else ours <= base[i])
        met = (ours >= target if i == 0 else ours <= target) and better
        rows.append(Row(f"held snapshot: {label}", f"{ours:.2f}x", "not run" if base is None else f"{base[i]:.2f}x",
                        ours, f"{'>=' if i == 0 else '<='} {target:.1f}x and better than the baseline",
                        met if base is not None else None))
    claim = {k: (overall(results[k, True], "claim ms"), overall(results[k, False], "claim ms")) for k in kinds}
    raw_claim = claim.get("raw")
    rows.append(Row("held snapshot: claim's mean time during the hold / clean",
                    f"{claim['sqla'][0]:.2f} / {claim['sqla'][1]:.2f} ms",
                    "not run" if raw_claim is None else f"{raw_claim[0]:.2f} / {raw_claim[1]:.2f} ms",
                    claim["sqla"][0] / claim["sqla"][1] if claim["sqla"][1] else None, "", None))
    return rows


# -- settings: per-table autovacuum and fillfactor under churn ---------------------------

def _load_finished(url: URL, n: int) -> None:
    """``n`` rows of jobs finished in the last hour (no retention prunes them)."""
    with raw_connect(url) as conn:
        conn.execute(
            "INSERT INTO bench_jobs (queue, recipient, status, attempts, created_at, started_at, finished_at) "
            "SELECT 'default', 'user@example.com', 'done', 1, t, t, t "
            "FROM (SELECT now() - interval '1 hour' + i * (interval '1 hour' / %s) AS t "
            "FROM generate_series(1, %s) AS i) AS s",
            (n, n),
        )
        conn.commit()


def bench_settings(engine: Engine, url: URL, args: argparse.Namespace) -> list[Row]:
    """The steady load (no held snapshot) on a table holding ``--settings-finished``
    finished jobs, once per storage variant: what autovacuum keeps of the table."""
    rows = []
    finished = 20_000 if args.quick else args.settings_finished
    for label, storage in SETTINGS_VARIANTS.items():
        say(f"  settings: {label} ({args.settings_minutes} min, {finished:,} finished rows first)")
        per = run_hold(url, engine, "sqla", args.settings_minutes, args.rate, False, finished=finished,
                       storage=storage)
        for m in per:
            say("    " + "  ".join(f"{k} {v:,.1f}" for k, v in m.items()))
        last = per[-1] if per else {}
        indexes = sum(v for k, v in last.items() if k.endswith("MB") and k != "table MB")
        steady = per[1:] or per  # past the first minute's warm-up
        rows.append(Row(
            f"churn at {args.rate:,.0f} jobs/s for {args.settings_minutes:g} min beside {finished:,} finished rows: "
            f"{label}",
            f"{statistics.median(m['jobs/s'] for m in steady):,.0f} jobs/s, pickup p99 "
            f"{max(m['p99 ms'] for m in steady):.1f} ms, "
            f"claim {statistics.median(m['claim ms'] for m in steady):.2f} ms",
            f"dead tuples at most {max(m['dead'] for m in per):,.0f}, {last.get('autovacuums', 0):.0f} autovacuums; "
            f"at the end table {last.get('table MB', 0):,.0f} MB, indexes {indexes:,.0f} MB",
            None, "", None,
        ))
    return rows


# -- 3. a big table ----------------------------------------------------------------------


def _claim_latency(url: URL, engine: Engine, n: int) -> list[float]:
    """Seconds per claim of one job and its completion, on one connection, ``n`` times."""
    sql, params = bench.claim_sql(engine, "probe", 1)
    times = []
    with raw_connect(url) as conn, conn.cursor() as cur:
        for _ in range(n):
            t0 = time.perf_counter()
            jobs = cur.execute(sql, params, prepare=True).fetchall()
            conn.commit()
            times.append(time.perf_counter() - t0)
            cur.execute(bench.RAW_COMPLETE, ([j[bench.ID_INDEX] for j in jobs], "probe"), prepare=True)
            conn.commit()
    return times


def _enqueue_rate(engine: Engine, seconds: float) -> float:
    """Jobs per second, one ``session.enqueue()`` per transaction, for ``seconds``."""
    n, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        with QueueSession(engine) as session:
            session.enqueue(BenchJob(recipient="user@example.com", queue="other"))
            session.commit()
        n += 1
    return n / seconds


def bench_big(engine: Engine, url: URL, args: argparse.Namespace) -> list[Row]:
    finished, pending, probes = (20_000, 5_000, 200) if args.quick else (args.finished, 100_000, 2000)
    enqueue_seconds = 0.5 if args.quick else 3.0
    results: dict[str, dict[str, float]] = {}
    for label, n_finished in (("empty", 0), ("big", finished)):
        with engine.begin() as conn:
            conn.execute(text("TRUNCATE bench_jobs RESTART IDENTITY"))
        t0 = time.perf_counter()
        with raw_connect(url) as conn:
            if n_finished:
                conn.execute(
                    "INSERT INTO bench_jobs (queue, recipient, status, attempts, created_at, finished_at) "
                    "SELECT 'default', 'u', 'done', 1, now() - interval '30 days' + i * interval '1 ms', "
                    "now() - interval '30 days' + i * interval '1 ms' FROM generate_series(1, %s) AS i",
                    (n_finished,),
                )
            conn.execute("INSERT INTO bench_jobs (queue, recipient) SELECT 'default', 'u' "
                         "FROM generate_series(1, %s)", (pending,))
            conn.commit()
        with raw_connect(url, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE bench_jobs")
        say(f"  big: {label}: {n_finished:,} finished + {pending:,} pending loaded in {time.perf_counter() - t0:.0f}s")
        times = _claim_latency(url, engine, probes)
        results[label] = {"p50": statistics.median(times) * 1000, "p99": percentile(times, 99) * 1000,
                          "enqueue": _enqueue_rate(engine, enqueue_seconds)}
        if n_finished:
            # Prune in bounded batches while a probe claims beside it.
            beside: list[float] = []
            stop = threading.Event()

            def probe(stop: threading.Event, beside: list[float]) -> None:
                while not stop.is_set():
                    beside.extend(_claim_latency(url, engine, 20))

            thread = threading.Thread(target=probe, args=(stop, beside))
            thread.start()
            t0 = time.perf_counter()
            deleted, batches, longest = 0, 0, 0.0
            while True:
                b0 = time.perf_counter()
                with engine.begin() as conn:
                    stmt = q.prune_finished(BenchJob, older_than=timedelta(days=1), limit=10_000)
                    n = int(conn.execute(stmt).rowcount)
                longest = max(longest, time.perf_counter() - b0)
                deleted += n
                batches += 1
                if n < 10_000:
                    break
            prune_seconds = time.perf_counter() - t0
            stop.set()
            thread.join()
            results[label] |= {
                "prune rows/s": deleted / prune_seconds, "prune batch max s": longest,
                "claim p50 beside prune": statistics.median(beside) * 1000 if beside else 0.0,
                "claim p99 beside prune": percentile(beside, 99) * 1000 if beside else 0.0,
                "claim max beside prune": max(beside) * 1000 if beside else 0.0,
            }
        say(f"  big: {label}: " + ", ".join(f"{k} {v:,.2f}" for k, v in results[label].items()))
    big, empty = results["big"], results["empty"]
    ratio = big["p50"] / empty["p50"]
    rows = [
        Row(f"claim latency at {finished:,} finished rows / empty table (p50)",
            f"{big['p50']:.2f} ms (p99 {big['p99']:.2f})", f"empty: {empty['p50']:.2f} ms (p99 {empty['p99']:.2f})",
            ratio, f"<= {BIG_CLAIM_TARGET:.1f}x", ratio <= BIG_CLAIM_TARGET),
        Row(f"enqueue at {finished:,} finished rows / empty table", f"{big['enqueue']:,.0f}/s",
            f"empty: {empty['enqueue']:,.0f}/s", big["enqueue"] / empty["enqueue"], "", None),
        Row("prune in batches of 10,000 beside claims", f"{big['prune rows/s']:,.0f} rows/s, "
            f"longest batch {big['prune batch max s']:.2f}s",
            f"claims beside it: p50 {big['claim p50 beside prune']:.2f} ms, p99 {big['claim p99 beside prune']:.2f} "
            f"ms, max {big['claim max beside prune']:.0f} ms", None, "", None),
    ]
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE bench_jobs RESTART IDENTITY"))
    return rows


# -- 4. processes ------------------------------------------------------------------------


def bench_processes(engine: Engine, url: URL, args: argparse.Namespace) -> list[Row]:
    rows = []
    jobs = 200 if args.quick else 40_000
    for processes in (1, 2) if args.quick else (1, 2, 3, 4):
        cfg = bench.Processing(processes, 4, 0, jobs)
        rates: dict[str, list[float]] = {"sqla_queue": [], "raw": []}
        for r in range(args.rounds):
            for kind in (("sqla_queue", "raw") if r % 2 == 0 else ("raw", "sqla_queue")):
                rates[kind].append(bench.run_processing(url, engine, kind, cfg)[0])
        row = bench.throughput_row(f"processing on the production cluster, {cfg.label}", rates["sqla_queue"],
                                   rates["raw"], "jobs/s", PROCESSES_TARGET)
        rows.append(row)
        say(f"  {row.cells()[:4]}")
    return rows


BENCHES: dict[str, Callable[[Engine, URL, argparse.Namespace], list[Row]]] = {
    "producers": bench_producers, "hold": bench_hold, "big": bench_big, "processes": bench_processes,
    "settings": bench_settings,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--only", default=",".join(BENCHES), help="comma-separated: " + ", ".join(BENCHES))
    parser.add_argument("--minutes", type=float, default=10.0, help="each steady-load run (hold)")
    parser.add_argument("--rate", type=float, default=800.0, help="offered jobs/s (hold)")
    parser.add_argument("--sides", default="sqla,raw", help="comma-separated sides of the hold run: sqla, raw")
    parser.add_argument("--finished", type=int, default=10_000_000, help="finished rows (big)")
    parser.add_argument("--settings-minutes", type=float, default=5.0, help="each steady-load run (settings)")
    parser.add_argument("--settings-finished", type=int, default=2_000_000,
                        help="finished rows loaded before each run (settings)")
    parser.add_argument("--seconds", type=float, default=8.0, help="each producers run")
    parser.add_argument("--producers", default="1,8,32,64", help="comma-separated producer counts (producers)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the producers and processes runs")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the harness")
    args = parser.parse_args(argv)
    if args.quick:
        # Tiny: the harness and every row, not figures. A steady-load run of 1.2 s still
        # has ten samples (see run_hold) and a held snapshot from 20 % to 80 % of it.
        args.minutes, args.seconds, args.rounds, args.rate = 0.02, 0.2, 1, 200.0
        args.settings_minutes = 0.02
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - BENCHES.keys())
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(unknown)}")
    rows: list[Row] = []
    with cluster() as url:
        engine = create_engine(url)
        try:
            Base.metadata.create_all(engine)
            with engine.connect() as conn:
                version = conn.execute(text("SHOW server_version")).scalar()
            say(f"server: PostgreSQL {version}, autovacuum on, fsync on, synchronous_commit on")
            for name in names:
                say(f"== {name}")
                rows += BENCHES[name](engine, url, args)
        finally:
            engine.dispose()
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
