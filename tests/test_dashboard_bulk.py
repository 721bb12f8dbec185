"""The dashboard's bulk actions by filter through Flask's test client, against real
PostgreSQL: the count first, the filter respected on every page, statements bounded,
cancel's and delete's rules kept, and every protection (CSRF token, read-only mode,
Host and Origin)."""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, event, func, insert, select

pytest.importorskip("flask")

from markupsafe import escape

from sqla_queue.admin import JobFilters
from sqla_queue.bulk_actions import count_matching, run_bulk
from sqla_queue.control import Cancel, parse
from sqla_queue.dashboard import create_app
from sqla_queue.model import notify_channel

from .dashboard_helpers import XSS, add, add_rows, client_of, dashboard_app, page_token, statuses
from .helpers import table_of
from .models import EmailJob, OnceJob, ResultTask, Task

JOBS = table_of(EmailJob)
TASKS = table_of(Task)
ONCE = table_of(OnceJob)


@pytest.fixture
def client(engine: Engine) -> Iterator[Any]:
    with client_of(dashboard_app(engine, [EmailJob, Task, OnceJob], page_size=3)) as client:
        yield client


def count(engine: Engine, table: Any) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(table)) or 0)


def bulk_form(page: str) -> dict[str, str]:
    """The jobs page's form of the actions by filter: its fields."""
    match = re.search(r'<form method="get" action="([^"]+)" class="actions" id="bulk-actions">(.*?)</form>', page, re.S)
    assert match, "no bulk form on the page"
    return {n: html.unescape(v) for n, v in re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">',
                                                       match.group(2))}


def confirm(client: Any, table: str, action: str, fields: dict[str, str]) -> tuple[str, dict[str, str]]:
    """The confirm page of ``action`` with the filter ``fields``, and its POST's fields."""
    response = client.get(f"/{table}/bulk", query_string={**fields, "action": action})
    assert response.status_code == 200, response.get_data(as_text=True)[:300]
    page = response.get_data(as_text=True)
    posted = re.search(r'<form method="post" action="[^"]+/bulk" class="actions">(.*?)</form>', page, re.S)
    assert posted
    return page, {n: html.unescape(v) for n, v in re.findall(
        r'<input type="hidden" name="([^"]+)" value="([^"]*)">', posted.group(1))}


def counted(page: str) -> tuple[int, int]:
    matched = re.search(r'data-matched="(\d+)"', page)
    acting = re.search(r'data-acting="(\d+)"', page)
    assert matched and acting
    return int(matched.group(1)), int(acting.group(1))


def test_cancel_by_filter_counts_first_then_cancels_every_page_running_jobs_too(
    engine: Engine, client: Any, listener: psycopg.Connection[tuple[object, ...]]
) -> None:
    pending = add_rows(engine, JOBS, 5, queue="mail")
    running = add_rows(engine, JOBS, 2, queue="mail", status="running", lease_owner="w:1:a/0", attempts=1,
                  lease_expires_at=func.now() + timedelta(seconds=60))
    done = add_rows(engine, JOBS, queue="mail", status="done", finished_at=func.now())
    other = add_rows(engine, JOBS, 2, queue="sms")
    page = client.get("/email_jobs/jobs?queue=mail").get_data(as_text=True)
    assert len(re.findall(r"<tr data-id=", page)) == 3  # one page of three; the action takes them all
    fields = bulk_form(page)
    assert fields == {"queue": "mail", "status": "", "error": ""}
    shown, posted = confirm(client, "email_jobs", "cancel", fields)
    assert counted(shown) == (8, 7) and "on every page" in shown
    assert statuses(engine, JOBS, pending + running) == ["pending"] * 5 + ["running"] * 2  # counting changed nothing
    late = add_rows(engine, JOBS, queue="mail")  # enqueued after the count: not chased
    listener.execute(f'LISTEN "{notify_channel(JOBS)}"')
    response = client.post("/email_jobs/bulk", data=posted)
    assert response.status_code == 302 and response.headers["Location"].endswith("/email_jobs/jobs?queue=mail")
    assert statuses(engine, JOBS, pending + running) == ["cancelled"] * 7
    assert statuses(engine, JOBS, done + other + late) == ["done", "pending", "pending", "pending"]
    told = [parse(n.payload) for n in listener.notifies(timeout=5, stop_after=1)]
    assert told == [Cancel(frozenset(map(str, running)))]  # their workers are told, as cancel() tells them
    flashed = client.get("/email_jobs/jobs?queue=mail").get_data(as_text=True)
    assert "cancelled 7 job(s) matching the filter, in 1 statement(s)" in flashed


