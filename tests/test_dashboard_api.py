"""The dashboard's JSON API (``/api/``) through Flask's test client, against real
PostgreSQL: every endpoint; the pages' filters and keyset pages; bounded big values and
the whole value on request; every action, and every action refused (without its token,
read-only, under a forged Host or Origin) with nothing changed; errors as typed JSON;
markup in any value returned as a JSON string, never as HTML."""

from __future__ import annotations

import json
import threading
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, insert, select

pytest.importorskip("flask")

from flask import Flask, request

from sqla_queue import Tasks, pause, set_queue_limits
from sqla_queue.cli import build_parser
from sqla_queue.dashboard import dashboard_blueprint

from .dashboard_helpers import (
    API_REFUSALS,
    PAGE_TOKEN_REFUSAL,
    XSS,
    act,
    add,
    check_one_and_several_values,
    client_of,
    dashboard_app,
    get,
    refusal_options,
    refuse_every_action,
    run_every_action,
    status_of,
    token,
)
from .helpers import table_of, wait_for
from .models import RESULT_WORKERS, SHARD_QUEUES, EmailJob, OnceJob, ResultTask, ShardJob, Task, TotalJob, UuidJob

JOBS = table_of(EmailJob)
TASKS = table_of(Task)
RESULTS = table_of(ResultTask)
SHARDS = table_of(ShardJob)
ONCE = table_of(OnceJob)
UUIDS = table_of(UuidJob)
TOTALS = table_of(TotalJob)
MODELS = [EmailJob, Task, ResultTask, ShardJob, OnceJob, UuidJob, TotalJob]


def make_app(engine: Engine, **options: Any) -> Flask:
    """Every model, pages of three, the API's actions on unless a test says otherwise."""
    return dashboard_app(engine, MODELS, lease=60.0, page_size=3, **{"api_actions": True, **options})


@pytest.fixture
def client(engine: Engine) -> Iterator[Any]:
    with client_of(make_app(engine)) as client:
        yield client


def ids(listing: dict[str, Any]) -> list[Any]:
    return [job["id"] for job in listing["jobs"]]


def test_the_index_names_every_table_and_endpoint(client: Any) -> None:
    index = get(client, "/")
    assert index["read_only"] is False and index["csrf"] == "/api/csrf" and index["overview"] == "/api/overview"
    tables = {t["table"]: t for t in index["tables"]}
    assert list(tables) == [table_of(m).name for m in MODELS]
    jobs = tables["email_jobs"]
    assert (jobs["jobs"], jobs["dead"], jobs["workers"]) == (
        "/api/tables/email_jobs/jobs", "/api/tables/email_jobs/dead", "/api/tables/email_jobs/workers")
    assert "/api/tables/email_jobs/actions/requeue" in jobs["actions"]
    for entry in tables.values():  # each URL answers
        for key in ("jobs", "dead", "workers"):
            assert client.get(entry[key]).status_code == 200
    assert client.get("/api").status_code == 308  # to /api/


