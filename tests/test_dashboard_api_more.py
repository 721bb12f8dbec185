"""The JSON API's endpoints of the overview's charts, the schedules page and the bulk
actions by filter (:mod:`sqla_queue.dashboard.api_more`) through Flask's test client,
against real PostgreSQL: each read answers what the page shows; run now fenced by the
watermark the caller read; pause and resume; a bulk action counted, then walked over the
jobs of the count, a delete keeping the key holders until asked again; and every new
action refused (no token, read-only, actions off, forged Host or Origin, cross-site) with
nothing changed."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, insert, select

pytest.importorskip("flask")

from flask import Flask

from sqla_queue import Schedule
from sqla_queue import sql as q
from sqla_queue.activity import bucket_start
from sqla_queue.dashboard import create_app

from .dashboard_helpers import (
    API_REFUSALS,
    HOURLY,
    NIGHTLY,
    XSS,
    act,
    add_rows,
    client_of,
    dashboard_app,
    get,
    refusal_options,
    refuse_every_action,
    run_every_action,
    schedule_state,
    token,
    watermark,
)
from .helpers import table_of
from .models import TASK_SCHEDULES, ChartJob, EmailJob, OnceJob, Task
from .test_activity import RUNS, WAITS, db_now, finished, p

CHARTS = table_of(ChartJob)
JOBS = table_of(EmailJob)
TASKS = table_of(Task)
ONCE = table_of(OnceJob)
MINUTE = timedelta(minutes=1)


def make_app(engine: Engine, **options: Any) -> Flask:
    """Charts, schedules, bulk actions, the API's actions on unless a test says otherwise."""
    return dashboard_app(engine, [ChartJob, EmailJob, Task, OnceJob], schedules={Task: [HOURLY, NIGHTLY]},
                       **{"api_actions": True, **options})


@pytest.fixture
def client(engine: Engine) -> Iterator[Any]:
    with client_of(make_app(engine)) as client:
        yield client


def rows(engine: Engine, table: Any) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(table).order_by(table.c.id)).all())


def statuses(engine: Engine, table: Any) -> dict[Any, str]:
    """Every row's status, by key."""
    with engine.connect() as conn:
        return dict(conn.execute(select(table.c.id, table.c.status)).all())


def test_the_index_names_the_new_reads_and_actions(client: Any) -> None:
    tables = {t["table"]: t for t in get(client, "/")["tables"]}
    tasks, emails = tables["tasks"], tables["email_jobs"]
    assert (tasks["activity"], tasks["schedules"], tasks["bulk"]) == (
        "/api/tables/tasks/activity", "/api/tables/tasks/schedules", "/api/tables/tasks/bulk")
    assert emails["schedules"] is None  # no schedules: no page, no URL
    for verb in ("run_now", "pause_schedule", "resume_schedule", "bulk_requeue", "bulk_cancel", "bulk_delete"):
        assert f"/api/tables/tasks/actions/{verb}" in tasks["actions"]
    assert "/api/tables/email_jobs/actions/run_now" not in emails["actions"]
    assert "/api/tables/email_jobs/actions/bulk_cancel" in emails["actions"]


