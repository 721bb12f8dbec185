"""The application the recovery tests run as worker *processes*.

``sqla-queue worker tests.recovery_app:make_worker`` builds a worker on the test database
(``SQLA_QUEUE_TEST_URL``) for the ``tasks`` table, like :mod:`tests.worker_app`, with the
tasks the recovery scenarios need: a victim must hold its jobs until it is killed, and
the same jobs must then run quickly for the rescuers.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from sqla_queue import AsyncWorker, Tasks, Worker

from .models import Effect
from .worker_app import worker_for

tasks = Tasks()


@tasks.task
def slow_first(job: Any, session: Session) -> None:
    """Transactional: sleeps ``payload["first"]`` on attempt 1 and ``payload["sleep"]``
    afterwards, then writes one ``Effect`` row that commits with the job's completion."""
    key = "first" if job.attempts == 1 else "sleep"
    time.sleep(float(job.payload.get(key, 0)))
    session.add(Effect(job_id=job.id, worker=str(os.getpid()), note=f"attempt {job.attempts}"))


@tasks.task
def quick(job: Any) -> None:
    """Not transactional: an ordinary short job."""
    time.sleep(float(job.payload.get("sleep", 0)))


async_tasks = Tasks()


@async_tasks.task(name="slow_first")
async def slow_first_async(job: Any, session: AsyncSession) -> None:
    """``slow_first`` as ``async def``, for the asyncio worker."""
    key = "first" if job.attempts == 1 else "sleep"
    await asyncio.sleep(float(job.payload.get(key, 0)))
    session.add(Effect(job_id=job.id, worker=str(os.getpid()), note=f"attempt {job.attempts}"))


@async_tasks.task(name="quick")
async def quick_async(job: Any) -> None:
    await asyncio.sleep(float(job.payload.get("sleep", 0)))


def make_worker() -> Worker | AsyncWorker:
    """A thread ``Worker``, or an ``AsyncWorker`` when ``SQLA_QUEUE_TEST_RUNTIME=asyncio``."""
    return worker_for(tasks, async_tasks)
