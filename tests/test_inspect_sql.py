"""The inspection builders of ``sqla_queue.sql`` (``job_filter``, ``list_jobs``,
``get_job``, ``delete_jobs``, ``finished_per_minute``, ``lease_owners``, the filters of
``requeue_failed``) on real PostgreSQL, and their refusals of bad arguments before
anything is sent; each list option with one value and several."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, insert, select, update

from sqla_queue import admin
from sqla_queue import sql as q
from sqla_queue.dbapi import compile_statement

from .helpers import table_of
from .models import EmailJob, PolyJob, PolyJobA, Task, UuidJob

JOBS = table_of(EmailJob)
TASKS = table_of(Task)


def add(engine: Engine, table: Any = JOBS, **values: Any) -> Any:
    with engine.begin() as conn:
        return conn.execute(insert(table).values(**values).returning(table.c.id)).scalar_one()


def keys(engine: Engine, stmt: Any) -> list[Any]:
    with engine.begin() as conn:
        return [row.id for row in conn.execute(stmt)]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"queues": "a"}, TypeError, "not a single string"),
        ({"queues": []}, ValueError, "at least one queue"),
        ({"statuses": "failed"}, TypeError, "not a single string"),
        ({"statuses": []}, ValueError, "at least one status"),
        ({"statuses": ["lost"]}, ValueError, "unknown status"),
        ({"tasks": ["x"]}, ValueError, "has no task column"),
        ({"error_contains": ""}, ValueError, "must not be empty"),
        ({"ids": "12"}, TypeError, "not a single string"),
    ],
)
def test_job_filter_refuses_bad_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        q.job_filter(EmailJob, **kwargs)


def test_task_filter_refuses_a_single_string_and_an_empty_list() -> None:
    with pytest.raises(TypeError):
        q.job_filter(Task, tasks="crop")
    with pytest.raises(ValueError, match="at least one task"):
        q.job_filter(Task, tasks=[])


@pytest.mark.parametrize("limit", [0, -1, True, 1.5])
def test_limits_must_be_whole_and_positive(limit: Any) -> None:
    with pytest.raises(ValueError, match="limit"):
        q.list_jobs(EmailJob, limit=limit)
    with pytest.raises(ValueError, match="limit"):
        q.delete_jobs(EmailJob, limit=limit)
    with pytest.raises(ValueError, match="minutes"):
        q.finished_per_minute(EmailJob, minutes=limit)


def test_delete_jobs_refuses_running_jobs_by_name() -> None:
    with pytest.raises(ValueError, match="running jobs cannot be deleted"):
        q.delete_jobs(EmailJob, statuses=["failed", "running"])


def test_admin_delete_refuses_empty_filters(engine: Engine) -> None:
    add(engine)
    with pytest.raises(ValueError, match="name the jobs"):
        admin.delete_jobs(engine, EmailJob, admin.JobFilters())
    assert keys(engine, select(JOBS.c.id)) != []


def test_list_jobs_filters_and_pages(engine: Engine) -> None:
    a = add(engine, queue="a")
    b = add(engine, queue="b", status="failed", last_error="Boom 100%")
    c = add(engine, queue="c", status="done", last_error="boom")
    d = add(engine, queue="a", status="cancelled")
    assert keys(engine, q.list_jobs(EmailJob)) == [d, c, b, a]
    assert keys(engine, q.list_jobs(EmailJob, queues=["a"])) == [d, a]
    assert keys(engine, q.list_jobs(EmailJob, queues=["a", "b"])) == [d, b, a]
    assert keys(engine, q.list_jobs(EmailJob, statuses=["failed"])) == [b]
    assert keys(engine, q.list_jobs(EmailJob, statuses=["failed", "done"])) == [c, b]
    assert keys(engine, q.list_jobs(EmailJob, error_contains="BOOM")) == [c, b]
    assert keys(engine, q.list_jobs(EmailJob, error_contains="100%")) == [b]
    assert keys(engine, q.list_jobs(EmailJob, ids=[a, c])) == [c, a]
    assert keys(engine, q.list_jobs(EmailJob, ids=[])) == []
    assert keys(engine, q.list_jobs(EmailJob, before=c, limit=1)) == [b]
    page = admin.list_jobs(engine, EmailJob, limit=3)
    assert [r.id for r in page.rows] == [d, c, b] and page.next_before == b
    rest = admin.list_jobs(engine, EmailJob, limit=3, before=page.next_before)
    assert [r.id for r in rest.rows] == [a] and rest.next_before is None
    assert "recipient" in page.columns  # every column, the table's own too
    slim = admin.list_jobs(engine, EmailJob, limit=3, columns=["status", "queue"])
    assert slim.columns == ["id", "status", "queue"] and [r.id for r in slim.rows] == [d, c, b]


def test_list_jobs_by_task(engine: Engine) -> None:
    crop = add(engine, TASKS, task="crop")
    send = add(engine, TASKS, task="send")
    add(engine, TASKS, task="resize")
    assert keys(engine, q.list_jobs(Task, tasks=["crop"])) == [crop]
    assert keys(engine, q.list_jobs(Task, tasks=["crop", "send"])) == [send, crop]


def test_list_jobs_pages_a_uuid_key(engine: Engine) -> None:
    table = table_of(UuidJob)
    ids = sorted((uuid.uuid4() for _ in range(5)), reverse=True)
    with engine.begin() as conn:
        conn.execute(insert(table), [{"id": key} for key in ids])
    seen: list[Any] = []
    before = None
    while True:
        page = admin.list_jobs(engine, UuidJob, limit=2, before=before)
        seen += [row.id for row in page.rows]
        if page.next_before is None:
            break
        before = page.next_before
    assert seen == ids
    assert admin.get_job(engine, UuidJob, ids[0]) is not None
    assert admin.parse_job_id(UuidJob, str(ids[0])) == ids[0]
    with pytest.raises(ValueError, match="UUID"):
        admin.parse_job_id(UuidJob, "12")


def test_a_subclass_lists_only_its_own_rows(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(insert(table_of(PolyJob)), [{"kind": "base"}, {"kind": "a"}, {"kind": "a1"}, {"kind": "b"}])
    listed = keys(engine, q.list_jobs(PolyJobA))
    with engine.connect() as conn:
        kinds = set(conn.scalars(select(table_of(PolyJob).c.kind).where(table_of(PolyJob).c.id.in_(listed))))
    assert kinds == {"a", "a1"}


def test_delete_jobs_matches_the_filters_and_never_a_running_job(engine: Engine) -> None:
    pending = add(engine, queue="a")
    running = add(engine, queue="a", status="running", lease_owner="w/0")
    failed = add(engine, queue="b", status="failed", last_error="x")
    done = add(engine, queue="c", status="done")
    assert keys(engine, q.delete_jobs(EmailJob, ids=[running, pending])) == [pending]
    assert keys(engine, q.delete_jobs(EmailJob, queues=["b", "c"], statuses=["failed"])) == [failed]
    assert admin.delete_jobs(engine, EmailJob, admin.JobFilters(queues=("a", "c")), limit=1) == 1
    assert keys(engine, select(JOBS.c.id)) == [running]
    assert done not in keys(engine, select(JOBS.c.id))


def test_requeue_failed_takes_task_and_error_filters(engine: Engine) -> None:
    crop = add(engine, TASKS, task="crop", status="failed", last_error="Timeout")
    send = add(engine, TASKS, task="send", status="failed", last_error="refused")
    other = add(engine, TASKS, task="resize", status="failed", last_error="timeout")
    assert keys(engine, q.requeue_failed(Task, tasks=["crop", "send"], error_contains="timeout")) == [crop]
    assert sorted(keys(engine, q.requeue_failed(Task, tasks=["send", "resize"]))) == sorted([send, other])


def test_finished_per_minute_counts_the_last_minutes_by_queue(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(insert(JOBS).values(queue="m", status="done", finished_at=func.now()), [{}] * 3)
        conn.execute(insert(JOBS).values(queue="m", status="failed", finished_at=func.now()))
        conn.execute(insert(JOBS).values(queue="m", status="done", finished_at=func.now() - timedelta(minutes=10)))
        conn.execute(insert(JOBS).values(queue="m", status="done", finished_at=func.now() - timedelta(minutes=90)))
        conn.execute(insert(JOBS).values(queue="m", status="pending"))
        rows = conn.execute(q.finished_per_minute(EmailJob, minutes=60)).all()
        short = conn.execute(q.finished_per_minute(EmailJob, minutes=5)).all()
    assert sum(r.jobs for r in rows if r.status == "done") == 4
    assert sum(r.jobs for r in rows if r.status == "failed") == 1
    assert sum(r.jobs for r in short) == 4  # ten minutes ago is outside a five-minute window
    overview = admin.queue_overview(engine, EmailJob)
    assert [s.queue for s in overview] == ["m"]
    assert sum(overview[0].done) == 4 and overview[0].failed[-1] + overview[0].failed[-2] == 1
    assert len(overview[0].done) == 60 and overview[0].counts == {"done": 5, "failed": 1, "pending": 1}


def test_lease_owners_group_a_workers_executors(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(insert(JOBS).values(status="running"),
                     [{"lease_owner": "h:1:aa/0"}, {"lease_owner": "h:1:aa/0"}, {"lease_owner": "h:1:aa/1"},
                      {"lease_owner": "solo"}])
        conn.execute(update(JOBS).values(lease_expires_at=func.now() + timedelta(seconds=30)))
        raw = conn.execute(q.lease_owners(EmailJob)).all()
    assert [(r.lease_owner, r.jobs) for r in raw] == [("h:1:aa/0", 2), ("h:1:aa/1", 1), ("solo", 1)]
    owners = admin.lease_owners(engine, EmailJob, lease=60.0)
    assert [(o.owner, o.executors, o.jobs, o.expired) for o in owners] == [("h:1:aa", 2, 3, False),
                                                                          ("solo", 1, 1, False)]
    assert owners[0].latest_lease is not None and owners[0].last_heartbeat == owners[0].latest_lease - timedelta(
        seconds=60)
    assert admin.lease_owners(engine, EmailJob)[0].last_heartbeat is None  # the lease unknown


@pytest.mark.parametrize(
    "kwargs",
    [
        {"queues": ["a"], "statuses": ["failed"]},
        {"queues": ["a", "b"], "statuses": ["failed", "pending"], "ids": [1, 2], "error_contains": "x"},
    ],
)
def test_the_builders_run_as_compiled_text_on_the_cursor(engine: Engine, kwargs: dict[str, Any]) -> None:
    """Arrays, never expanding IN lists: each compiles once and runs as text with its
    parameters, one value or several."""
    key = add(engine, queue="a", status="failed", last_error="x")
    if "ids" in kwargs:
        kwargs = {**kwargs, "ids": [key, key + 1]}
    found = []
    for stmt in (q.list_jobs(EmailJob, **kwargs), q.delete_jobs(EmailJob, **kwargs)):
        with engine.begin() as conn:
            compiled = compile_statement(stmt, conn.dialect)
            driver: Any = conn.connection.driver_connection
            with driver.cursor() as cursor:
                cursor.execute(compiled.sql, compiled.params({}))
                column = [d.name for d in cursor.description].index("id")
                found.append([row[column] for row in cursor.fetchall()])
    assert found == [[key], [key]]  # listed, then deleted