def test_the_activity_is_the_page_s_buckets_over_each_window(engine: Engine, client: Any) -> None:
    minute = bucket_start(db_now(engine), 60) - 3 * MINUTE
    with engine.begin() as conn:
        conn.execute(insert(CHARTS), [
            *finished(minute, "mail", "done", WAITS[:8], RUNS[:8]),
            *finished(minute, "mail", "failed", WAITS[8:], RUNS[8:]),
            *finished(minute + MINUTE, "mail", "failed", [1.0], [1.0]),
            *finished(minute + MINUTE, "mail", "cancelled", [1.0], [1.0]),
            *finished(minute - timedelta(hours=20), "mail", "done", [1.0, 3.0], [2.0, 4.0]),
        ])
        conn.execute(insert(CHARTS), [{"queue": "mail"}] * 2)
        conn.execute(insert(CHARTS).values(queue="mail", run_after=func.now() - timedelta(minutes=5)))
        conn.execute(insert(CHARTS).values(queue="later", run_after=func.now() + timedelta(hours=1)))
    hour = get(client, "/tables/chart_jobs/activity")
    assert hour["table"] == "chart_jobs" and hour["window"]["window"] == "1h" and hour["recorded"] is True
    queues = {queue["queue"]: queue for queue in hour["queues"]}
    assert list(queues) == ["later", "mail"]  # a queue with a job pending only: idle, as on the page
    mail = queues["mail"]
    assert mail["counts"] == {"pending": 3, "running": 0, "done": 8, "failed": 3, "cancelled": 1}
    assert 290 <= mail["oldest_runnable_seconds"] <= 400
    points = {datetime.fromisoformat(point["bucket"]): point for point in mail["points"]}
    assert len(mail["points"]) == 60
    ten = points[minute]
    assert (ten["done"], ten["failed"], ten["cancelled"]) == (8, 2, 0)
    assert ten["pickup_p50"] == pytest.approx(p(WAITS, 50)) and ten["pickup_p99"] == pytest.approx(p(WAITS, 99))
    assert ten["run_p50"] == pytest.approx(p(RUNS, 50)) and ten["run_p99"] == pytest.approx(p(RUNS, 99))
    assert (points[minute + MINUTE]["failed"], points[minute + MINUTE]["cancelled"]) == (1, 1)
    assert mail["points"][-1]["waiting"] == 3  # now, on the bucket in progress
    later = queues["later"]
    assert later["counts"]["pending"] == 1 and later["points"][-1]["waiting"] == 0  # not runnable yet
    assert all(point["done"] == 0 and point["pickup_p50"] is None for point in later["points"])

    day = get(client, "/tables/chart_jobs/activity?window=24h")
    assert day["window"] == {"window": "24h", "label": "last 24 hours", "bucket_seconds": 900, "buckets": 96}
    mail = next(queue for queue in day["queues"] if queue["queue"] == "mail")
    assert len(mail["points"]) == 96 and mail["counts"]["done"] == 10
    old = next(point for point in mail["points"]
               if datetime.fromisoformat(point["bucket"]) == bucket_start(minute - timedelta(hours=20), 900))
    assert (old["done"], old["run_p50"], old["run_p99"]) == (2, pytest.approx(3.0), pytest.approx(3.98))
    assert get(client, "/tables/email_jobs/activity")["queues"] == []
    for wrong in ("window=7d", "window=1h&live=5"):
        assert get(client, f"/tables/chart_jobs/activity?{wrong}", 400)["error"] == "bad_filter"
    assert get(client, "/tables/nope/activity", 404)["error"] == "no_such_table"


def test_the_schedules_are_the_page_s_escaped(engine: Engine, client: Any) -> None:
    last = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    watermark(engine, "hourly", last)
    watermark(engine, f"gone {XSS}", last - timedelta(days=3))  # a row whose schedule left the code
    before = datetime.now(UTC)
    response = client.get("/api/tables/tasks/schedules")
    after = datetime.now(UTC)
    assert "<" not in response.get_data(as_text=True)
    found = response.get_json()
    assert (found["table"], found["watermark_table"], found["code_known"], found["watermark_table_missing"]) == (
        "tasks", "tasks_schedules", True, False)
    shown = {s["name"]: s for s in found["schedules"]}
    assert list(shown) == [f"gone {XSS}", "hourly", f"nightly {XSS}"]
    hourly = shown["hourly"]
    assert (hourly["expression"], hourly["timezone"], hourly["in_code"], hourly["paused_at"]) == (
        "every 3600s", "UTC", True, None)
    assert datetime.fromisoformat(hourly["last_tick"]) == last
    assert datetime.fromisoformat(hourly["next_tick"]) in {HOURLY.next_tick(before), HOURLY.next_tick(after)}
    nightly = shown[f"nightly {XSS}"]
    assert (nightly["expression"], nightly["timezone"], nightly["last_tick"]) == ("30 2 * * *", "Europe/Paris", None)
    gone = shown[f"gone {XSS}"]
    assert (gone["expression"], gone["in_code"], gone["next_tick"]) == (None, False, None)
    assert get(client, "/tables/email_jobs/schedules", 404)["error"] == "no_schedules"
    with create_app(engine, [Task]).test_client() as other:  # the code unknown: the rows only
        rows_only = get(other, "/tables/tasks/schedules")
        assert rows_only["code_known"] is False and {s["in_code"] for s in rows_only["schedules"]} == {None}


