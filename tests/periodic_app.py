"""The application of the periodic-job process tests: a one-second schedule on ``tasks``.

``sqla-queue worker tests.periodic_app:make_worker`` runs it (a thread ``Worker``, or an
``AsyncWorker`` when ``SQLA_QUEUE_TEST_RUNTIME=asyncio``). With ``SQLA_QUEUE_TEST_HANG``
set to a path, the first process to claim a tick (the one that creates that file) writes
its pid and the tick there and then hangs inside the claiming transaction, between the
watermark's update and the job's insert: the test kills it there. With
``SQLA_QUEUE_TEST_HANG_STOP`` also set, it stops itself there instead (SIGSTOP: every
thread frozen, as in a paused VM) and goes on where it was when the test sends SIGCONT.
"""

from __future__ import annotations

import os
import signal
import threading
from datetime import datetime
from typing import Any

from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import create_async_engine

from sqla_queue import AsyncWorker, Schedule, Tasks, Worker

from .models import Task

_never = threading.Event()


def beat_values(tick: datetime) -> dict[str, Any]:
    """The job of ``tick``; called inside the transaction that claimed it."""
    hang = os.environ.get("SQLA_QUEUE_TEST_HANG")
    if hang:
        try:
            fd = os.open(hang, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            pass
        else:
            os.write(fd, f"{os.getpid()} {tick.isoformat()}".encode())
            os.close(fd)
            if os.environ.get("SQLA_QUEUE_TEST_HANG_STOP"):
                os.kill(os.getpid(), signal.SIGSTOP)  # frozen inside the transaction until SIGCONT
            else:
                _never.wait()  # the tick stays claimed by an open transaction until the process dies
    return {"task": "beat", "payload": {"tick": tick.isoformat(), "pid": os.getpid()}}


#: Up to 30 missed ticks are caught up: a tick delayed by a killed process is not skipped.
BEAT = Schedule("beat", every=1, values=beat_values, backfill=30)

tasks = Tasks()
async_tasks = Tasks()


@tasks.task
def beat(job: Any) -> None:
    """Nothing to do: the test reads the jobs."""


@async_tasks.task(name="beat")
async def beat_async(job: Any) -> None:
    """Nothing to do: the test reads the jobs."""


def make_worker() -> Worker | AsyncWorker:
    url = os.environ["SQLA_QUEUE_TEST_URL"]
    connect_args = {"application_name": os.environ.get("SQLA_QUEUE_APP_NAME", "sqla_queue_worker")}
    options: dict[str, Any] = {"schedules": [BEAT], "poll_interval": 0.5}
    if os.environ.get("SQLA_QUEUE_TEST_RUNTIME") == "asyncio":
        return AsyncWorker(create_async_engine(url, connect_args=connect_args), Task, async_tasks, **options)
    return Worker(create_engine(url, connect_args=connect_args), Task, tasks, **options)
