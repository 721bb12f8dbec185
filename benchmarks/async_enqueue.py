"""Enqueue from asyncio, one job per transaction: ``AsyncQueueSession`` against async psycopg.

    python benchmarks/async_enqueue.py [--quick] [--url URL]

:func:`bench_async_enqueue` has the signature of ``benchmarks/run.py``'s benchmarks (an
entry for its ``BENCHMARKS``) and uses the table, helpers and ``Row`` of
``benchmarks/harness.py``. Run alone, it makes a scratch database the way ``run.py`` does
and prints its rows.

sqla_queue: an ``AsyncQueueSession`` per request on an ``AsyncEngine`` (psycopg 3 async),
``session.enqueue(job)`` and ``await session.commit()``, whose hook sends the NOTIFY.
Baseline: one open ``psycopg.AsyncConnection``, ``INSERT``, ``SELECT pg_notify`` and
``commit()``, each awaited. A third side, the same ORM insert and NOTIFY in a plain
``AsyncSession`` without sqla_queue, shows how much of the gap is SQLAlchemy's async ORM.
The fast path from asyncio, ``await enqueue_values(…)``, runs as a user writes it: in an
``AsyncQueueSession`` per transaction and in ``async with engine.begin()`` (against the
baseline), and on one open autocommit ``AsyncConnection`` (one statement, as pgqueuer's).
When pgqueuer is installed, its ``Queries.enqueue`` on an autocommit asyncpg connection
(one statement, one transaction, its trigger sends the NOTIFY; as ``benchmarks/peers.py``
measures it) runs beside them, its schema installed by its own installer for the run.
The sides alternate, rotating which goes first, and medians are reported.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import harness as bench
import peers
import psycopg
from sqlalchemy import URL, Engine, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

from sqla_queue import AsyncQueueSession, enqueue_values

#: The ratio to the baseline the sync one-job enqueue is held to in run.py.
TARGET = 0.8
ORM_TARGET = 0.9
#: sqla_queue's async one-job enqueue against pgqueuer's.
PGQUEUER_TARGET = 1.0


def bench_async_enqueue(engine: Engine, url: URL, plan: bench.Plan) -> list[bench.Row]:
    """Throughput in transactions per second: sqla_queue, baseline and the ORM reference.

    ``plan``: its ``enqueue_rounds`` and ``enqueue_txns``.
    """
    if not peers.available(peers.PGQUEUER):
        return asyncio.run(_bench(False, engine, url, plan))
    asyncio.run(peers.install(peers.PGQUEUER, url))
    try:
        return asyncio.run(_bench(True, engine, url, plan))
    finally:
        asyncio.run(peers.uninstall(peers.PGQUEUER, url))


async def _bench(with_pgqueuer: bool, engine: Engine, url: URL, plan: bench.Plan) -> list[bench.Row]:
    """Every side, in rounds; ``with_pgqueuer``: pgqueuer's enqueue beside them (its schema
    installed)."""
    async_engine = create_async_engine(url.set(drivername="postgresql+psycopg"))
    factory = async_sessionmaker(async_engine, class_=AsyncQueueSession)
    plain = async_sessionmaker(async_engine, class_=AsyncSession)
    raw = await psycopg.AsyncConnection.connect(bench.conninfo(url))
    notify = text("SELECT pg_notify(:channel, :queue)")

    async def ours(n: int) -> float:
        start = time.perf_counter()
        for i in range(n):
            async with factory() as session:
                session.enqueue(bench.BenchJob(recipient=f"u{i}@example.com"))
                await session.commit()
        return n / (time.perf_counter() - start)

    async def base(n: int) -> float:
        start = time.perf_counter()
        for i in range(n):
            await raw.execute(
                "INSERT INTO bench_jobs (order_id, recipient) VALUES (%s, %s)",
                (None, f"u{i}@example.com"),
            )
            await raw.execute(bench.RAW_NOTIFY, (bench.CHANNEL, "default"))
            await raw.commit()
        return n / (time.perf_counter() - start)

    async def plain_orm(n: int) -> float:
        """The floor: the same ORM insert and NOTIFY without sqla_queue (a reference)."""
        start = time.perf_counter()
        for i in range(n):
            async with plain() as session:
                session.add(bench.BenchJob(recipient=f"u{i}@example.com"))
                await session.execute(notify, {"channel": bench.CHANNEL, "queue": "default"})
                await session.commit()
        return n / (time.perf_counter() - start)

    async def fast_session(n: int) -> float:
        """The fast path in an AsyncQueueSession per transaction."""
        start = time.perf_counter()
        for i in range(n):
            async with factory() as session:
                await enqueue_values(session, bench.BenchJob, {"recipient": f"u{i}@example.com"})
                await session.commit()
        return n / (time.perf_counter() - start)

    async def fast_begin(n: int) -> float:
        """The fast path in ``async with engine.begin()`` per transaction."""
        start = time.perf_counter()
        for i in range(n):
            async with async_engine.begin() as conn:
                await enqueue_values(conn, bench.BenchJob, {"recipient": f"u{i}@example.com"})
        return n / (time.perf_counter() - start)

    autocommit = await (await async_engine.connect()).execution_options(isolation_level="AUTOCOMMIT")

    async def fast_autocommit(n: int) -> float:
        """The fast path on an autocommit connection kept open: one statement per job."""
        start = time.perf_counter()
        for i in range(n):
            await enqueue_values(autocommit, bench.BenchJob, {"recipient": f"u{i}@example.com"})
        return n / (time.perf_counter() - start)

    sides: list[Callable[[int], Awaitable[float]]] = [ours, base, plain_orm, fast_session, fast_begin, fast_autocommit]
    if with_pgqueuer:
        pgq_conn, queries = await peers.pgqueuer_queries(url)

        async def pgqueuer(n: int) -> float:
            start = time.perf_counter()
            for _ in range(n):
                await queries.enqueue(peers.NOOP, None)
            return n / (time.perf_counter() - start)

        sides.append(pgqueuer)
    results: dict[Any, list[float]] = {side: [] for side in sides}
    try:
        for side in sides:
            await side(20)  # warm caches, the pool and prepared statements
        for r in range(plan.enqueue_rounds):
            for side in sides[r % len(sides):] + sides[: r % len(sides)]:
                results[side].append(await side(plan.enqueue_txns))
    finally:
        await raw.close()
        await autocommit.close()
        await async_engine.dispose()
        if with_pgqueuer:
            await pgq_conn.close()
            peers.reset_peer(peers.PGQUEUER, url)
        bench.reset(engine)
    name = "async enqueue, 1 job per transaction"
    # As for the synchronous session.enqueue(): the ORM's unit of work sets the pace, and
    # the target is at most 10 % over the same insert in a plain AsyncSession.
    vs_orm = bench.throughput_row(
        f"{name}: AsyncQueueSession.enqueue() vs the plain AsyncSession reference",
        results[ours], results[plain_orm], "txn/s", ORM_TARGET,
    )
    vs_orm.base += " (the reference)"
    rows = [
        bench.throughput_row(name, results[ours], results[base], "txn/s", None),
        bench.throughput_row(
            f"{name}: plain SQLAlchemy AsyncSession + pg_notify, no sqla_queue (reference)",
            results[plain_orm],
            results[base],
            "txn/s",
            None,
        ),
        vs_orm,
    ]
    rows += [
        bench.throughput_row(
            f"{name}, fast path (await enqueue_values) in an AsyncQueueSession",
            results[fast_session],
            results[base],
            "txn/s",
            TARGET,
        ),
        bench.throughput_row(
            f"{name}, fast path (await enqueue_values) in engine.begin()",
            results[fast_begin],
            results[base],
            "txn/s",
            TARGET,
        ),
    ]
    fast = f"{name}, fast path (await enqueue_values) on an autocommit AsyncConnection"
    for side, label in ((ours, name), (fast_autocommit, fast)):
        vs = f"{label} vs pgqueuer's Queries.enqueue (autocommit)"
        if not with_pgqueuer:
            rows.append(bench.Row(vs, "—", f"pgqueuer not installed ({peers.INSTALL_HINT})"))
        else:
            row = bench.throughput_row(vs, results[side], results[pgqueuer], "txn/s", PGQUEUER_TARGET)
            row.base += f" (pgqueuer {peers.version('pgqueuer')})"
            rows.append(row)
    for row in rows:
        bench.say(f"  {row.name}: {row.cells()[1:4]}")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    return bench.run_alone(bench_async_enqueue, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
