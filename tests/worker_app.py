"""The application that worker processes started by the tests run.

``sqla-queue worker tests.worker_app:make_worker`` builds a worker on the test database
(``SQLA_QUEUE_TEST_URL``) for the ``tasks`` table: a thread ``Worker``, or an
``AsyncWorker`` running the ``async def`` twins of the tasks when
``SQLA_QUEUE_TEST_RUNTIME=asyncio``. What a task does is driven by its payload, so one
registry serves every scenario.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from sqla_queue import AsyncWorker, DeadLetter, RetryLater, Tasks, Worker
from sqla_queue.runtime import sleep

from .models import Effect, EmailJob, Task

tasks = Tasks()


def _pause(job: Any) -> None:
    """Sleep ``payload["sleep"]`` seconds; announce the start in ``payload["started"]``."""
    started = job.payload.get("started")
    if started:
        Path(started).write_text(str(os.getpid()))
    sleep(float(job.payload.get("sleep", 0)))


@tasks.task
def record(job: Any, session: Session) -> None:
    """Transactional: the Effect row commits together with the job's completion."""
    _pause(job)
    session.add(Effect(job_id=job.id, worker=str(os.getpid()), note=f"attempt {job.attempts}"))


@tasks.task
def work(job: Any) -> None:
    """Not transactional: just takes its time."""
    _pause(job)


#: Never set: what a handler stuck for good waits on.
_never = threading.Event()


@tasks.task
def stuck(job: Any) -> None:
    """A plain handler that never returns (a call without a timeout, a deadlock); the
    asyncio worker runs it in its thread pool too."""
    Path(job.payload["started"]).write_text(str(os.getpid()))
    _never.wait()


@tasks.task
def crash(job: Any) -> None:
    """Kills its own worker process, every attempt."""
    sleep(float(job.payload.get("sleep", 0)))
    os.kill(os.getpid(), signal.SIGKILL)


@tasks.task
def flaky(job: Any) -> None:
    if job.attempts < int(job.payload["succeed_on"]):
        raise RuntimeError(f"flaky failure on attempt {job.attempts}")


@tasks.task
def poison(job: Any) -> None:
    raise DeadLetter("this input can never work")


@tasks.task
def later(job: Any) -> None:
    if job.attempts == 1:
        raise RetryLater(float(job.payload["delay"]), "not yet")


@tasks.task
def greet(job: Any, *, name: str, times: int = 1) -> None:
    """Takes its payload as keywords: ``sqla-queue enqueue`` checks a payload against them."""


async_tasks = Tasks()


async def _pause_async(job: Any) -> None:
    started = job.payload.get("started")
    if started:
        Path(started).write_text(str(os.getpid()))
    await asyncio.sleep(float(job.payload.get("sleep", 0)))


@async_tasks.task(name="record")
async def record_async(job: Any, session: AsyncSession) -> None:
    await _pause_async(job)
    session.add(Effect(job_id=job.id, worker=str(os.getpid()), note=f"attempt {job.attempts}"))


@async_tasks.task(name="work")
async def work_async(job: Any) -> None:
    await _pause_async(job)


@async_tasks.task(name="crash")
async def crash_async(job: Any) -> None:
    await asyncio.sleep(float(job.payload.get("sleep", 0)))
    os.kill(os.getpid(), signal.SIGKILL)


async_tasks.task(name="stuck")(stuck)


@async_tasks.task(name="flaky")
async def flaky_async(job: Any) -> None:
    flaky(job)


@async_tasks.task(name="poison")
async def poison_async(job: Any) -> None:
    poison(job)


@async_tasks.task(name="later")
async def later_async(job: Any) -> None:
    later(job)


def worker_for(thread_tasks: Tasks, asyncio_tasks: Tasks) -> Worker | AsyncWorker:
    """A worker on the test database for the runtime ``SQLA_QUEUE_TEST_RUNTIME`` names."""
    url = os.environ["SQLA_QUEUE_TEST_URL"]
    connect_args = {"application_name": os.environ.get("SQLA_QUEUE_APP_NAME", "sqla_queue_worker")}
    if os.environ.get("SQLA_QUEUE_TEST_RUNTIME") == "asyncio":
        return AsyncWorker(create_async_engine(url, connect_args=connect_args), Task, asyncio_tasks)
    return Worker(create_engine(url, connect_args=connect_args), Task, thread_tasks)


def make_worker() -> Worker | AsyncWorker:
    return worker_for(tasks, async_tasks)


def _email(job: Any, session: Session) -> None:
    session.add(Effect(job_id=job.id, worker="email", note=job.recipient))


async def _email_async(job: Any, session: AsyncSession) -> None:
    session.add(Effect(job_id=job.id, worker="email", note=job.recipient))


def make_email_worker() -> Worker | AsyncWorker:
    """A worker for the ``email_jobs`` table, beside :func:`make_worker`'s in one process
    (``sqla-queue worker tests.worker_app:make_worker tests.worker_app:make_email_worker``):
    each job writes an effect row with its recipient."""
    url = os.environ["SQLA_QUEUE_TEST_URL"]
    connect_args = {"application_name": os.environ.get("SQLA_QUEUE_APP_NAME", "sqla_queue_worker")}
    if os.environ.get("SQLA_QUEUE_TEST_RUNTIME") == "asyncio":
        return AsyncWorker(create_async_engine(url, connect_args=connect_args), EmailJob, _email_async)
    return Worker(create_engine(url, connect_args=connect_args), EmailJob, _email)