def test_the_overview_counts_each_queue_as_the_page_over_its_window_with_pause_and_limit(
    engine: Engine, client: Any
) -> None:
    with engine.begin() as conn:
        conn.execute(insert(JOBS), [{"queue": "mail"}] * 2)
        conn.execute(insert(JOBS).values(queue="mail", run_after=func.now() - timedelta(minutes=5)))
        conn.execute(insert(JOBS).values(queue="mail", status="done", finished_at=func.now()), [{}] * 4)
        conn.execute(insert(JOBS).values(queue="mail", status="failed", finished_at=func.now() - timedelta(minutes=30)))
        # Finished before the window: the page counts the window's jobs, not the table's.
        conn.execute(insert(JOBS).values(queue="mail", status="done", finished_at=func.now() - timedelta(hours=2)))
        conn.execute(insert(JOBS).values(queue="mail", status="done", finished_at=func.now() - timedelta(hours=30)))
        conn.execute(insert(SHARDS).values(queue="fast"))
        pause(conn, ShardJob, "idle")  # paused, with no job
        set_queue_limits(conn, ShardJob, "fast", concurrency=2, rate=None)
    overview = get(client, "/overview")
    assert overview["window"] == {"window": "1h", "label": "last hour", "bucket_seconds": 60, "buckets": 60}
    assert overview["statuses_now"] == ["pending", "running"]
    assert overview["statuses_window"] == ["done", "failed", "cancelled"]
    tables = {t["table"]: t for t in overview["tables"]}
    (mail,) = tables["email_jobs"]["queues"]
    assert mail["queue"] == "mail"
    assert mail["counts"] == {"pending": 3, "running": 0, "done": 4, "failed": 1, "cancelled": 0}
    assert 290 <= mail["oldest_runnable_seconds"] <= 400
    assert tables["email_jobs"]["activity"] == "/api/tables/email_jobs/activity?window=1h"
    (mail,) = get(client, "/overview?window=24h")["tables"][0]["queues"]
    assert mail["counts"] == {"pending": 3, "running": 0, "done": 5, "failed": 1, "cancelled": 0}
    assert mail["paused_since"] is None and tables["email_jobs"]["pausable"] is False
    shards = tables["shard_jobs"]
    assert shards["pausable"] is True and shards["queue_rules"] == {"concurrency": 4, "rate": None}
    queues = {q["queue"]: q for q in shards["queues"]}
    assert set(queues) == {"fast", "idle"}
    assert queues["fast"]["limits"] == {"concurrency": 2, "rate": None} and queues["fast"]["counts"]["pending"] == 1
    since = datetime.fromisoformat(queues["idle"]["paused_since"])
    assert since.tzinfo is not None and queues["idle"]["counts"]["pending"] == 0
    assert [r["rule"] for r in shards["rules"]] == [
        "at most 3 running per account", "at most 4 running per queue", "at most 6 running in the table"]
    assert tables["tasks"]["has_task"] is True and tables["tasks"]["queues"] == []
    for wrong in ("window=7d", "minutes=60"):
        assert get(client, f"/overview?{wrong}", 400)["error"] == "bad_filter"


def test_jobs_filter_as_the_page_does_with_one_and_several_values(engine: Engine, client: Any) -> None:
    def shown(query: str, table: str = "email_jobs") -> list[Any]:
        return ids(get(client, f"/tables/{table}/jobs?{query}&limit=50"))

    b = check_one_and_several_values(engine, shown)["b"]
    listing = get(client, "/tables/email_jobs/jobs?queue=b,a&status=failed")
    assert listing["filters"] == {"queue": ["b", "a"], "status": ["failed"], "task": [], "error": None}
    (row,) = listing["jobs"]
    assert row["id"] == b and row["queue"] == "b" and row["status"] == "failed" and row["attempts"] == 0
    assert row["last_error"] == {"preview": "SMTP timeout", "bytes": len("SMTP timeout")}
    assert datetime.fromisoformat(row["created_at"]).tzinfo is not None


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("/tables/email_jobs/jobs?status=lost", "no status lost"),
        ("/tables/email_jobs/jobs?status=failed,lost", "no status lost"),
        ("/tables/email_jobs/jobs?statuses=failed", "unknown argument(s) statuses"),
        ("/tables/email_jobs/dead?status=pending", "unknown argument(s) status"),
        ("/tables/email_jobs/jobs?task=crop", "no task column"),
        ("/tables/email_jobs/jobs?before=abc", "not a job id"),
        ("/tables/email_jobs/jobs?before=99999999999999999999", "not a job id"),
        ("/tables/uuid_jobs/jobs?before=12", "not a job id"),
        ("/tables/email_jobs/jobs?limit=0", "limit"),
        ("/tables/email_jobs/jobs?limit=501", "limit"),
        ("/tables/email_jobs/jobs?limit=x", "limit"),
    ],
)
def test_a_filter_that_cannot_be_is_a_typed_400(client: Any, path: str, says: str) -> None:
    error = get(client, path, 400)
    assert error["error"] == "bad_filter" and error["status"] == 400 and says in error["message"], error


