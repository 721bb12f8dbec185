"""What the worker claims and loads: single-table inheritance, timestamps at infinity."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from sqlalchemy import Engine, select, text

from sqla_queue import QueueSession
from sqla_queue import sql as q

from .helpers import table_of, wait_for
from .models import PolyJob, PolyJobA, PolyJobA1, PolyJobB, Task
from .workers import TASKS

POLY = table_of(PolyJob)


def poly_jobs(engine: Engine) -> dict[str, list[int]]:
    made: dict[str, list[Any]] = {}
    with QueueSession(engine) as session:
        for cls in (PolyJob, PolyJobA, PolyJobA1, PolyJobB, PolyJobA, PolyJobB):
            made.setdefault(cls.__name__, []).append(session.enqueue(cls(note=cls.__name__)))
        session.commit()
        return {name: [j.id for j in jobs] for name, jobs in made.items()}


def poly_status(engine: Engine) -> dict[int, str]:
    with engine.connect() as conn:
        return {r.id: r.status for r in conn.execute(select(POLY.c.id, POLY.c.status))}


def test_a_worker_for_the_base_loads_each_row_as_its_subclass(engine: Engine, start_worker: Any) -> None:
    ids = poly_jobs(engine)
    seen: dict[int, str] = {}
    start_worker(handler=lambda job: seen.__setitem__(job.id, f"{type(job).__name__}/{job.note}"), model=PolyJob)
    wait_for(lambda: set(poly_status(engine).values()) == {"done"}, what="every poly job done")
    assert seen == {i: f"{name}/{name}" for name, group in ids.items() for i in group}


@pytest.mark.parametrize("model", [PolyJobA, PolyJobB], ids=["PolyJobA", "PolyJobB"])
def test_a_worker_for_a_subclass_claims_its_rows_and_its_subclasses_only(
    engine: Engine, start_worker: Any, model: type[PolyJob]
) -> None:
    ids = poly_jobs(engine)
    mine = {i for cls in (model, *model.__subclasses__()) for i in ids.get(cls.__name__, [])}
    seen: dict[int, type[Any]] = {}
    worker = start_worker(handler=lambda job: seen.__setitem__(job.id, type(job)), model=model)

    def done() -> set[int]:
        return {i for i, s in poly_status(engine).items() if s == "done"}

    wait_for(lambda: done() == mine, what="the subclass's jobs done")
    # More of every kind: a later claim (and the next-due query) still leaves the others alone.
    later = poly_jobs(engine)
    mine |= {i for cls in (model, *model.__subclasses__()) for i in later.get(cls.__name__, [])}
    wait_for(lambda: done() == mine, what="the second round")
    status = poly_status(engine)
    assert {s for i, s in status.items() if i not in mine} == {"pending"}
    assert set(seen) == mine and all(issubclass(cls, model) for cls in seen.values())
    assert worker.stats.failed == 0


def test_claim_of_a_subclass_compiles_once(engine: Engine) -> None:
    from sqla_queue.driver import compile_statement

    poly_jobs(engine)
    with engine.begin() as conn:
        statement = compile_statement(q.claim(PolyJobA, owner="w", limit=10), conn.dialect)
        cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
        assert len(cursor.execute(statement.sql, statement.params({})).fetchall()) == 3
        rows = conn.execute(q.claim(PolyJobA1, owner="w", limit=10)).all()
        assert rows == []  # the A1 row was claimed with A's
        assert sorted(conn.scalars(select(POLY.c.kind).where(POLY.c.status == "running"))) == ["a", "a", "a1"]


def _task(engine: Engine, run_after: str) -> int:
    with engine.begin() as conn:
        job_id: int = conn.scalar(
            text(f"INSERT INTO tasks (task, payload, run_after) VALUES ('work', '{{}}', '{run_after}') RETURNING id")
        )
    return job_id


def status_of(engine: Engine, job_id: int, wanted: str) -> Any:
    """``status == wanted`` (not the whole row: Python cannot hold every timestamp)."""

    def check() -> bool:
        with engine.connect() as conn:
            return conn.scalar(select(TASKS.c.status).where(TASKS.c.id == job_id)) == wanted

    return check


def test_next_due_ignores_infinity_and_sees_the_far_future(engine: Engine) -> None:
    _task(engine, "infinity")
    _task(engine, "-infinity")
    with engine.connect() as conn:
        assert conn.scalar(q.next_run_after(Task)) is None
        _task(engine, "10000-01-01 00:00:00+00")
        assert conn.scalar(q.next_run_after(Task)) > 250 * 365 * 86400


def test_jobs_at_infinity_neither_break_the_worker_nor_run_early(
    engine: Engine, start_worker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """'-infinity' is due (it runs, and loads); 'infinity' and year 10000 never fall due in
    this test; the next-due wake-up keeps working beside them (it failed at every wake-up)."""
    caplog.set_level(logging.WARNING, logger="sqla_queue")
    never = [_task(engine, "infinity"), _task(engine, "10000-01-01 00:00:00+00")]
    ancient = _task(engine, "-infinity")
    seen: list[Any] = []
    start_worker(handler=lambda j: seen.append(j.run_after), poll_interval=60.0)
    wait_for(status_of(engine, ancient, "done"), what="the -infinity job done")
    began = time.monotonic()
    with QueueSession(engine) as session:
        delayed = session.enqueue(Task(task="work", payload={}), delay=1.0)
        session.commit()
        delayed_id = delayed.id
    wait_for(status_of(engine, delayed_id, "done"), timeout=40, what="the delayed job, woken by its due time")
    assert time.monotonic() - began < 40
    assert seen[0].year == 1 and len(seen) == 2
    with engine.connect() as conn:
        statuses = conn.execute(select(TASKS.c.status, TASKS.c.attempts).where(TASKS.c.id.in_(never))).all()
        assert statuses == [("pending", 0)] * 2
        assert conn.scalar(text(f"SELECT run_after = '-infinity' FROM tasks WHERE id = {ancient}")) is True
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
