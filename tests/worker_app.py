"""The application that worker processes started by the tests run.

``sqla-queue worker tests.worker_app:make_worker`` builds a worker on the test database
(``SQLA_QUEUE_TEST_URL``) for the ``tasks`` table. What a task does is driven by its
payload, so one registry serves every scenario.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from sqla_queue import DeadLetter, RetryLater, Tasks, Worker

from .models import Effect, Task

tasks = Tasks()


def _pause(job: Any) -> None:
    """Sleep ``payload["sleep"]`` seconds; announce the start in ``payload["started"]``."""
    started = job.payload.get("started")
    if started:
        Path(started).write_text(str(os.getpid()))
    time.sleep(float(job.payload.get("sleep", 0)))


@tasks.task
def record(job: Any, session: Session) -> None:
    """Transactional: the Effect row commits together with the job's completion."""
    _pause(job)
    session.add(Effect(job_id=job.id, worker=str(os.getpid()), note=f"attempt {job.attempts}"))


@tasks.task
def work(job: Any) -> None:
    """Not transactional: just takes its time."""
    _pause(job)


@tasks.task
def crash(job: Any) -> None:
    """Kills its own worker process, every attempt."""
    time.sleep(float(job.payload.get("sleep", 0)))
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


def make_worker() -> Worker:
    engine = create_engine(
        os.environ["SQLA_QUEUE_TEST_URL"],
        connect_args={"application_name": os.environ.get("SQLA_QUEUE_APP_NAME", "sqla_queue_worker")},
    )
    return Worker(engine, Task, tasks)