def test_jobs_come_in_keyset_pages_that_keep_the_filters(engine: Engine, client: Any) -> None:
    keys = [add(engine, JOBS, queue="q", status="failed") for _ in range(7)]
    add(engine, JOBS, queue="other", status="failed")
    for first, sizes in (("/api/tables/email_jobs/jobs?queue=q", [3, 3, 1]),
                         ("/api/tables/email_jobs/jobs?queue=q&limit=5", [5, 2]),
                         ("/api/tables/email_jobs/dead?queue=q", [3, 3, 1])):
        seen: list[int] = []
        got: list[int] = []
        url: str | None = first
        while url:
            listing = get(client, url.removeprefix("/api"))
            seen += ids(listing)
            got.append(len(listing["jobs"]))
            url = listing["next"]
            assert (url is None) == (listing["next_before"] is None)
            if url:
                assert "queue=q" in url and f"before={listing['next_before']}" in url
                assert listing["next_before"] == listing["jobs"][-1]["id"]
        assert got == sizes and seen == sorted(keys, reverse=True), first


def test_dead_letters_are_the_failed_jobs_only(engine: Engine, client: Any) -> None:
    add(engine, JOBS, queue="q")
    add(engine, JOBS, queue="q", status="done")
    dead = add(engine, JOBS, queue="q", status="failed", last_error="boom")
    listing = get(client, "/tables/email_jobs/dead")
    assert ids(listing) == [dead] and listing["filters"]["status"] == ["failed"]


def test_one_job_has_every_column_typed(engine: Engine, client: Any) -> None:
    key = add(engine, JOBS, queue="q", status="failed", recipient="ann@example.com", attempts=3,
              last_error="Traceback\nValueError: x", lease_owner="host:1:abcd/0")
    with engine.connect() as conn:
        row = conn.execute(select(JOBS).where(JOBS.c.id == key)).one()._mapping
    found = get(client, f"/tables/email_jobs/jobs/{key}")
    assert found["table"] == "email_jobs" and found["id"] == key and isinstance(found["id"], int)
    job = found["job"]
    assert set(job) == set(JOBS.c.keys())
    for name, value in row.items():
        if isinstance(value, datetime):
            assert datetime.fromisoformat(job[name]) == value, name  # ISO 8601, to the microsecond
        elif isinstance(value, timedelta):
            assert job[name] == value.total_seconds()
        else:
            assert job[name] == value, name
    assert found["truncated"] == {} and found["reported"] == {}
    assert get(client, "/tables/email_jobs/jobs/999999", 404)["error"] == "no_such_job"
    assert get(client, "/tables/email_jobs/jobs/not-a-number", 404)["error"] == "no_such_job"
    assert get(client, "/tables/email_jobs/jobs/99999999999999999999", 404)["error"] == "no_such_job"
    assert get(client, "/tables/nope/jobs/1", 404)["error"] == "no_such_table"
    assert get(client, "/tables/nope/jobs", 404)["error"] == "no_such_table"
    assert get(client, "/tables/nope/workers", 404)["error"] == "no_such_table"


def test_a_uuid_key_is_a_string(engine: Engine, client: Any) -> None:
    key = add(engine, UUIDS, queue="q")
    assert isinstance(key, uuid.UUID)
    assert ids(get(client, "/tables/uuid_jobs/jobs")) == [str(key)]
    assert get(client, f"/tables/uuid_jobs/jobs/{key}")["job"]["id"] == str(key)
    assert get(client, "/tables/uuid_jobs/jobs/12", 404)["error"] == "no_such_job"


