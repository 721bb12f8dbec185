"""The workers table (``workers_table``): each worker of ``ResultTask`` records itself at
its start and with each heartbeat, idle or busy, on both runtimes, and deletes its row
when it stops; rows of workers that died are shown as gone, then pruned."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from flask import Flask
from sqlalchemy import Engine, create_engine, func, insert, select
from sqlalchemy.orm import DeclarativeBase

from sqla_queue import JobMixin, Tasks, WorkerStartError, workers_table
from sqla_queue.cli import main
from sqla_queue.dashboard import create_app
from sqla_queue.registry import FORGET_AFTER_LEASES

from .helpers import Server, table_of, wait_for
from .models import RESULT_WORKERS, ResultTask, Task

RESULTS = table_of(ResultTask)
XSS = "<script>alert('x')</script>"
GO = threading.Event()
tasks = Tasks()


@tasks.task
def held(job: Any) -> None:
    assert GO.wait(30), "the test never let the job go"


def rows(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(RESULT_WORKERS, func.extract("epoch", func.now() - RESULT_WORKERS.c.last_seen)
                                        .label("ago")).order_by(RESULT_WORKERS.c.name)))


def test_a_worker_records_itself_idle_and_busy_and_forgets_itself_when_it_stops(
    engine: Engine, start_worker: Callable[..., Any], runtime: Any
) -> None:
    GO.clear()
    worker = start_worker(tasks, ResultTask, queues=("a", "b"), concurrency=3, lease=3.0, heartbeat_interval=0.2)
    (row,) = wait_for(lambda: rows(engine), timeout=20)  # recorded at once, while idle
    assert (row.name, row.queues, row.concurrency, row.running, row.jobs) == (worker.owner, ["a", "b"], 3, 0, [])
    assert row.runtime == runtime.name and row.pid > 0 and row.host and row.version
    first_seen = row.last_seen
    wait_for(lambda: rows(engine)[0].last_seen > first_seen, timeout=20)  # each heartbeat
    try:
        with engine.begin() as conn:
            job_id = conn.scalar(insert(RESULTS).values(task="held", payload={}, queue="a").returning(RESULTS.c.id))
        wait_for(lambda: rows(engine)[0].running == 1, timeout=20)
        assert rows(engine)[0].jobs == [job_id]
    finally:
        GO.set()
    wait_for(lambda: rows(engine)[0].running == 0, timeout=20)
    worker.stop(grace=1)
    assert rows(engine) == []


def test_the_rows_of_dead_workers_are_shown_gone_then_pruned(
    engine: Engine, start_worker: Callable[..., Any], server: Server, capsys: Any
) -> None:
    with engine.begin() as conn:
        conn.execute(insert(RESULT_WORKERS), [
            {"name": "dead:1:aaaa", "host": "h1", "pid": 1, "concurrency": 4, "runtime": "thread", "version": "0.1.0",
             "last_seen": datetime.now(UTC) - timedelta(seconds=FORGET_AFTER_LEASES * 3 + 5)},
            {"name": "late:2:bbbb", "host": "h2", "pid": 2, "concurrency": 4, "runtime": "thread", "version": "0.1.0",
             "last_seen": datetime.now(UTC) - timedelta(seconds=10)},
        ])
    url = server.url.render_as_string(hide_password=False)
    assert main(["workers", "tests.models:ResultTask", "--url", url, "--lease", "3s"]) == 0
    listed = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()[1:]}
    assert listed == {"dead:1:aaaa": "gone", "late:2:bbbb": "gone"}
    worker = start_worker(tasks, ResultTask, lease=3.0, sweep_interval=0.2)
    # The sweeper deletes the row not seen for ten leases; the other is younger than that.
    wait_for(lambda: {r.name for r in rows(engine)} == {"late:2:bbbb", worker.owner}, timeout=20)
    assert main(["workers", "tests.models:ResultTask", "--url", url, "--lease", "3s"]) == 0
    listed = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()[1:]}
    assert listed == {"late:2:bbbb": "gone", worker.owner: "live"}


def test_the_command_and_the_dashboard_on_a_table_without_one(engine: Engine, server: Server, capsys: Any) -> None:
    url = server.url.render_as_string(hide_password=False)
    assert main(["workers", "tests.models:Task", "--url", url]) == 2
    assert "has no workers table: call sqla_queue.workers_table(Model)" in capsys.readouterr().err
    app: Flask = create_app(engine, [Task], lease=60.0)
    app.testing = True
    with app.test_client() as client:
        page = client.get("/tasks/workers").get_data(as_text=True)
    assert '<table id="recorded">' not in page and '<table id="listening">' in page


def test_the_dashboard_lists_the_recorded_workers_escaped(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(insert(RESULT_WORKERS).values(
            name="idle:3:cccc", host=XSS, pid=3, concurrency=2, runtime="asyncio", version="0.1.0", queues=["q"]))
    app = create_app(engine, [ResultTask], lease=60.0)
    app.testing = True
    with app.test_client() as client:
        page = client.get("/result_tasks/workers").get_data(as_text=True)
    table = page[page.index('<table id="recorded">'):]
    table = table[:table.index("</table>")]
    assert 'data-worker="idle:3:cccc"' in table and ">live<" in table and "asyncio" in table
    assert XSS not in page and "&lt;script&gt;" in table


def test_a_worker_refuses_to_start_when_the_declared_workers_table_is_missing(server: Server) -> None:
    class Base(DeclarativeBase):
        pass

    class LonelyJob(Base, JobMixin):
        __tablename__ = "lonely_jobs"

    workers_table(LonelyJob)
    engine = create_engine(server.url)
    try:
        table_of(LonelyJob).create(engine)
        from sqla_queue import Worker

        missing = r"has a workers table declared .* 'lonely_jobs_workers' does not exist"
        with pytest.raises(WorkerStartError, match=missing):
            Worker(engine, LonelyJob, lambda job: None).start()
    finally:
        table_of(LonelyJob).drop(engine)
        engine.dispose()
