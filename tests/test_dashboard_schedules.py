"""The dashboard's schedules page through Flask's test client, against real PostgreSQL:
the schedules of the code and of the watermark table, run now, pause and resume, and
every action's protections (CSRF token, read-only mode, Host and Origin)."""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, select

pytest.importorskip("flask")

from flask import Flask

from sqla_queue import Schedule
from sqla_queue.dashboard import create_app, dashboard_blueprint

from .dashboard_helpers import (
    HOURLY,
    NIGHTLY,
    XSS,
    client_of,
    dashboard_app,
    page_token,
    schedule_state,
    watermark,
)
from .helpers import table_of
from .models import EmailJob, ReportJob, Task

TASKS = table_of(Task)


@pytest.fixture
def client(engine: Engine) -> Iterator[Any]:
    with client_of(dashboard_app(engine, [EmailJob, Task], schedules={Task: [HOURLY, NIGHTLY]})) as client:
        yield client


def jobs(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(TASKS).order_by(TASKS.c.id)).all())


def rows(page: str) -> dict[str, list[str]]:
    """The schedules table's rows by name, each its cells' text."""
    found = {}
    for name, cells in re.findall(r'<tr data-schedule="([^"]*)">(.*?)</tr>', page, re.S):
        found[html.unescape(name)] = [" ".join(html.unescape(re.sub("<[^>]+>", " ", c)).split())
                                      for c in re.findall(r"<td[^>]*>(.*?)</td>", cells, re.S)]
    return found


def form(page: str, **fields: str) -> dict[str, str]:
    """The hidden fields of the form on ``page`` holding ``fields`` (its name=value)."""
    for body in re.findall(r"<form[^>]*>(.*?)</form>", page, re.S):
        hidden = {n: html.unescape(v) for n, v in re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">',
                                                             body)}
        if all(hidden.get(k) == v for k, v in fields.items()):
            return hidden
    raise AssertionError(f"no form with {fields} on the page")


def test_the_page_lists_the_code_s_schedules_and_rows_only_escaped(engine: Engine, client: Any) -> None:
    last = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    watermark(engine, "hourly", last)
    watermark(engine, f"gone {XSS}", last - timedelta(days=3))  # a row whose schedule left the code
    before = datetime.now(UTC)
    page = client.get("/tasks/schedules").get_data(as_text=True)
    after = datetime.now(UTC)
    assert "<script>" not in page and "&lt;script&gt;" in page
    shown = rows(page)
    assert list(shown) == [f"gone {XSS}", "hourly", f"nightly {XSS}"]
    _, when, zone, last_tick, next_tick, in_code, status, actions = shown["hourly"]
    assert (when, zone, in_code, status) == ("every 3600s", "UTC", "yes", "active")
    assert last_tick == last.isoformat(sep=" ")
    assert next_tick in {HOURLY.next_tick(before).isoformat(sep=" "), HOURLY.next_tick(after).isoformat(sep=" ")}
    assert "Run now" in actions and "Pause" in actions
    assert shown[f"nightly {XSS}"][1:3] == ["30 2 * * *", "Europe/Paris"]
    assert shown[f"nightly {XSS}"][3] == "-"  # never ticked
    gone = shown[f"gone {XSS}"]
    assert (gone[1], gone[4], gone[5]) == ("-", "-", "no") and "Run now" not in gone[7]
    assert 'href="/tasks/schedules"' in page and 'href="/email_jobs/schedules"' not in page  # the nav
    assert client.get("/email_jobs/schedules").status_code == 404  # no watermark table, no schedules


def test_models_without_their_code_show_the_rows_only(engine: Engine) -> None:
    watermark(engine, "hourly", datetime(2026, 1, 1, tzinfo=UTC))
    app = create_app(engine, [Task, ReportJob])
    with app.test_client() as client:
        shown = rows(client.get("/tasks/schedules").get_data(as_text=True))
        assert shown["hourly"][5] == "unknown" and "Run now" not in shown["hourly"][7]
        assert client.get("/tasks/schedules/run?name=hourly").status_code == 404  # nothing to run it with
        assert "No schedule" in client.get("/report_jobs/schedules").get_data(as_text=True)
    with pytest.raises(ValueError, match="not one of the dashboard's models"):
        dashboard_blueprint(engine, [EmailJob], auth=None, schedules={Task: [HOURLY]})


