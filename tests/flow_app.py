"""The application the flow rules' worker processes run.

``sqla-queue worker tests.flow_app:make_worker`` builds a worker on the test database
(``SQLA_QUEUE_TEST_URL``) for the model ``SQLA_QUEUE_TEST_FLOW_MODEL`` names
(``AccountJob`` or ``ShardJob``), a thread ``Worker`` or an ``AsyncWorker``
(``SQLA_QUEUE_TEST_RUNTIME``). Each run is logged in ``flow_runs`` from its start to its
end; a job whose ``kill`` is set SIGKILLs its process on its first attempt.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

from sqlalchemy import create_engine, func, insert, update
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from sqla_queue import AsyncWorker, Worker

from . import models
from .helpers import table_of
from .models import FlowRun

RUNS = table_of(FlowRun)


def _start(job: Any) -> Any:
    return insert(RUNS).values(job_id=job.id, account=job.account, queue=job.queue, pid=os.getpid()).returning(
        RUNS.c.id)


def make_worker() -> Worker | AsyncWorker:
    url = os.environ["SQLA_QUEUE_TEST_URL"]
    model = getattr(models, os.environ["SQLA_QUEUE_TEST_FLOW_MODEL"])
    connect_args = {"application_name": os.environ.get("SQLA_QUEUE_APP_NAME", "sqla_queue_worker")}
    if os.environ.get("SQLA_QUEUE_TEST_RUNTIME") == "asyncio":
        engine = create_async_engine(url, connect_args=connect_args)
        log = create_async_engine(url, poolclass=NullPool)  # a connection per write, none kept

        async def run_async(job: Any) -> None:
            async with log.begin() as conn:
                run = (await conn.execute(_start(job))).scalar_one()
            if job.kill and job.attempts == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            await asyncio.sleep(job.work_seconds)
            async with log.begin() as conn:
                await conn.execute(update(RUNS).where(RUNS.c.id == run).values(ended_at=func.clock_timestamp()))

        return AsyncWorker(engine, model, run_async)
    sync_engine = create_engine(url, connect_args=connect_args)
    log_sync = create_engine(url, poolclass=NullPool)

    def run(job: Any) -> None:
        with log_sync.begin() as conn:
            run_id = conn.execute(_start(job)).scalar_one()
        if job.kill and job.attempts == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(job.work_seconds)
        with log_sync.begin() as conn:
            conn.execute(update(RUNS).where(RUNS.c.id == run_id).values(ended_at=func.clock_timestamp()))

    return Worker(sync_engine, model, run)