def test_run_now_is_fenced_by_the_watermark_the_caller_read(engine: Engine, client: Any) -> None:
    last = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
    watermark(engine, "hourly", last)
    csrf = token(client)
    seen = next(s for s in get(client, "/tables/tasks/schedules")["schedules"] if s["name"] == "hourly")["last_tick"]
    clicked = datetime.now(UTC)
    answer = act(client, "tasks", "run_now", {"name": "hourly", "seen": seen}, csrf=csrf)
    (job,) = rows(engine, TASKS)
    assert (job.task, job.payload, job.queue) == ("report", {"kind": "hourly"}, "reports")
    assert datetime.fromisoformat(answer.pop("last_tick")) == job.run_after
    assert answer == {"table": "tasks", "action": "run_now", "name": "hourly", "job": job.id}
    assert clicked <= job.run_after <= datetime.now(UTC)
    after = schedule_state(engine, "hourly")
    assert (after.last_tick, after.previous_tick) == (job.run_after, last)
    # The same body again: the watermark moved since it was read, nothing is enqueued.
    assert act(client, "tasks", "run_now", {"name": "hourly", "seen": seen}, csrf=csrf,
               status=409)["error"] == "schedule_ticked"
    # A worker's tick since the read: the same.
    watermark(engine, "hourly", job.run_after + timedelta(hours=1))
    now = get(client, "/tables/tasks/schedules")["schedules"][0]["last_tick"]
    watermark(engine, "hourly", job.run_after + timedelta(hours=2))
    assert act(client, "tasks", "run_now", {"name": "hourly", "seen": now}, csrf=csrf, status=409)["error"] == (
        "schedule_ticked")
    assert len(rows(engine, TASKS)) == 1
    # A schedule never ticked: seen is null.
    assert act(client, "tasks", "run_now", {"name": f"nightly {XSS}", "seen": None}, csrf=csrf)["job"] is not None
    assert len(rows(engine, TASKS)) == 2
    for body, status, kind in (
        ({"name": "hourly"}, 400, "bad_body"),  # what the caller saw is required
        ({"name": "hourly", "seen": "yesterday"}, 400, "bad_body"),
        ({"name": "hourly", "seen": "2026-01-01T00:00:00"}, 400, "bad_body"),  # no offset
        ({"name": "nobody", "seen": None}, 404, "no_such_schedule"),
        ({"name": "", "seen": None}, 400, "bad_body"),
        ({"name": 3, "seen": None}, 400, "bad_body"),
    ):
        assert act(client, "tasks", "run_now", body, csrf=csrf, status=status)["error"] == kind, body
    watermark(engine, "gone", last)
    assert act(client, "tasks", "run_now", {"name": "gone", "seen": last.isoformat()}, csrf=csrf,
               status=400)["error"] == "not_in_code"
    assert act(client, "email_jobs", "run_now", {"name": "hourly", "seen": None}, csrf=csrf,
               status=404)["error"] == "no_schedules"
    assert len(rows(engine, TASKS)) == 2 and schedule_state(engine, "gone").last_tick == last


def test_a_run_whose_job_cannot_be_made_changes_nothing(engine: Engine) -> None:
    def broken(tick: datetime) -> dict[str, Any]:
        raise RuntimeError(f"no report for {XSS}")

    app = create_app(engine, [Task], schedules={Task: [Schedule("broken", every=60, values=broken)]},
                     api_actions=True)
    start = datetime(2026, 1, 1, tzinfo=UTC)
    watermark(engine, "broken", start)
    with client_of(app) as client:
        error = act(client, "tasks", "run_now", {"name": "broken", "seen": start.isoformat()}, csrf=token(client),
                    status=422)
    assert error["error"] == "enqueue_failed" and "RuntimeError: no report for " + XSS in error["message"]
    assert rows(engine, TASKS) == [] and schedule_state(engine, "broken").last_tick == start


def test_pause_and_resume_a_schedule(engine: Engine, client: Any) -> None:
    watermark(engine, "hourly", datetime(2026, 1, 1, tzinfo=UTC))
    csrf = token(client)
    assert act(client, "tasks", "pause_schedule", {"name": "hourly"}, csrf=csrf) == {
        "table": "tasks", "action": "pause_schedule", "name": "hourly", "paused": True, "changed": True}
    assert schedule_state(engine, "hourly").paused_at is not None
    assert act(client, "tasks", "pause_schedule", {"name": "hourly"}, csrf=csrf)["changed"] is False
    shown = get(client, "/tables/tasks/schedules")["schedules"][0]
    assert shown["paused_at"] is not None and shown["next_tick"] is None
    # A schedule with no row yet is paused too: its row is made, paused.
    assert act(client, "tasks", "pause_schedule", {"name": f"nightly {XSS}"}, csrf=csrf)["changed"] is True
    assert schedule_state(engine, f"nightly {XSS}").paused_at is not None
    resumed_at = datetime.now(UTC)
    assert act(client, "tasks", "resume_schedule", {"name": "hourly"}, csrf=csrf)["changed"] is True
    after = schedule_state(engine, "hourly")
    assert after.paused_at is None and after.last_tick >= resumed_at  # the pause's ticks skipped
    assert act(client, "tasks", "resume_schedule", {"name": "hourly"}, csrf=csrf)["changed"] is False
    assert act(client, "tasks", "pause_schedule", {"name": "nobody"}, csrf=csrf, status=404)["error"] == (
        "no_such_schedule")
    assert schedule_state(engine, "nobody") is None


