"""Retention: workers prune finished jobs past their age, in bounded batches, one at a time."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, insert, select, text

from sqla_queue import Worker, WorkerConfig, archive_table
from sqla_queue import sql as q

from .helpers import table_of, wait_for
from .models import Base, Task

TASKS = table_of(Task)
DAY = 86400.0


def _add(engine: Engine, status: str, age_seconds: float | None, n: int = 1) -> list[int]:
    """``n`` jobs in ``status`` that finished ``age_seconds`` ago (None: not finished)."""
    finished = None if age_seconds is None else func.now() - q.seconds_interval(age_seconds)
    with engine.begin() as conn:
        return list(
            conn.scalars(
                insert(TASKS).values(finished_at=finished).returning(TASKS.c.id),
                [{"task": "work", "payload": {}, "status": status} for _ in range(n)],
            )
        )


def _left(engine: Engine) -> set[int]:
    with engine.connect() as conn:
        return set(conn.scalars(select(TASKS.c.id)))


def test_prune_finished_takes_an_age_per_status(engine: Engine) -> None:
    old_done = _add(engine, "done", 2 * DAY)
    new_done = _add(engine, "done", 60)
    old_failed = _add(engine, "failed", 2 * DAY)
    older_failed = _add(engine, "failed", 40 * DAY)
    old_cancelled = _add(engine, "cancelled", 2 * DAY)
    pending = _add(engine, "pending", None)
    ages = {"done": timedelta(days=1), "failed": timedelta(days=30)}
    with engine.begin() as conn:
        deleted = conn.execute(q.prune_finished(Task, older_than=ages)).rowcount
    assert deleted == 2
    assert _left(engine) == {*new_done, *old_failed, *old_cancelled, *pending}
    assert not set(old_done + older_failed) & _left(engine)
    with pytest.raises(ValueError, match="not both"):
        q.prune_finished(Task, older_than=ages, statuses=["done"])
    with pytest.raises(ValueError, match="only finished jobs"):
        q.prune_finished(Task, older_than={"running": 60})


def test_exclusive_pruning_deletes_nothing_while_another_pruner_holds_the_table(engine: Engine) -> None:
    old = _add(engine, "done", 2 * DAY, n=3)
    stmt = q.prune_finished(Task, older_than=DAY, exclusive=True)
    holder = engine.connect()
    try:
        holder.begin()
        holder.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": q.prune_lock_key(TASKS)})
        with engine.begin() as conn:
            assert conn.execute(stmt).rowcount == 0
        holder.rollback()
    finally:
        holder.close()
    with engine.begin() as conn:
        assert conn.execute(stmt).rowcount == 3
    assert not set(old) & _left(engine)


def test_pruning_steps_over_locked_rows_without_waiting(engine: Engine) -> None:
    locked, free = _add(engine, "done", 2 * DAY), _add(engine, "done", 2 * DAY)
    holder = engine.connect()
    try:
        holder.begin()
        holder.execute(select(TASKS.c.id).where(TASKS.c.id == locked[0]).with_for_update())
        started = time.monotonic()
        with engine.begin() as conn:
            conn.execute(text("SET LOCAL lock_timeout = '5s'"))
            assert conn.execute(q.prune_finished(Task, older_than=DAY, exclusive=True)).rowcount == 1
        assert time.monotonic() - started < 4
    finally:
        holder.rollback()
        holder.close()
    assert _left(engine) == set(locked)
    assert not set(free) & _left(engine)


def test_archive_finished_takes_the_same_ages_and_lock(engine: Engine) -> None:
    archive = archive_table(Task, "tasks_archive_retention", Base.metadata)
    archive.create(engine)
    try:
        kept = _add(engine, "failed", 2 * DAY)
        moved = _add(engine, "done", 2 * DAY)
        with engine.begin() as conn:
            stmt = q.archive_finished(Task, archive, older_than={"done": DAY}, exclusive=True)
            assert sorted(conn.scalars(stmt)) == moved
        assert _left(engine) == set(kept)
    finally:
        archive.drop(engine)
        Base.metadata.remove(archive)


@pytest.mark.parametrize(
    ("retention", "kept_statuses"),
    [
        (timedelta(days=1), {"failed"}),  # one age: done and cancelled; dead letters kept
        ({"failed": DAY, "cancelled": timedelta(days=1)}, {"done"}),
        ({"done": DAY}, {"failed", "cancelled"}),
    ],
)
def test_workers_prune_in_batches_on_both_runtimes(
    engine: Engine, make_worker: Any, retention: Any, kept_statuses: set[str]
) -> None:
    old = {status: _add(engine, status, 2 * DAY, n=5) for status in ("done", "failed", "cancelled")}
    recent = _add(engine, "done", 60) + _add(engine, "failed", 60)
    pending = _add(engine, "pending", None)
    expected = {*recent, *pending, *(i for s in kept_statuses for i in old[s])}
    workers = [
        make_worker(engine, Task, lambda job: None, retention=retention, retention_batch=2,
                    retention_interval=0.2, poll_interval=0.5)
        for _ in range(2)
    ]
    for worker in workers:
        worker.start()
    try:
        wait_for(lambda: _left(engine) == expected, timeout=30, what="the old finished jobs pruned")
    finally:
        for worker in workers:
            worker.stop(grace=1)
    assert sum(w.stats.pruned for w in workers) == 15 - 5 * len(kept_statuses)
    # the pending job was claimed and run meanwhile: pruning never kept it from its claim
    with engine.connect() as conn:
        assert conn.scalar(select(TASKS.c.status).where(TASKS.c.id == pending[0])) == "done"


@pytest.mark.parametrize(
    "options",
    [
        {"retention": 0},
        {"retention": -5},
        {"retention": "7d"},
        {"retention": {}},
        {"retention": {"pending": 60}},
        {"retention": {"done": 0}},
        {"retention_batch": 0},
        {"retention_interval": 0},
        {"periodic": "yes"},
    ],
)
def test_bad_retention_options_are_refused(options: dict[str, Any]) -> None:
    with pytest.raises((TypeError, ValueError)):
        Worker.check_options(**options)


def test_retention_is_off_by_default_and_reads_as_ages_per_status(engine: Engine) -> None:
    assert WorkerConfig().retention_ages == {}
    assert Worker(engine, Task, lambda job: None).pruner is None
    assert WorkerConfig(retention=timedelta(days=7)).retention_ages == {"done": 7 * DAY, "cancelled": 7 * DAY}
    assert WorkerConfig(retention={"failed": 60.0}).retention_ages == {"failed": 60.0}