def test_run_now_confirms_then_enqueues_one_job_fenced_by_the_watermark(engine: Engine, client: Any) -> None:
    last = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    watermark(engine, "hourly", last)
    confirm = client.get("/tasks/schedules/run?name=hourly")
    assert confirm.status_code == 200 and jobs(engine) == []  # the confirm page changes nothing
    fields = form(confirm.get_data(as_text=True), name="hourly")
    assert fields["seen"] == last.isoformat()
    clicked = datetime.now(UTC)
    response = client.post("/tasks/schedules/run", data=fields)
    assert response.status_code == 302 and response.headers["Location"].endswith("/tasks/schedules")
    (job,) = jobs(engine)
    assert (job.task, job.payload, job.queue) == ("report", {"kind": "hourly"}, "reports")
    assert clicked <= job.run_after <= datetime.now(UTC)
    after = schedule_state(engine, "hourly")
    assert (after.last_tick, after.previous_tick) == (job.run_after, last)
    assert f"job {job.id} enqueued" in client.get("/tasks/schedules").get_data(as_text=True)
    # The same form again (a second click): the watermark moved since it was read.
    client.post("/tasks/schedules/run", data=fields)
    assert len(jobs(engine)) == 1
    assert "ticked since the page was shown: nothing was enqueued" in client.get("/tasks/schedules").get_data(
        as_text=True)


def test_run_now_is_refused_when_the_scheduler_ticked_since_the_page(engine: Engine, client: Any) -> None:
    last = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
    watermark(engine, "hourly", last)
    fields = form(client.get("/tasks/schedules/run?name=hourly").get_data(as_text=True), name="hourly")
    watermark(engine, "hourly", last + timedelta(hours=1))  # a worker claims the next tick meanwhile
    client.post("/tasks/schedules/run", data=fields)
    assert jobs(engine) == [] and schedule_state(engine, "hourly").last_tick == last + timedelta(hours=1)


def test_pause_and_resume_from_the_page(engine: Engine, client: Any) -> None:
    watermark(engine, "hourly", datetime(2026, 1, 1, tzinfo=UTC))
    page = client.get("/tasks/schedules").get_data(as_text=True)
    response = client.post("/tasks/schedules/action", data={**form(page, name="hourly"), "action": "pause"})
    assert response.status_code == 302
    assert schedule_state(engine, "hourly").paused_at is not None
    page = client.get("/tasks/schedules").get_data(as_text=True)
    assert "paused schedule hourly" in page
    *_, next_tick, _, status, actions = rows(page)["hourly"]
    assert next_tick == "paused" and status.startswith("paused since") and "Resume" in actions
    # A schedule with no row yet is paused too: its row is made, paused.
    client.post("/tasks/schedules/action", data={**form(page, name=f"nightly {XSS}"), "action": "pause"})
    assert schedule_state(engine, f"nightly {XSS}").paused_at is not None
    flashed = client.get("/tasks/schedules").get_data(as_text=True)
    assert "<script>" not in flashed and "paused schedule nightly &lt;script&gt;" in flashed
    resumed_at = datetime.now(UTC)
    client.post("/tasks/schedules/action", data={**form(page, name="hourly"), "action": "resume"})
    after = schedule_state(engine, "hourly")
    assert after.paused_at is None and after.last_tick >= resumed_at  # the pause's ticks skipped
    client.post("/tasks/schedules/action", data={**form(page, name="hourly"), "action": "resume"})
    assert "schedule hourly was not paused" in client.get("/tasks/schedules").get_data(as_text=True)
    token = form(page, name="hourly")["csrf_token"]
    for data, code in (
        ({"action": "stop", "name": "hourly"}, 400),
        ({"action": "pause", "name": "nobody"}, 404),  # neither in the code nor a row
        ({"action": "pause", "name": ""}, 404),
    ):
        assert client.post("/tasks/schedules/action", data={**data, "csrf_token": token}).status_code == code
    assert schedule_state(engine, "nobody") is None


ACTIONS = [
    ("/tasks/schedules/run", {"name": "hourly", "seen": ""}),
    ("/tasks/schedules/action", {"name": "hourly", "action": "pause"}),
]