def test_a_bulk_action_is_counted_then_walks_the_jobs_of_the_count(engine: Engine, client: Any) -> None:
    pending = add_rows(engine, JOBS, 3, queue="a")
    running = add_rows(engine, JOBS, queue="a", status="running", lease_owner="w/0", attempts=1)
    other = add_rows(engine, JOBS, 2, queue="b")
    done = add_rows(engine, JOBS, queue="a", status="done")
    csrf = token(client)
    count = get(client, "/tables/email_jobs/bulk?action=cancel&queue=a")
    assert (count["matched"], count["acting"], count["holding_keys"]) == (5, 4, 0)
    assert count["filters"] == {"queue": ["a"], "status": [], "task": [], "error": None}
    assert count["batch"] == 1000 and count["run"] == "/api/tables/email_jobs/actions/bulk_cancel"
    assert set(statuses(engine, JOBS).values()) == {"pending", "running", "done"}  # a count changes nothing
    late = add_rows(engine, JOBS, queue="a")  # enqueued after the count: not the caller's to cancel
    answer = act(client, "email_jobs", "bulk_cancel", {"queue": "a", "as_of": count["as_of"]}, csrf=csrf)
    assert (answer["done"], answer["batches"], answer["kept_holding_keys"]) == (4, 1, 0)
    assert answer["filters"]["queue"] == ["a"]
    found = statuses(engine, JOBS)
    assert [found[k] for k in [*pending, *running]] == ["cancelled"] * 4
    assert [found[k] for k in [*other, *done, *late]] == ["pending", "pending", "done", "pending"]

    dead = add_rows(engine, TASKS, 2, task="mail", queue="out", status="failed", last_error="SMTPError")
    kept = add_rows(engine, TASKS, task="sms", queue="out", status="failed", last_error="SMTPError")
    count = get(client, "/tables/tasks/bulk?action=requeue&task=mail&status=failed,pending&error=smtp")
    assert (count["matched"], count["acting"]) == (2, 2)
    answer = act(client, "tasks", "bulk_requeue", {"task": ["mail"], "status": "failed,pending", "error": "smtp",
                                                   "as_of": count["as_of"]}, csrf=csrf)
    assert answer["done"] == 2
    assert [statuses(engine, TASKS)[k] for k in [*dead, *kept]] == ["pending", "pending", "failed"]


def test_a_bulk_delete_keeps_key_holders_until_asked_with_free_keys(engine: Engine, client: Any) -> None:
    holder = add_rows(engine, ONCE, status="done", unique_key="k1")
    plain = add_rows(engine, ONCE, status="failed")
    csrf = token(client)
    count = get(client, "/tables/once_jobs/bulk?action=delete")
    assert (count["matched"], count["acting"], count["holding_keys"]) == (2, 1, 1)
    answer = act(client, "once_jobs", "bulk_delete", {"as_of": count["as_of"]}, csrf=csrf)
    assert (answer["done"], answer["kept_holding_keys"]) == (1, 1)
    assert statuses(engine, ONCE) == {holder[0]: "done"} and plain[0] not in statuses(engine, ONCE)
    answer = act(client, "once_jobs", "bulk_delete", {"as_of": count["as_of"], "free_keys": True}, csrf=csrf)
    assert (answer["done"], answer["kept_holding_keys"]) == (1, 0) and statuses(engine, ONCE) == {}


@pytest.mark.parametrize(
    ("request_", "status", "kind"),
    [
        ("/tables/email_jobs/bulk", 400, "bad_filter"),  # no action
        ("/tables/email_jobs/bulk?action=drop", 400, "bad_filter"),
        ("/tables/email_jobs/bulk?action=cancel&status=lost", 400, "bad_filter"),
        ("/tables/email_jobs/bulk?action=cancel&task=x", 400, "bad_filter"),
        ("/tables/email_jobs/bulk?action=cancel&limit=5", 400, "bad_filter"),
        ("/tables/nope/bulk?action=cancel", 404, "no_such_table"),
    ],
)
def test_a_count_that_cannot_be_is_a_typed_error(client: Any, request_: str, status: int, kind: str) -> None:
    assert get(client, request_, status)["error"] == kind