def test_big_values_are_cut_and_whole_on_request(engine: Engine, client: Any) -> None:
    payload = {"blob": "z" * 4_000_000, "html": XSS}
    error = "Traceback\n" + "e" * 150_000 + "\nValueError: the end"
    key = add(engine, TASKS, task="t", payload=payload, last_error=error)
    small = add(engine, TASKS, task="t", payload={"n": 1, "html": XSS})
    tracemalloc.start()
    try:
        found = get(client, f"/tables/tasks/jobs/{key}")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2_000_000, peak  # the 4 MB value never reaches Python
    job, truncated = found["job"], found["truncated"]
    assert set(truncated) == {"payload", "last_error"}
    assert isinstance(job["payload"], str) and len(job["payload"]) == 2000  # the dashboard's truncate
    assert len(job["last_error"]) == 100_000 and "the end" not in job["last_error"]
    for column, expected in (("payload", payload), ("last_error", error)):
        url = truncated[column]["value"]
        assert url == f"/api/tables/tasks/jobs/{key}/values/{column}"
        whole = get(client, url.removeprefix("/api"))
        assert whole == {"table": "tasks", "id": key, "column": column, "value": expected}
    assert truncated["last_error"]["length"] == len(error)
    assert truncated["payload"]["length"] > 4_000_000  # of the text PostgreSQL renders
    assert get(client, f"/tables/tasks/jobs/{small}")["job"]["payload"] == {"n": 1, "html": XSS}  # whole: JSON
    assert get(client, f"/tables/tasks/jobs/{key}/values/nope", 404)["error"] == "no_such_column"
    assert get(client, "/tables/tasks/jobs/999999/values/payload", 404)["error"] == "no_such_job"
    listing = get(client, "/tables/tasks/jobs")
    rows = {row["id"]: row for row in listing["jobs"]}
    assert rows[key]["payload"]["preview"] is None and rows[key]["payload"]["bytes"] > 0  # too big to preview
    assert rows[key]["last_error"]["preview"] is None and rows[key]["last_error"]["bytes"] == len(error)
    assert json.loads(rows[small]["payload"]["preview"]) == {"n": 1, "html": XSS}


def test_a_job_with_a_result_progress_and_history(engine: Engine, client: Any) -> None:
    history = [
        {"attempt": 1, "outcome": "retried", "worker": "w/1", "started_at": "t1", "seconds": 0.5, "error": XSS},
        {"attempt": 2, "outcome": "done", "worker": "w/2", "started_at": "t2", "seconds": 1, "error": None},
    ]
    key = add(engine, RESULTS, task="t", status="done", result={"html": XSS, "n": 1}, progress=[1, 2],
              history=history)
    found = get(client, f"/tables/result_tasks/jobs/{key}")
    assert found["reported"] == {"result": "result", "progress": "progress", "history": "history"}
    job = found["job"]
    assert (job["result"], job["progress"], job["history"]) == ({"html": XSS, "n": 1}, [1, 2], history)
    total = add(engine, TOTALS, total=42)
    found = get(client, f"/tables/total_jobs/jobs/{total}")
    assert found["reported"] == {"result": "total"} and found["job"]["total"] == 42


tasks = Tasks()
GO = threading.Event()


@tasks.task
def held(job: Any) -> None:
    assert GO.wait(30), "the test never let the job go"


