"""Each attempt's history (``HistoryMixin``): the entry that every statement ending an
attempt appends, built in SQL from the row and the statement's own values, bounded per
job. ``ResultTask`` keeps one; ``Task`` does not, and runs the statements it ran before.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest
from sqlalchemy import Engine, insert, select, text
from sqlalchemy.orm import Session

from sqla_queue import Snooze, Tasks, cancel, current_job
from sqla_queue import sql as q
from sqla_queue.model import HISTORY_KEEP, history_column
from sqla_queue.sql._history import ERROR_HEAD

from .helpers import table_of, wait_for
from .models import ResultTask, Task
from .test_ops import on_driver

RESULTS = table_of(ResultTask)

tasks = Tasks()


@tasks.task
def flaky(job: Any) -> str:
    """Fails its first attempt, snoozes its second, completes its third."""
    if job.attempts == 1:
        raise ValueError("the first attempt fails")
    if job.attempts == 2 and not job.payload.get("snoozed"):
        raise Snooze(0.01, "waiting for the upstream")
    return "ok"


@tasks.task
def slow(job: Any) -> None:
    current_job().wait(30)


def enqueue(engine: Engine, task: str, **values: Any) -> int:
    with engine.begin() as conn:
        return int(conn.scalar(insert(RESULTS).values(task=task, payload={}, **values).returning(RESULTS.c.id)))


def history(engine: Engine, job_id: int) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        found: list[dict[str, Any]] | None = conn.scalar(select(RESULTS.c.history).where(RESULTS.c.id == job_id))
    return found or []


def outcomes(engine: Engine, job_id: int) -> list[tuple[int, str]]:
    return [(e["attempt"], e["outcome"]) for e in history(engine, job_id)]


def claim(engine: Engine, owner: str = "me", **options: Any) -> tuple[int, int]:
    with engine.begin() as conn:
        row = conn.execute(q.claim(ResultTask, owner=owner, limit=1, **options)).one()
        return row.id, row.attempts


def test_a_table_without_history_has_no_column_for_it() -> None:
    assert history_column(table_of(Task)) is None
    assert history_column(RESULTS) is RESULTS.c.history


def test_every_attempt_a_worker_ends_is_an_entry(engine: Engine, start_worker: Callable[..., Any]) -> None:
    job_id = enqueue(engine, "flaky", max_attempts=5)
    worker = start_worker(tasks, ResultTask)
    wait_for(lambda: outcomes(engine, job_id)[-1:] == [(3, "done")], timeout=30)
    entries = history(engine, job_id)
    assert [(e["attempt"], e["outcome"]) for e in entries] == [(1, "retried"), (2, "snoozed"), (3, "done")]
    assert entries[0]["error"].startswith("builtins.ValueError: the first attempt fails")
    assert entries[1]["error"] is None and entries[2]["error"] is None
    for entry in entries:
        assert entry["worker"].startswith(worker.owner + "/") and entry["seconds"] >= 0
        started, ended = (datetime.fromisoformat(entry[k]) for k in ("started_at", "ended_at"))
        assert started <= ended


def test_a_dead_letter_and_a_timeout_are_entries_with_their_errors(
    engine: Engine, start_worker: Callable[..., Any]
) -> None:
    dead = enqueue(engine, "missing task", max_attempts=1)
    timed = enqueue(engine, "slow", max_attempts=1, timeout=0.2)
    start_worker(tasks, ResultTask)
    wait_for(lambda: outcomes(engine, dead) == [(1, "failed")] and outcomes(engine, timed) == [(1, "timed out")],
             timeout=30)
    assert "missing task" in history(engine, dead)[0]["error"]
    assert history(engine, timed)[0]["error"].startswith("timed out after 0.2 s")


def test_the_sweeper_s_expiries_are_lost_or_timed_out_attempts(engine: Engine) -> None:
    lost = enqueue(engine, "flaky")
    timed = enqueue(engine, "flaky")
    claim(engine, owner="ghost", lease=60)
    claim(engine, owner="ghost", lease=60, timeout=60)
    with engine.begin() as conn:  # the ghost's leases ran out; the second one's deadline too
        conn.execute(RESULTS.update().values(lease_expires_at=text("now() - interval '1 second'")))
        conn.execute(RESULTS.update().where(RESULTS.c.id == timed).values(deadline_at=text("now() - interval '1 s'")))
        assert len(conn.execute(q.sweep_expired(ResultTask)).all()) == 2
    assert outcomes(engine, lost) == [(1, "lost")] and outcomes(engine, timed) == [(1, "timed out")]
    assert history(engine, lost)[0]["worker"] == "ghost"
    assert "worker ghost did not finish attempt 1" in history(engine, lost)[0]["error"]


def test_a_cancel_ends_a_running_attempt_and_leaves_a_pending_job_s_history_alone(engine: Engine) -> None:
    running = enqueue(engine, "flaky")
    claim(engine)
    pending = enqueue(engine, "flaky")
    with Session(engine) as session:
        assert sorted(cancel(session, ResultTask, ids=[running, pending])) == [running, pending]
        session.commit()
    assert outcomes(engine, running) == [(1, "cancelled")]
    assert history(engine, pending) == []


@pytest.mark.parametrize("driver", ["thread", "asyncio"])
def test_the_compiled_statements_append_one_entry_per_token(engine: Engine, driver: str) -> None:
    ids = [enqueue(engine, "flaky") for _ in range(7)]
    with on_driver(driver, engine) as on:
        ops = on.ops(model=ResultTask)
        claimed = on(lambda c: ops.fetch_claimed(c, ops.claim_request("w", 10)))
        t = sorted(c.token for c in claimed)
        assert on(lambda c: ops.complete(c, "w", t[0:2])) == dict.fromkeys(t[0:2], "done")
        assert on(lambda c: ops.retry(c, "w", t[2:4], ["E1", "timed out after 3 s"], [0.0, 0.0])) == dict.fromkeys(
            t[2:4], "pending")
        assert on(lambda c: ops.fail(c, "w", t[4:5], ["boom"])) == {t[4]: "failed"}
        assert on(lambda c: ops.release(c, "w", t[5:6], refund=True, errors=["connection lost"])) == {t[5]: "pending"}
        assert on(lambda c: ops.snooze(c, "w", t[6:7], [0.0])) == {t[6]: "pending"}
    assert [outcomes(engine, i) for i in ids] == [
        [(1, "done")], [(1, "done")], [(1, "retried")], [(1, "timed out")], [(1, "failed")], [(1, "released")],
        [(1, "snoozed")],
    ]
    assert [history(engine, i)[0]["error"] for i in ids[2:6]] == ["E1", "timed out after 3 s", "boom",
                                                                  "connection lost"]


def test_the_history_keeps_the_last_attempts_and_the_ends_of_long_errors(engine: Engine) -> None:
    job_id = enqueue(engine, "flaky", max_attempts=100)
    error = "pkg.Error: " + "m" * 2000 + "\nTraceback:\n" + "frame\n" * 400 + "  the innermost frame"
    for n in range(1, HISTORY_KEEP + 6):
        with engine.begin() as conn:
            token = conn.execute(q.claim(ResultTask, owner="me", limit=1)).one()
            assert token.attempts == n
            conn.execute(q.retry_if_owner(ResultTask, owner="me", token=(token.id, n), error=error, delay=0))
    entries = history(engine, job_id)
    assert [e["attempt"] for e in entries] == list(range(6, HISTORY_KEEP + 6))
    kept = entries[-1]["error"]
    assert len(kept) <= ERROR_HEAD and kept.startswith("pkg.Error: mmm") and kept.endswith("the innermost frame")
    assert "\n...\n" in kept
