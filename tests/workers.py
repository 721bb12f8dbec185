"""Fixtures and helpers for tests that run workers in this process (a pytest plugin)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import sessionmaker

from sqla_queue import Backoff, QueueSession, Worker

from .helpers import table_of
from .models import Effect, Task
from .worker_app import tasks as app_tasks

#: Retries within a fraction of a second, so tests never wait on a real backoff.
FAST = Backoff(base=0.05, factor=2, cap=0.2, jitter=0)
TASKS = table_of(Task)


@pytest.fixture
def Sessions(engine: Engine) -> sessionmaker[QueueSession]:
    return sessionmaker(engine, class_=QueueSession)


@pytest.fixture
def start_worker(engine: Engine) -> Iterator[Callable[..., Worker]]:
    """``start_worker(handler=app_tasks, model=Task, **options)``: a started worker with
    test-friendly timings; every worker started is stopped after the test."""
    started: list[Worker] = []

    def start(handler: Any = app_tasks, model: Any = Task, **options: Any) -> Worker:
        options.setdefault("backoff", FAST)
        options.setdefault("poll_interval", 0.5)
        options.setdefault("sweep_interval", 0.2)
        options.setdefault("shutdown_grace", 5)
        worker = Worker(engine, model, handler, **options)
        worker.start()
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop(grace=1)


def add(Sessions: sessionmaker[QueueSession], task: str, n: int = 1, **payload: Any) -> list[int]:
    """Enqueue ``n`` tasks named ``task`` with ``payload``; options are taken from it."""
    options = {k: payload.pop(k) for k in ("max_attempts", "queue", "priority") if k in payload}
    with Sessions() as session:
        jobs = [session.enqueue(Task(task=task, payload=dict(payload)), **options) for _ in range(n)]
        session.commit()
        return [job.id for job in jobs]


def job(engine: Engine, job_id: int) -> Any:
    with engine.connect() as conn:
        return conn.execute(select(TASKS).where(TASKS.c.id == job_id)).one()


def status_is(engine: Engine, job_id: int, *statuses: str) -> Callable[[], bool]:
    return lambda: job(engine, job_id).status in statuses


def all_status(engine: Engine, ids: list[int], *statuses: str) -> Callable[[], bool]:
    def check() -> bool:
        with engine.connect() as conn:
            found = conn.execute(select(TASKS.c.status).where(TASKS.c.id.in_(ids))).scalars().all()
        return len(found) == len(ids) and all(s in statuses for s in found)

    return check


def effects(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(Effect).order_by(Effect.id)))