@pytest.mark.parametrize("runtime", ["thread"], indirect=True)
def test_workers_recorded_connected_and_running(engine: Engine, start_worker: Callable[..., Any]) -> None:
    GO.clear()
    with engine.begin() as conn:  # a worker that died without stopping: gone
        conn.execute(insert(RESULT_WORKERS).values(
            name="dead:1:aaaa", host="h1", pid=1, concurrency=4, runtime="thread", version="0.1.0",
            last_seen=func.now() - timedelta(seconds=120)))  # gone, not yet pruned
    worker = start_worker(tasks, ResultTask, lease=60.0, heartbeat_interval=0.2)
    app = make_app(engine)
    try:
        with app.test_client() as client:
            key = add(engine, RESULTS, task="held", queue="q")
            wait_for(lambda: status_of(engine, RESULTS, key) == "running", what="the job running")
            def listed() -> Any:
                shown = get(client, "/tables/result_tasks/workers")
                return shown if shown["owners"] and shown["listening"] else None

            found = wait_for(listed, what="the worker listed")
    finally:
        GO.set()
    assert found["lease"] == 60.0 and found["gone_after"] == 60.0
    recorded = {w["name"]: w for w in found["recorded"]}
    assert set(recorded) == {"dead:1:aaaa", worker.owner}
    assert recorded["dead:1:aaaa"]["gone"] is True and recorded[worker.owner]["gone"] is False
    assert recorded[worker.owner]["runtime"] == "thread" and recorded[worker.owner]["concurrency"] >= 1
    datetime.fromisoformat(recorded[worker.owner]["started_at"])
    (owner,) = found["owners"]
    assert owner["owner"] == worker.owner and owner["jobs"] == 1 and owner["expired"] is False
    assert owner["running"] == [{"id": key, "lease_owner": owner["running"][0]["lease_owner"], "queue": "q",
                                 "task": "held"}]
    assert owner["running"][0]["lease_owner"].startswith(worker.owner + "/")
    assert datetime.fromisoformat(owner["last_heartbeat"]) <= datetime.fromisoformat(owner["latest_lease"])
    assert len(found["listening"]) >= 1 and all(w["pid"] > 0 for w in found["listening"])
    other = get(client, "/tables/email_jobs/workers")
    assert other["recorded"] is None and other["owners"] == []  # no workers table declared


def test_the_token_is_given_only_for_actions_and_only_to_this_origin(engine: Engine, client: Any) -> None:
    response = client.get("/api/csrf")
    assert response.status_code == 200 and "session=" in response.headers["Set-Cookie"]
    assert response.headers["Cross-Origin-Resource-Policy"] == "same-origin"
    assert response.headers["Cache-Control"] == "no-store" and response.headers["X-Content-Type-Options"] == "nosniff"
    first = response.get_json()
    assert first["header"] == "X-CSRF-Token" and token(client) == first["csrf_token"]  # one per session
    for site in ("cross-site", "same-site"):  # what a browser sends for another site's page
        error = get(client, "/csrf", 403, headers={"Sec-Fetch-Site": site})
        assert error["error"] == "cross_site" and "csrf_token" not in error
        assert get(client, "/overview", 403, headers={"Sec-Fetch-Site": site})["error"] == "cross_site"
    assert "csrf_token" in get(client, "/csrf", headers={"Sec-Fetch-Site": "same-origin"})
    error = get(client, "/csrf", 400, headers={"Host": "attacker.example"})  # DNS rebinding
    assert "csrf_token" not in error and error["error"] == "bad_request"
    for options in ({"api_actions": False}, {"read_only": True}, {"read_only": True, "api_actions": True}):
        with make_app(engine, **options).test_client() as other:
            error = get(other, "/csrf", 403)
            assert error["error"] == "read_only" and "csrf_token" not in error
            assert get(other, "/")["read_only"] is True and get(other, "/")["tables"][0]["actions"] == []


