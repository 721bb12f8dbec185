"""The application of the workflow tests' worker processes: a worker for ``step_tasks``
whose one transactional task checks, in its own transaction, that every parent of its
job ended ``done`` and that each parent's effect row committed, and writes its own
effect with what it found (``ok``, or ``early: …``).

``sqla-queue worker tests.workflow_app:make_worker`` (``SQLA_QUEUE_TEST_URL``,
``SQLA_QUEUE_TEST_RUNTIME`` as for :mod:`tests.worker_app`). Short leases: a worker
that is SIGKILLed gives its jobs back within a few seconds.
"""

from __future__ import annotations

import os
from typing import Any

from sqlalchemy import create_engine, func, select
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from sqla_queue import AsyncWorker, Backoff, Tasks, Worker, parent_counts
from sqla_queue.runtime import sleep

from .models import Effect, StepTask

tasks = Tasks()
async_tasks = Tasks()


def _check(session: Session, job: Any) -> str:
    """What a child found of its parents when it ran: ``ok`` or why not."""
    counts = parent_counts(session, StepTask, job.id)
    parents = list(job.parent_ids or [])
    effects = session.scalar(select(func.count(func.distinct(Effect.job_id))).where(Effect.job_id.in_(parents))) or 0
    if counts["done"] != len(parents) or effects != len(parents):
        return f"early: {counts} with {effects} of {len(parents)} parents' effects"
    return "ok"


@tasks.task
def step(job: Any, session: Session) -> dict[str, Any]:
    sleep(float(job.payload.get("sleep", 0)))
    note = _check(session, job)
    session.add(Effect(job_id=job.id, worker=str(os.getpid()), note=note))
    return {"job": job.id}


@async_tasks.task(name="step")
async def step_async(job: Any, session: AsyncSession) -> dict[str, Any]:
    import asyncio

    await asyncio.sleep(float(job.payload.get("sleep", 0)))
    note = await session.run_sync(_check, job)
    session.add(Effect(job_id=job.id, worker=str(os.getpid()), note=note))
    return {"job": job.id}


OPTIONS: dict[str, Any] = {
    "lease": 2.0, "heartbeat_interval": 0.5, "sweep_interval": 0.5, "poll_interval": 0.5,
    "concurrency": 4, "backoff": Backoff(base=0.05, cap=0.2),
}


def make_worker() -> Worker | AsyncWorker:
    url = os.environ["SQLA_QUEUE_TEST_URL"]
    connect_args = {"application_name": os.environ.get("SQLA_QUEUE_APP_NAME", "sqla_queue_worker")}
    if os.environ.get("SQLA_QUEUE_TEST_RUNTIME") == "asyncio":
        return AsyncWorker(create_async_engine(url, connect_args=connect_args), StepTask, async_tasks, **OPTIONS)
    return Worker(create_engine(url, connect_args=connect_args), StepTask, tasks, **OPTIONS)