def test_requeue_by_filter_takes_the_dead_letters_the_filter_matches(engine: Engine, client: Any) -> None:
    smtp = add_rows(engine, JOBS, 4, queue="mail", status="failed", attempts=20, last_error="SMTPError 550")
    dns = add_rows(engine, JOBS, queue="mail", status="failed", attempts=20, last_error="DNS failure")
    pending = add_rows(engine, JOBS, queue="mail", last_error="SMTPError earlier")
    elsewhere = add_rows(engine, JOBS, queue="sms", status="failed", last_error="SMTPError")
    fields = bulk_form(client.get("/email_jobs/jobs?queue=mail&status=failed,pending&error=smtp").get_data(
        as_text=True))
    assert fields == {"queue": "mail", "status": "failed,pending", "error": "smtp"}
    shown, posted = confirm(client, "email_jobs", "requeue", fields)
    assert counted(shown) == (5, 4)  # the pending one matches; only dead letters are requeued
    client.post("/email_jobs/bulk", data=posted)
    with engine.connect() as conn:
        moved = conn.execute(select(JOBS.c.status, JOBS.c.attempts).where(JOBS.c.id.in_(smtp))).all()
    assert set(moved) == {("pending", 0)}
    assert statuses(engine, JOBS, dns + pending + elsewhere) == ["failed", "pending", "failed"]
    tasks = add_rows(engine, TASKS, 2, task="crop", status="failed")
    kept = add_rows(engine, TASKS, task="send", status="failed")
    _, posted = confirm(client, "tasks", "requeue", {"task": "crop,resize", "queue": "", "status": "", "error": ""})
    client.post("/tasks/bulk", data=posted)
    assert statuses(engine, TASKS, tasks + kept) == ["pending", "pending", "failed"]


def test_delete_by_filter_keeps_key_holders_until_a_second_confirm(engine: Engine, client: Any) -> None:
    held = add_rows(engine, ONCE, queue="q", status="done", unique_key="invoice:1", finished_at=func.now())
    held += add_rows(engine, ONCE, queue="q", status="done", unique_key="invoice:2", finished_at=func.now())
    keyless = add_rows(engine, ONCE, queue="q", status="done", finished_at=func.now())
    pending = add_rows(engine, ONCE, queue="q")
    running = add_rows(engine, ONCE, queue="q", status="running", lease_owner="w:1:a/0", attempts=1)
    shown, posted = confirm(client, "once_jobs", "delete", {"queue": "q", "status": "", "error": ""})
    assert counted(shown) == (5, 2) and 'data-holding="2"' in shown
    response = client.post("/once_jobs/bulk", data=posted)
    page = response.get_data(as_text=True)
    assert response.status_code == 200 and "Free unique keys?" in page and "2 of the jobs matching" in page
    assert statuses(engine, ONCE, held + keyless + pending + running) == ["done", "done", None, None, "running"]
    again = re.search(r'<form method="post" action="[^"]+/bulk" class="actions">(.*?)</form>', page, re.S)
    assert again
    fields = {n: html.unescape(v) for n, v in re.findall(r'name="([^"]+)" value="([^"]*)"', again.group(1))}
    assert fields["free_keys"] == "1" and fields["as_of"] == posted["as_of"]
    assert client.post("/once_jobs/bulk", data=fields).status_code == 302
    assert statuses(engine, ONCE, held + running) == [None, None, "running"]  # running jobs are never deleted


def test_a_bulk_action_runs_in_statements_of_at_most_a_thousand_rows(engine: Engine, client: Any) -> None:
    with engine.begin() as conn:
        conn.execute(insert(JOBS), [{"queue": "bulk"}] * 2500)
        conn.execute(insert(JOBS), [{"queue": "keep"}] * 10)
    _, posted = confirm(client, "email_jobs", "delete", {"queue": "bulk", "status": "pending", "error": ""})
    moved: list[int] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.startswith("DELETE FROM email_jobs"):
            moved.append(cursor.rowcount)

    event.listen(engine, "after_cursor_execute", record)
    try:
        client.post("/email_jobs/bulk", data=posted)
    finally:
        event.remove(engine, "after_cursor_execute", record)
    assert moved == [1000, 1000, 500]  # three statements, each bounded, the last short
    assert count(engine, JOBS) == 10
    assert "deleted 2500 job(s) matching the filter, in 3 statement(s) of at most 1000 rows" in client.get(
        "/email_jobs/jobs").get_data(as_text=True)


def test_the_filter_is_shown_escaped_and_an_empty_one_says_every_job(engine: Engine, client: Any) -> None:
    add_rows(engine, JOBS, queue=XSS)
    shown, _ = confirm(client, "email_jobs", "delete", {"queue": XSS, "status": "", "error": XSS})
    assert "<script>" not in shown and str(escape(XSS)) in shown
    shown, _ = confirm(client, "email_jobs", "cancel", {"queue": "", "status": "", "error": ""})
    assert "every job of the table" in shown and counted(shown) == (1, 1)
    shown, _ = confirm(client, "email_jobs", "requeue", {"queue": "", "status": "", "error": ""})
    assert counted(shown) == (1, 0) and 'id="bulk-nothing"' in shown and 'id="bulk-confirm"' not in shown