def test_every_action_runs_the_pages_fenced_statements(engine: Engine, client: Any) -> None:
    csrf = token(client)
    dead = [add(engine, JOBS, status="failed", attempts=20, last_error="x") for _ in range(2)]
    pending = [add(engine, JOBS) for _ in range(2)]
    running = add(engine, JOBS, status="running", lease_owner="w/0", attempts=1)

    answer = act(client, "email_jobs", "requeue", {"ids": [*dead, pending[0], str(running)]}, csrf=csrf)
    assert answer == {"table": "email_jobs", "action": "requeue", "requested": 4, "requeued": 2}
    assert [status_of(engine, JOBS, k) for k in dead] == ["pending", "pending"]
    assert status_of(engine, JOBS, running) == "running"  # only dead letters move

    answer = act(client, "email_jobs", "cancel", {"ids": [pending[0], running]}, csrf=csrf)
    assert (answer["requested"], answer["cancelled"]) == (2, 2)
    assert status_of(engine, JOBS, running) == "cancelled"
    assert act(client, "email_jobs", "cancel", {"ids": [running]}, csrf=csrf)["cancelled"] == 0  # finished now

    still = add(engine, JOBS, status="running", lease_owner="w/0", attempts=1)
    answer = act(client, "email_jobs", "delete", {"ids": [pending[0], pending[1], running, still]}, csrf=csrf)
    assert (answer["requested"], answer["deleted"], answer["kept_holding_keys"]) == (4, 3, 0)
    assert status_of(engine, JOBS, pending[1]) is None and status_of(engine, JOBS, still) == "running"

    # A done job that still holds its unique key is kept until asked again with free_keys.
    once = add(engine, ONCE, status="done", unique_key="k1")
    answer = act(client, "once_jobs", "delete", {"ids": [once]}, csrf=csrf)
    assert (answer["deleted"], answer["kept_holding_keys"]) == (0, 1) and status_of(engine, ONCE, once) == "done"
    answer = act(client, "once_jobs", "delete", {"ids": [once], "free_keys": True}, csrf=csrf)
    assert (answer["deleted"], answer["kept_holding_keys"]) == (1, 0) and status_of(engine, ONCE, once) is None

    smtp = [add(engine, TASKS, task="mail", queue="out", status="failed", last_error=f"SMTPError {i}")
            for i in range(4)]
    other_task = add(engine, TASKS, task="sms", queue="out", status="failed", last_error="SMTPError")
    other_queue = add(engine, TASKS, task="mail", queue="in", status="failed", last_error="SMTPError")
    answer = act(client, "tasks", "requeue_matching", {"queue": ["out"], "task": "mail,x", "error": "smtp"},
                 csrf=csrf)
    assert answer == {"table": "tasks", "action": "requeue_matching", "requeued": 4}
    assert all(status_of(engine, TASKS, k) == "pending" for k in smtp)
    assert status_of(engine, TASKS, other_task) == status_of(engine, TASKS, other_queue) == "failed"

    assert act(client, "shard_jobs", "pause", {"queue": "fast"}, csrf=csrf) == {
        "table": "shard_jobs", "action": "pause", "queue": "fast", "paused": True, "changed": True}
    assert act(client, "shard_jobs", "pause", {"queue": "fast"}, csrf=csrf)["changed"] is False
    assert get(client, "/overview")["tables"][3]["queues"][0]["paused_since"] is not None
    assert act(client, "shard_jobs", "resume", {"queue": "fast"}, csrf=csrf)["changed"] is True
    assert act(client, "shard_jobs", "limit", {"queue": "fast", "concurrency": 2}, csrf=csrf) == {
        "table": "shard_jobs", "action": "limit", "queue": "fast", "concurrency": 2, "rate": None}
    (fast,) = get(client, "/overview")["tables"][3]["queues"]
    assert fast["paused_since"] is None and fast["limits"] == {"concurrency": 2, "rate": None}


def snapshot(engine: Engine) -> list[Any]:
    """Every row the actions below could change."""
    with engine.connect() as conn:
        return [sorted(conn.execute(select(table)).all(), key=lambda r: str(r[0]))
                for table in (JOBS, TASKS, SHARDS, ONCE, SHARD_QUEUES)]


#: Each action of the API with a body it would act on (the rows made by ``seed``).
ACTIONS: list[tuple[str, str, dict[str, Any]]] = [
    ("email_jobs", "requeue", {"ids": [1]}),
    ("email_jobs", "cancel", {"ids": [2]}),
    ("email_jobs", "delete", {"ids": [1, 2], "free_keys": True}),
    ("email_jobs", "requeue_matching", {"error": "boom"}),
    ("shard_jobs", "pause", {"queue": "fast"}),
    ("shard_jobs", "resume", {"queue": "slow"}),
    ("shard_jobs", "limit", {"queue": "fast", "concurrency": 1}),
]


