"""``JobLogFilter``: the running job's id, attempt, task, queue and table on every log
record made inside its handler, on both runtimes; ``"-"`` outside one."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, insert

from sqla_queue import JobLogFilter, RetryLater, Tasks

from .helpers import table_of, wait_for
from .models import Task

TASKS = table_of(Task)
log = logging.getLogger("tests.job_log")
tasks = Tasks()


@tasks.task
def chatty(job: Any) -> None:
    log.warning("attempt of %s", job.payload["name"])
    if job.attempts == 1:
        raise RetryLater(0.01)


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.addFilter(JobLogFilter())

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def kept() -> Iterator[Kept]:
    handler = Kept()
    log.addHandler(handler)
    try:
        yield handler
    finally:
        log.removeHandler(handler)


def fields(record: logging.LogRecord) -> tuple[Any, ...]:
    return tuple(getattr(record, name) for name in ("job_id", "job_attempt", "job_task", "job_queue", "job_table"))


def test_records_made_in_a_handler_carry_its_job(
    engine: Engine, start_worker: Callable[..., Any], kept: Kept
) -> None:
    with engine.begin() as conn:
        ids = list(conn.scalars(insert(TASKS).returning(TASKS.c.id, sort_by_parameter_order=True), [
            {"task": "chatty", "payload": {"name": "a"}, "queue": "q1"},
            {"task": "chatty", "payload": {"name": "b"}, "queue": "q2"},
        ]))
    start_worker(tasks, Task)
    wait_for(lambda: len([r for r in kept.records if r.getMessage().startswith("attempt")]) == 4, timeout=30)
    seen = sorted(fields(r) for r in kept.records if r.getMessage().startswith("attempt"))
    assert seen == sorted(
        (job_id, attempt, "chatty", queue, "tasks")
        for job_id, queue in zip(ids, ("q1", "q2"), strict=True) for attempt in (1, 2)
    )


def test_records_made_outside_a_handler_say_so(kept: Kept) -> None:
    log.warning("no job here")
    (record,) = kept.records
    assert fields(record) == ("-",) * 5