def test_a_bulk_action_needs_its_token_and_a_page_of_the_dashboard(engine: Engine, client: Any) -> None:
    keys = add_rows(engine, JOBS, 3, queue="mail")
    _, posted = confirm(client, "email_jobs", "cancel", {"queue": "mail", "status": "", "error": ""})
    for data in ({k: v for k, v in posted.items() if k != "csrf_token"}, {**posted, "csrf_token": "forged"}):
        response = client.post("/email_jobs/bulk", data=data)
        assert response.status_code == 400 and "CSRF" in response.get_data(as_text=True)
    for headers in ({"Origin": "http://evil.example"}, {"Host": "attacker.example", "Origin": "http://attacker.example"},
                    {"Origin": "", "Referer": "http://evil.example/"}):
        assert client.post("/email_jobs/bulk", headers=headers, data=posted).status_code == 400, headers
    assert client.get("/email_jobs/bulk?action=cancel", headers={"Host": "attacker.example"}).status_code == 400
    for changed, status in (
        ({"status": "pending,bogus"}, 400),  # an unknown status never widens the filter
        ({"action": "drop"}, 400),
        ({"as_of": ""}, 400),
        ({"as_of": "2026-01-01 00:00:00"}, 400),  # no zone
        ({"task": "crop"}, 400),  # no task column here
    ):
        assert client.post("/email_jobs/bulk", data={**posted, **changed}).status_code == status, changed
    assert client.get("/email_jobs/bulk?action=cancel&status=bogus").status_code == 400
    assert statuses(engine, JOBS, keys) == ["pending"] * 3
    assert client.get("/email_jobs/bulk").status_code == 400  # no action
    assert client.post("/email_jobs/bulk", data=posted).status_code == 302  # the real one passes
    assert statuses(engine, JOBS, keys) == ["cancelled"] * 3


def test_read_only_mode_hides_and_refuses_the_bulk_actions(engine: Engine) -> None:
    keys = add_rows(engine, JOBS, 2, queue="mail")
    with client_of(create_app(engine, [EmailJob])) as client:
        _, posted = confirm(client, "email_jobs", "delete", {"queue": "mail", "status": "", "error": ""})
    with client_of(create_app(engine, [EmailJob], read_only=True)) as client:
        page = client.get("/email_jobs/jobs?queue=mail").get_data(as_text=True)
        assert 'id="bulk-actions"' not in page
        assert client.get("/email_jobs/bulk?action=delete&queue=mail").status_code == 403
        token = page_token(page) or ""
        assert client.post("/email_jobs/bulk", data={**posted, "csrf_token": token}).status_code == 403
    assert statuses(engine, JOBS, keys) == ["pending", "pending"]


def test_a_walk_takes_every_matching_job_in_batches_on_a_table_that_keeps_results(engine: Engine) -> None:
    """The cancel of a table that keeps results and history, five jobs in batches of
    two: three statements, the running job's attempt ended in its history."""
    results = table_of(ResultTask)
    pending = add_rows(engine, results, 4, task="t")
    running = add_rows(engine, results, task="t", status="running", lease_owner="w:1:a/0", attempts=1,
                  started_at=func.now())
    add_rows(engine, results, task="other")
    filters = JobFilters(tasks=("t",))
    counted = count_matching(engine, ResultTask, "cancel", filters)
    assert (counted.matched, counted.acting, counted.holding_keys) == (5, 5, 0)
    sizes: list[int] = []
    done = run_bulk(engine, ResultTask, "cancel", filters, created_before=counted.as_of, batch=2,
                    on_batch=sizes.append)
    assert sizes == [2, 2, 1] and (done.done, done.batches) == (5, 3)
    assert statuses(engine, results, pending + running) == ["cancelled"] * 5
    with engine.connect() as conn:
        history = conn.scalar(select(results.c.history).where(results.c.id == running[0]))
    assert history is not None and [entry["outcome"] for entry in history] == ["cancelled"]
    with pytest.raises(ValueError, match="unknown bulk action"):
        run_bulk(engine, ResultTask, "drop", filters, created_before=counted.as_of)


def test_a_requeue_walk_keeps_the_unique_keys_as_requeue_failed_does(engine: Engine) -> None:
    """Dead letters of one key: only the newest moves (the older ones then held by it);
    a dead letter whose key a done job holds (UNIQUE_EVER) stays. In batches of two, the
    walk goes on past a batch that moved fewer than it picked, and ends at one that
    moves none."""
    once = [add(engine, ONCE, queue="q", status="failed", unique_key=key) for key in ("k1", "k2", "k1", "k3")]
    add_rows(engine, ONCE, queue="q", status="done", unique_key="k3")  # holds k3
    newest = add_rows(engine, ONCE, queue="q", status="failed", unique_key="k1")
    sizes: list[int] = []
    counted = count_matching(engine, OnceJob, "requeue", JobFilters(queues=("q",)))
    result = run_bulk(engine, OnceJob, "requeue", JobFilters(queues=("q",)), created_before=counted.as_of, batch=2,
                      on_batch=sizes.append)
    assert statuses(engine, ONCE, once + newest) == ["failed", "pending", "failed", "failed", "pending"]
    assert sizes == [1, 1, 0] and result.done == 2
