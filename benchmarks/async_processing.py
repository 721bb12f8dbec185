"""Processing from asyncio: ``AsyncWorker`` against a hand-written async psycopg loop.

    python benchmarks/async_processing.py [--quick] [--url URL]

:func:`bench_async_processing` has the signature of ``benchmarks/run.py``'s benchmarks
(an entry for its ``BENCHMARKS``) and uses the table, process runner and ``Row`` of
``benchmarks/harness.py``. Run alone, it makes a scratch database the way ``run.py`` does
and prints its rows.

Jobs are loaded beforehand and the handler is a no-op ``async def``; each side runs in a
fresh process, connected before the start signal, timed until no job is pending or
running (the harness's ``run_processing``).

- sqla_queue: ``AsyncWorker`` on an ``AsyncEngine`` (psycopg 3 async) at its default
  options but ``concurrency`` (the number of its asyncio tasks).
- baseline: as many asyncio tasks, each on a ``psycopg.AsyncConnection`` of its own,
  looping: claim 32 jobs with sqla_queue's own claim SQL (``UPDATE … WHERE id IN (SELECT
  … FOR UPDATE SKIP LOCKED LIMIT 32) RETURNING *``, prepared), await the no-op on each,
  complete them in one ``UPDATE``; as run.py's sync baseline does with threads.
- raw best: the harness's thread loop at its best setting (one thread, ``RAW_BEST_BATCH``
  rows a claim), in the same rounds: every row is also held to it.
- pgqueuer (when installed): its own worker, ``PgQueuer.run`` with an async no-op
  entrypoint, as ``benchmarks/peers.py`` runs it, swept over ``batch_size``; the row
  compares the best AsyncWorker rate with pgqueuer's best.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
from collections.abc import Sequence
from typing import Any

import harness as bench
import peers
import psycopg
from sqlalchemy import URL, Engine, create_engine, make_url

#: The ratio to the async baseline the AsyncWorker is held to (as the thread Worker is).
TARGET = 0.8
#: AsyncWorker's best rate against pgqueuer's best, one process each.
PGQUEUER_TARGET = 2.0
#: The runs of the harness's raw loop at its best setting (one thread, ``raw_best_batches``).
RAW_BEST = "raw_best"


async def anoop(job: Any) -> None:
    """The no-op async handler: what is measured is the queue, not the work."""


def async_child(
    kind: str, url_text: str, concurrency: int, batch: int, ready: Any, go: Any, stop: Any
) -> None:
    """One worker process (the harness's ``_processing_child`` protocol): ready, then work
    until told to stop; reports the CPU time it spent from the start signal to the end of its
    work."""
    url = make_url(url_text)
    if kind == "async_sqla_queue":
        cpu = asyncio.run(_worker_main(url, concurrency, batch, ready, go, stop))
    else:
        cpu = asyncio.run(_raw_main(url, concurrency, batch, ready, go, stop))
    ready.put(cpu)


async def _worker_main(
    url: URL, concurrency: int, batch: int, ready: Any, go: Any, stop: Any
) -> float:
    from sqlalchemy.ext.asyncio import create_async_engine

    from sqla_queue import AsyncWorker

    engine = create_async_engine(url.set(drivername="postgresql+psycopg"), pool_size=concurrency + 3)
    # batch 0: the AsyncWorker's default batch size (only ``concurrency`` set).
    options: dict[str, Any] = {"batch_size": batch} if batch else {}
    worker = AsyncWorker(engine, bench.BenchJob, anoop, concurrency=concurrency, **options)
    async with engine.connect():  # warm: the first connection of a process costs more
        pass
    ready.put(os.getpid())
    await asyncio.to_thread(go.wait)
    cpu = bench.cpu_seconds()
    await worker.start()
    await asyncio.to_thread(stop.wait)
    cpu = bench.cpu_seconds() - cpu
    await worker.stop(grace=10)
    await engine.dispose()
    return cpu


async def _raw_main(
    url: URL, concurrency: int, batch: int, ready: Any, go: Any, stop: Any
) -> float:
    owner = f"raw-async-{os.getpid()}"
    sql, params = bench.claim_sql(create_engine(url), owner, batch or bench.BASELINE_BATCH)
    info = bench.conninfo(url)
    await (await psycopg.AsyncConnection.connect(info)).close()  # warm, as the other side
    ready.put(os.getpid())
    await asyncio.to_thread(go.wait)
    cpu = bench.cpu_seconds()
    # Connected after the start signal, as the AsyncWorker's tasks connect when it starts.
    conns = await asyncio.gather(*(psycopg.AsyncConnection.connect(info) for _ in range(concurrency)))
    await asyncio.gather(*(_raw_loop(conn, sql, params, owner) for conn in conns))
    cpu = bench.cpu_seconds() - cpu
    for conn in conns:
        await conn.close()
    await asyncio.to_thread(stop.wait)
    return cpu


async def _raw_loop(
    conn: psycopg.AsyncConnection[tuple[Any, ...]],
    sql: str,
    params: dict[str, Any],
    owner: str,
) -> None:
    """The hand-written async worker loop: claim a batch, await the no-op on each, complete
    the batch in one UPDATE. It stops when a claim finds nothing (the jobs were all loaded
    before)."""
    id_index = bench.ID_INDEX
    async with conn.cursor() as cur:
        while True:
            await cur.execute(sql, params, prepare=True)
            jobs = await cur.fetchall()
            await conn.commit()
            if not jobs:
                return
            for job in jobs:
                await anoop(job)
            await cur.execute(bench.RAW_COMPLETE, ([job[id_index] for job in jobs], owner), prepare=True)
            await conn.commit()


def label(cfg: bench.Processing) -> str:
    tasks = f"{cfg.concurrency} tasks" if cfg.concurrency > 1 else "1 task"
    batch = cfg.batch or f"default (baseline {bench.BASELINE_BATCH})"
    return f"1 process x {tasks}, batch {batch}"


def bench_async_processing(engine: Engine, url: URL, plan: bench.Plan) -> list[bench.Row]:
    """Jobs per second, AsyncWorker against the async baseline at the same concurrency, and
    (when pgqueuer is installed) AsyncWorker's best against pgqueuer's best.

    ``plan``: its ``async_processing``, ``processing_rounds``, ``raw_best_batches``,
    ``pgqueuer_batch_sizes`` and ``pgqueuer_jobs``.
    Every round runs each (side, setting) once, in an order rotated from round to round.
    """
    with_pgqueuer = peers.available(peers.PGQUEUER)
    runs: list[tuple[str, Any]] = [
        (kind, cfg) for cfg in plan.async_processing for kind in ("async_sqla_queue", "async_raw")
    ]
    # The thread-based raw loop at its best setting, 1 process: what the machine can do.
    best_jobs = max(cfg.jobs for cfg in plan.async_processing)
    runs += [(RAW_BEST, batch) for batch in plan.raw_best_batches]
    if with_pgqueuer:
        runs += [(peers.PGQUEUER, size) for size in plan.pgqueuer_batch_sizes]
        peer_plan = peers.Plan(
            jobs=plan.pgqueuer_jobs, rounds=1, processes=(1,), settings={}, timeout=300
        )
        asyncio.run(peers.install(peers.PGQUEUER, url))
    rates: dict[tuple[str, Any], list[float]] = {run: [] for run in runs}
    cpus: dict[tuple[str, Any], list[float]] = {run: [] for run in runs}
    try:
        for r in range(plan.processing_rounds):
            shift = r % len(runs)
            for kind, setting in runs[shift:] + runs[:shift]:
                if kind == RAW_BEST:
                    rate, cpu = bench.run_processing(url, engine, "raw", bench.Processing(1, 1, setting, best_jobs))
                elif kind == peers.PGQUEUER:
                    rate, cpu = peers.run_peer_processing(url, kind, setting, 1, peer_plan)
                else:
                    rate, cpu = bench.run_processing(url, engine, kind, setting, child=async_child)
                rates[kind, setting].append(rate)
                cpus[kind, setting].append(cpu)
    finally:
        bench.reset(engine)
        if with_pgqueuer:
            asyncio.run(peers.uninstall(peers.PGQUEUER, url))

    def cell(kind: str, setting: Any) -> str:
        return f" ({statistics.median(cpus[kind, setting]):,.0f} µs CPU/job)"

    rows = []
    for cfg in plan.async_processing:
        ours, base = rates["async_sqla_queue", cfg], rates["async_raw", cfg]
        row = bench.throughput_row(
            f"async processing, AsyncWorker, {label(cfg)}", ours, base, "jobs/s",
            None if cfg.batch else TARGET,
        )
        row.ours += cell("async_sqla_queue", cfg)
        row.base += cell("async_raw", cfg) + " (async psycopg)"
        batch = max(plan.raw_best_batches, key=lambda b: statistics.median(rates[RAW_BEST, b]))
        row.against_best(ours, rates[RAW_BEST, batch], cpus[RAW_BEST, batch])
        row.best += f", batch {batch}" if batch != bench.RAW_BEST_BATCH else ""
        rows.append(row)
    defaults = [cfg for cfg in plan.async_processing if not cfg.batch]
    best = max(defaults, key=lambda cfg: statistics.median(rates["async_sqla_queue", cfg]))
    name = "async processing, AsyncWorker's best vs pgqueuer's best, 1 process"
    if not with_pgqueuer:
        rows.append(bench.Row(name, "—", f"pgqueuer not installed ({peers.INSTALL_HINT})"))
    else:
        size = max(
            plan.pgqueuer_batch_sizes, key=lambda s: statistics.median(rates[peers.PGQUEUER, s])
        )
        row = bench.throughput_row(
            name, rates["async_sqla_queue", best], rates[peers.PGQUEUER, size], "jobs/s", PGQUEUER_TARGET
        )
        row.ours += f" ({best.concurrency} tasks)"
        row.base += f" (pgqueuer {peers.version('pgqueuer')}, batch_size {size}){cell(peers.PGQUEUER, size)}"
        rows.append(row)
    for row in rows:
        bench.say(f"  {row.name}: {row.cells()[1:4]}")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    return bench.run_alone(bench_async_processing, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