@pytest.mark.parametrize(("path", "data"), ACTIONS)
def test_every_action_needs_its_token_and_a_page_of_the_dashboard(
    engine: Engine, client: Any, path: str, data: dict[str, str]
) -> None:
    token = form(client.get("/tasks/schedules").get_data(as_text=True), name="hourly")["csrf_token"]
    for sent in (data, {**data, "csrf_token": "forged"}):
        response = client.post(path, data=sent)
        assert response.status_code == 400 and "CSRF" in response.get_data(as_text=True)
    for headers in ({"Origin": "http://evil.example"}, {"Host": "attacker.example", "Origin": "http://attacker.example"},
                    {"Origin": ""}):
        assert client.post(path, headers=headers, data={**data, "csrf_token": token}).status_code == 400, headers
    assert client.get("/tasks/schedules", headers={"Host": "attacker.example"}).status_code == 400
    assert jobs(engine) == [] and schedule_state(engine, "hourly") is None  # nothing ran, nothing paused
    assert client.post(path, data={**data, "csrf_token": token}).status_code == 302  # the real one passes


def test_read_only_mode_hides_and_refuses_every_schedule_action(engine: Engine) -> None:
    app = create_app(engine, [Task], read_only=True, schedules={Task: [HOURLY]})
    with client_of(app) as client:
        page = client.get("/tasks/schedules").get_data(as_text=True)
        assert "hourly" in page and "run-now" not in page and 'value="pause"' not in page
        assert client.get("/tasks/schedules/run?name=hourly").status_code == 403
        token = page_token(client.get("/tasks/jobs").get_data(as_text=True)) or ""
        for path, data in ACTIONS:
            sent = {**data, "csrf_token": token}
            assert client.post(path, data=sent).status_code == 403
    assert jobs(engine) == [] and schedule_state(engine, "hourly") is None


def test_a_page_whose_watermark_table_is_missing_says_so(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE tasks_schedules RENAME TO tasks_schedules_away")
    try:
        app = create_app(engine, [Task], schedules={Task: [HOURLY]})
        with app.test_client() as client:
            page = client.get("/tasks/schedules")
            assert page.status_code == 200 and "does not exist" in page.get_data(as_text=True)
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql("ALTER TABLE tasks_schedules_away RENAME TO tasks_schedules")


def test_a_run_whose_job_cannot_be_made_changes_nothing(engine: Engine) -> None:
    def broken(tick: datetime) -> dict[str, Any]:
        raise RuntimeError(f"no report for {XSS}")

    app = create_app(engine, [Task], schedules={Task: [Schedule("broken", every=60, values=broken)]})
    with client_of(app) as client:
        watermark(engine, "broken", datetime(2026, 1, 1, tzinfo=UTC))
        fields = form(client.get("/tasks/schedules/run?name=broken").get_data(as_text=True), name="broken")
        assert client.post("/tasks/schedules/run", data=fields).status_code == 302
        page = client.get("/tasks/schedules").get_data(as_text=True)
    assert "its job could not be enqueued, nothing changed: RuntimeError: no report for &lt;script&gt;" in page
    assert jobs(engine) == [] and schedule_state(engine, "broken").last_tick == datetime(2026, 1, 1, tzinfo=UTC)


def test_flask_queue_s_dashboard_knows_the_schedules_of_its_workers(engine: Engine) -> None:
    """``queue.dashboard()`` takes each registration's schedules: its registry's and its
    ``schedules=`` option's."""
    from types import SimpleNamespace

    from sqla_queue import Tasks
    from sqla_queue.flask import FlaskQueue

    tasks = Tasks()
    tasks.periodic(every=60, name="digest")(lambda job: None)
    queue = FlaskQueue(db=SimpleNamespace(engine=engine))
    queue.add_worker(Task, tasks)
    queue.add_worker(Task, lambda job: None, name="reports", schedules=[HOURLY])
    app = Flask(__name__)
    app.secret_key = "test"
    app.register_blueprint(queue.dashboard(auth=None))
    with app.test_client() as client:
        shown = rows(client.get("/tasks/schedules").get_data(as_text=True))
    assert {name: cells[5] for name, cells in shown.items()} == {"digest": "yes", "hourly": "yes"}