def seed(engine: Engine) -> None:
    assert add(engine, JOBS, status="failed", last_error="boom") == 1
    assert add(engine, JOBS) == 2
    add(engine, SHARDS, queue="fast")
    with engine.begin() as conn:
        pause(conn, ShardJob, "slow")


@pytest.mark.parametrize(("refusal", "status", "kind"), [*API_REFUSALS, PAGE_TOKEN_REFUSAL])
def test_every_action_is_refused_and_changes_nothing(engine: Engine, refusal: str, status: int, kind: str) -> None:
    seed(engine)
    before = snapshot(engine)
    with client_of(make_app(engine, **refusal_options(refusal))) as client:
        refuse_every_action(client, refusal, status, kind, ACTIONS, form={"ids": "1"})
    assert snapshot(engine) == before
    # The same actions, allowed and with the token, change what they say they do.
    with client_of(make_app(engine)) as client:
        run_every_action(client, ACTIONS)
    assert snapshot(engine) != before


@pytest.mark.parametrize(
    ("table", "verb", "body", "status", "kind"),
    [
        ("email_jobs", "requeue", {}, 400, "bad_body"),
        ("email_jobs", "requeue", {"ids": []}, 400, "bad_body"),
        ("email_jobs", "requeue", {"ids": "1"}, 400, "bad_body"),
        ("email_jobs", "requeue", {"ids": [True]}, 400, "bad_body"),
        ("email_jobs", "requeue", {"ids": [1.5]}, 400, "bad_body"),
        ("email_jobs", "requeue", {"ids": ["abc"]}, 400, "bad_body"),
        ("email_jobs", "requeue", {"ids": [99999999999999999999]}, 400, "bad_body"),
        ("email_jobs", "cancel", {"ids": ["1\x00"]}, 400, "bad_body"),
        ("email_jobs", "delete", {"ids": [1], "free_keys": "yes"}, 400, "bad_body"),
        ("email_jobs", "requeue_matching", {"error": "\x00"}, 400, "bad_body"),
        ("email_jobs", "requeue_matching", {"queue": 3}, 400, "bad_body"),
        ("email_jobs", "requeue_matching", {"task": ["x"]}, 400, "bad_body"),
        ("email_jobs", "pause", {"queue": "q"}, 400, "not_pausable"),
        ("shard_jobs", "pause", {}, 400, "bad_body"),
        ("shard_jobs", "pause", {"queue": ""}, 400, "bad_body"),
        ("shard_jobs", "limit", {"queue": "q", "concurrency": "2"}, 400, "bad_body"),
        ("shard_jobs", "limit", {"queue": "q", "concurrency": 0}, 400, "bad_body"),
        ("email_jobs", "limit", {"queue": "q", "concurrency": 2}, 400, "bad_body"),
        ("email_jobs", "drop", {"ids": [1]}, 404, "no_such_action"),
        ("nope", "requeue", {"ids": [1]}, 404, "no_such_table"),
        ("email_jobs", "requeue", [1], 400, "bad_body"),
    ],
)
def test_a_body_that_cannot_be_is_refused_typed(
    engine: Engine, client: Any, table: str, verb: str, body: Any, status: int, kind: str
) -> None:
    key = add(engine, JOBS, status="failed", last_error="x")
    answer = act(client, table, verb, body, csrf=token(client), status=status)
    assert answer["error"] == kind, answer
    assert status_of(engine, JOBS, key) == "failed"


