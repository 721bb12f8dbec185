"""Latency from ``cancel()`` committing to an ``async def`` handler seeing its
``CancelledError``, on an AsyncWorker that listens and on one that polls only.

    python benchmarks/cancel_latency.py postgresql+psycopg://postgres@127.0.0.1/bench [--jobs 20]

Each round starts one job whose handler awaits forever, cancels it in a transaction of
its own, and measures from the commit's return to the handler's ``except``. Creates and
drops its own table (``bench_cancel_jobs``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase

from sqla_queue import AsyncQueueSession, AsyncWorker, JobMixin, cancel


class Base(DeclarativeBase):
    pass


class BenchCancelJob(Base, JobMixin):
    __tablename__ = "bench_cancel_jobs"


async def measure(url: str, jobs: int, listen: bool, poll: float) -> list[float]:
    engine = create_async_engine(url)
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.drop_all)
        await conn.run_sync(Base.metadata.create_all)
    started: asyncio.Queue[int] = asyncio.Queue()
    seen: dict[int, float] = {}
    done = asyncio.Event()

    async def handler(job: Any) -> None:
        started.put_nowait(job.id)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen[job.id] = time.perf_counter()
            done.set()
            raise

    worker = AsyncWorker(engine, BenchCancelJob, handler, listen=listen, poll_interval=poll, concurrency=1)
    await worker.start()
    took: list[float] = []
    try:
        for _ in range(jobs):
            async with AsyncQueueSession(engine) as session:
                session.enqueue(BenchCancelJob())
                await session.commit()
            job_id = await asyncio.wait_for(started.get(), 30)
            done.clear()
            async with AsyncSession(engine) as session:
                assert await cancel(session, BenchCancelJob, ids=[job_id]) == [job_id]
                await session.commit()
                committed = time.perf_counter()
            await asyncio.wait_for(done.wait(), 30)
            took.append(seen[job_id] - committed)
    finally:
        await worker.stop()
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.drop_all)
        await engine.dispose()
    return took


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--poll", type=float, default=1.0)
    args = parser.parse_args()
    for listen in (True, False):
        took = asyncio.run(measure(args.url, args.jobs, listen, args.poll))
        ms = sorted(t * 1000 for t in took)
        label = "LISTEN" if listen else f"poll only ({args.poll:g} s)"
        print(f"{label:>20}: median {statistics.median(ms):7.1f} ms, p90 {ms[int(len(ms) * 0.9) - 1]:7.1f} ms, "
              f"max {ms[-1]:7.1f} ms over {len(ms)} cancels")


if __name__ == "__main__":
    main()
