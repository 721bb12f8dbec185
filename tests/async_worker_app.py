"""The asyncio application that ``sqla-queue worker`` processes started by the tests run.

``sqla-queue worker tests.async_worker_app:make_worker`` builds an ``AsyncWorker`` on the
test database (``SQLA_QUEUE_TEST_URL``, set for every process the tests start) for the
``tasks`` table; ``tests.async_worker_app:worker`` is one built at import.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from sqla_queue import AsyncWorker, Tasks

from .models import Effect, Task

tasks = Tasks()

#: Handlers running right now in this process.
_running = 0


@tasks.task
async def record(job: Any, session: AsyncSession) -> None:
    """Transactional: the Effect row, written before the pause, commits with the job's
    completion or rolls back with it; its note says how many handlers this process was
    running at once when the job started."""
    global _running
    _running += 1
    try:
        session.add(Effect(job_id=job.id, worker=str(os.getpid()), note=f"running {_running}"))
        await session.flush()
        started = job.payload.get("started")
        if started:
            Path(started).write_text(str(os.getpid()))
        await asyncio.sleep(float(job.payload.get("sleep", 0)))
    finally:
        _running -= 1


def make_worker() -> AsyncWorker:
    engine = create_async_engine(
        os.environ["SQLA_QUEUE_TEST_URL"],
        connect_args={"application_name": os.environ.get("SQLA_QUEUE_APP_NAME", "sqla_queue_async_worker")},
    )
    return AsyncWorker(engine, Task, tasks)


#: An AsyncWorker object rather than a factory: ``tests.async_worker_app:worker``.
worker = make_worker()