@pytest.mark.parametrize(
    ("verb", "body"),
    [
        ("bulk_cancel", {}),  # no as_of: the count it confirms
        ("bulk_cancel", {"as_of": "now"}),
        ("bulk_cancel", {"as_of": "2026-01-01T00:00:00"}),
        ("bulk_cancel", {"as_of": "2999-01-01T00:00:00+00:00", "status": ["lost"]}),
        ("bulk_cancel", {"as_of": "2999-01-01T00:00:00+00:00", "status": "failed,lost"}),
        ("bulk_cancel", {"as_of": "2999-01-01T00:00:00+00:00", "queue": 3}),
        ("bulk_cancel", {"as_of": "2999-01-01T00:00:00+00:00", "error": 3}),
        ("bulk_cancel", {"as_of": "2999-01-01T00:00:00+00:00", "task": "x"}),
        ("bulk_cancel", {"as_of": "2999-01-01T00:00:00+00:00", "free_keys": True}),
        ("bulk_delete", {"as_of": "2999-01-01T00:00:00+00:00", "free_keys": "yes"}),
    ],
)
def test_a_bulk_body_that_cannot_be_is_refused_and_changes_nothing(
    engine: Engine, client: Any, verb: str, body: dict[str, Any]
) -> None:
    add_rows(engine, JOBS, 2)
    before = statuses(engine, JOBS)
    assert act(client, "email_jobs", verb, body, csrf=token(client), status=400)["error"] == "bad_body"
    assert statuses(engine, JOBS) == before


FAR = "2999-01-01T00:00:00+00:00"
#: Each new action with a body it would act on (the rows made by ``seed``).
ACTIONS: list[tuple[str, str, dict[str, Any]]] = [
    ("tasks", "run_now", {"name": "hourly", "seen": None}),
    ("tasks", "pause_schedule", {"name": "hourly"}),
    ("tasks", "resume_schedule", {"name": "paused"}),
    ("email_jobs", "bulk_requeue", {"as_of": FAR}),
    ("email_jobs", "bulk_cancel", {"as_of": FAR}),
    ("once_jobs", "bulk_delete", {"as_of": FAR, "free_keys": True}),
]


def seed(engine: Engine) -> None:
    add_rows(engine, JOBS, status="failed", last_error="boom")
    add_rows(engine, JOBS)
    add_rows(engine, ONCE, status="done", unique_key="k1")
    with engine.begin() as conn:
        conn.execute(q.pause_schedule(Task, schedule="paused", tick=datetime(2026, 1, 1, tzinfo=UTC)))


def snapshot(engine: Engine) -> list[Any]:
    """Every row the actions above could change."""
    with engine.connect() as conn:
        return [sorted(conn.execute(select(table)).all(), key=lambda r: str(r[0]))
                for table in (JOBS, TASKS, ONCE, TASK_SCHEDULES)]


@pytest.mark.parametrize(("refusal", "status", "kind"), API_REFUSALS)
def test_every_new_action_is_refused_and_changes_nothing(engine: Engine, refusal: str, status: int, kind: str) -> None:
    seed(engine)
    before = snapshot(engine)
    options = refusal_options(refusal)
    with client_of(make_app(engine, **options)) as client:
        refuse_every_action(client, refusal, status, kind, ACTIONS, form={"as_of": FAR, "name": "hourly"})
        if options:  # the count confirms an action: refused where the action is, as the page's
            assert get(client, "/tables/email_jobs/bulk?action=cancel", 403)["error"] == "read_only"
            assert get(client, "/")["tables"][0]["bulk"] is None
    assert snapshot(engine) == before
    # The same actions, allowed and with the token, change what they say they do.
    with client_of(make_app(engine)) as client:
        answers = run_every_action(client, ACTIONS)
    changed = [answer.get("changed", answer.get("done", answer.get("job"))) for answer in answers]
    assert all(changed), changed
    assert snapshot(engine) != before


def test_a_read_only_dashboard_still_reads_the_schedules_and_activity(engine: Engine) -> None:
    watermark(engine, "hourly", datetime(2026, 1, 1, tzinfo=UTC))
    with make_app(engine, read_only=True).test_client() as client:
        assert [s["name"] for s in get(client, "/tables/tasks/schedules")["schedules"]][:1] == ["hourly"]
        assert get(client, "/tables/chart_jobs/activity")["queues"] == []
        assert get(client, "/")["tables"][2]["actions"] == []
    assert schedule_state(engine, "hourly").paused_at is None