def test_errors_are_typed_json_never_an_html_page(engine: Engine, client: Any) -> None:
    def error(response: Any, status: int, kind: str) -> str:
        assert response.status_code == status and response.mimetype == "application/json"
        body = response.get_json()
        assert body["error"] == kind and body["status"] == status and body["message"], body
        assert "<html" not in response.get_data(as_text=True).lower()
        return str(body["message"])

    error(client.post("/api/overview", json={}), 405, "method_not_allowed")
    response = client.get("/api/tables/email_jobs/actions/requeue")
    error(response, 405, "method_not_allowed")
    assert response.headers["Allow"] == "POST"
    error(client.delete("/api/tables/email_jobs/jobs/1"), 405, "method_not_allowed")
    error(client.put("/api/tables/email_jobs/jobs"), 405, "method_not_allowed")
    error(client.get("/api/nothing/here"), 404, "not_found")
    error(client.post("/api/nothing", json={}), 404, "not_found")
    error(client.get("/api/tables/email_jobs/jobs?queue=a%00b"), 400, "bad_request")  # the pages' NUL check
    csrf = token(client)
    error(client.post("/api/tables/email_jobs/actions/requeue", data="{", headers={
        "X-CSRF-Token": csrf, "Content-Type": "application/json"}), 400, "bad_body")
    # The dashboard's own checks, on the API, answer in JSON too.
    assert "host name" in error(client.get("/api/overview", headers={"Host": "evil.example"}), 400, "bad_request")
    app = Flask(__name__)
    app.secret_key = "test"
    allowed = {"yes": False}
    app.register_blueprint(dashboard_blueprint(engine, [EmailJob], auth=lambda: allowed["yes"]), url_prefix="/q")
    with app.test_client() as other:
        error(other.get("/q/api/overview"), 403, "forbidden")
        allowed["yes"] = True
        assert other.get("/q/api/overview").status_code == 200
        assert other.get("/q/api/").get_json()["overview"] == "/q/api/overview"  # under the mount's prefix
        error(other.get("/q/api/csrf"), 403, "read_only")  # read-only by default, mounted too


def test_markup_in_any_value_is_a_json_string(engine: Engine, client: Any) -> None:
    key = add(engine, TASKS, task=XSS, queue=XSS, payload={XSS: XSS, "list": [XSS]}, last_error=XSS,
              lease_owner=XSS)
    responses = [
        client.get("/api/tables/tasks/jobs"),
        client.get(f"/api/tables/tasks/jobs?queue={XSS}&task={XSS}&error={XSS}"),
        client.get(f"/api/tables/tasks/jobs/{key}"),
        client.get(f"/api/tables/tasks/jobs/{key}/values/payload"),
        client.get("/api/overview"),
        client.get(f"/api/tables/{XSS}/jobs"),
        client.get(f"/api/tables/tasks/jobs?status={XSS}"),
    ]
    for response in responses:
        text = response.get_data(as_text=True)
        assert response.mimetype == "application/json" and response.headers["X-Content-Type-Options"] == "nosniff"
        assert "<" not in text and ">" not in text, text[:300]  # escaped as \u003c, \u003e
        assert "script-src" not in response.headers["Content-Security-Policy"]
    listing, filtered, found, whole, overview = (r.get_json() for r in responses[:5])
    assert listing["jobs"][0]["task"] == XSS and listing["jobs"][0]["queue"] == XSS
    assert filtered["filters"] == {"queue": [XSS], "status": [], "task": [XSS], "error": XSS}
    assert found["job"]["payload"] == {XSS: XSS, "list": [XSS]} and found["job"]["last_error"] == XSS
    assert whole["value"] == {XSS: XSS, "list": [XSS]}
    assert [q["queue"] for t in overview["tables"] for q in t["queues"]] == [XSS]
    assert XSS in responses[5].get_json()["message"] and XSS in responses[6].get_json()["message"]


def test_actions_are_allowed_by_a_flag_of_the_blueprint_and_the_command_line(engine: Engine) -> None:
    assert build_parser().parse_args(["dashboard", "tests.models:Task", "--api-actions"]).api_actions is True
    assert build_parser().parse_args(["dashboard", "tests.models:Task"]).api_actions is False
    app = Flask(__name__)
    app.secret_key = "test"
    app.register_blueprint(dashboard_blueprint(engine, [EmailJob], auth=lambda: request.host == "localhost",
                                               api_actions=True))
    with app.test_client() as client:
        assert "csrf_token" in client.get("/api/csrf").get_json()
