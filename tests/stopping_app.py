"""A worker process whose handler checks, at safe points, whether the worker stops.

``sqla-queue worker tests.stopping_app:make_worker``: the ``careful`` task writes
``payload["started"]`` when it starts, then works in small steps, calling
``current_job().check()`` between them, for up to a minute; told that the worker stops,
it writes the reason to ``payload["told"]`` and gives up (the job is handed back).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from sqla_queue import AsyncWorker, JobCancelled, Tasks, Worker, current_job

from .worker_app import worker_for

tasks = Tasks()
async_tasks = Tasks()


def _told(job: Any, exc: JobCancelled) -> None:
    Path(job.payload["told"]).write_text(exc.reason)


@tasks.task
def careful(job: Any) -> None:
    Path(job.payload["started"]).write_text("started")
    context = current_job()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            context.check()
        except JobCancelled as exc:
            _told(job, exc)
            raise
        time.sleep(0.01)


@async_tasks.task(name="careful")
async def careful_async(job: Any) -> None:
    Path(job.payload["started"]).write_text("started")
    context = current_job()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            context.check()
        except JobCancelled as exc:
            _told(job, exc)
            raise
        await asyncio.sleep(0.01)


def make_worker() -> Worker | AsyncWorker:
    return worker_for(tasks, async_tasks)
