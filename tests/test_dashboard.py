"""The web dashboard through Flask's test client, against real PostgreSQL: every page,
every action, CSRF, read-only mode, auth, escaping and truncation."""

from __future__ import annotations

import html
import re
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, insert, select, text, update
from sqlalchemy.orm import Session

pytest.importorskip("flask")

from flask import Flask, redirect, request
from markupsafe import escape

from sqla_queue import Tasks, cancel, current_job
from sqla_queue.dashboard import create_app, dashboard_blueprint

from .dashboard_helpers import XSS, add, check_one_and_several_values, client_of, dashboard_app, page_token, status_of
from .helpers import table_of, wait_for
from .models import EmailJob, Order, ResultTask, Task, UuidJob

JOBS = table_of(EmailJob)
TASKS = table_of(Task)


@pytest.fixture
def client(engine: Engine) -> Iterator[Any]:
    with client_of(dashboard_app(engine, [EmailJob, Task], lease=60.0, page_size=3)) as client:
        yield client


def csrf(client: Any, path: str = "/email_jobs/jobs") -> str:
    """The CSRF token of the forms on ``path``, which must have one."""
    page = client.get(path).get_data(as_text=True)
    token = page_token(page)
    assert token, page
    return token


def ids_on(page: str) -> list[int]:
    return [int(x) for x in re.findall(r'<tr data-id="(\d+)">', page)]


def test_overview_counts_ages_and_the_last_hours_chart(engine: Engine, client: Any) -> None:
    with engine.begin() as conn:
        conn.execute(insert(JOBS), [{"queue": "mail"}] * 2)
        conn.execute(insert(JOBS).values(queue="mail", run_after=func.now() - timedelta(minutes=5)))
        conn.execute(insert(JOBS).values(queue="mail", status="done", finished_at=func.now()), [{}] * 4)
        conn.execute(insert(JOBS).values(queue="mail", status="failed", finished_at=func.now() - timedelta(minutes=30)))
        conn.execute(insert(JOBS).values(queue="sms", status="done", finished_at=func.now() - timedelta(hours=2)))
        conn.execute(insert(TASKS).values(task="resize", queue="images"))
    page = client.get("/").get_data(as_text=True)
    mail = page[page.index('data-queue="mail"'):]
    mail = mail[:mail.index("</section>")]
    assert re.search(r"pending<b><a [^>]*>3</a>", mail)
    assert re.search(r"done<b><a [^>]*>4</a>", mail)
    assert re.search(r"failed<b><a [^>]*>1</a>", mail)
    assert "oldest runnable<b>5.0m</b>" in mail
    assert "4 done" in mail and "1 failed" in mail  # the last hour's totals over the chart
    assert mail.count('class="done"') == 1 and mail.count('class="failed"') == 1  # one bar each
    assert len(re.findall(r"\d\d:\d\d UTC: 0 done, 1 failed", mail)) == 1  # the minute it failed
    assert 'data-queue="sms"' not in page  # nothing pending nor running, finished two hours ago
    assert 'data-queue="images"' in page and "tasks" in page
    day = client.get("/?window=24h").get_data(as_text=True)
    sms = day[day.index('data-queue="sms"'):]
    assert "1 done" in sms.split("</section>")[0]  # in the last 24 hours


def test_jobs_filters_one_and_several_values(engine: Engine, client: Any) -> None:
    def shown(query: str, table: str = "email_jobs") -> list[int]:
        response = client.get(f"/{table}/jobs?{query}")
        assert response.status_code == 200
        return ids_on(response.get_data(as_text=True))

    check_one_and_several_values(engine, shown)


def test_jobs_pages_by_key(engine: Engine, client: Any) -> None:
    keys = [add(engine, JOBS, queue="q", status="failed") for _ in range(7)]
    add(engine, JOBS, queue="other", status="failed")
    seen: list[int] = []
    url: str | None = "/email_jobs/jobs?queue=q"
    pages = 0
    while url:
        page = client.get(url).get_data(as_text=True)
        seen += ids_on(page)
        pages += 1
        match = re.search(r'<a href="([^"]+)" id="next-page">', page)
        url = html.unescape(match.group(1)) if match else None
        if url:
            assert "queue=q" in url  # the filters carry over
    assert pages == 3 and seen == sorted(keys, reverse=True)


def test_dead_letters_page_shows_only_failed_jobs(engine: Engine, client: Any) -> None:
    add(engine, JOBS, queue="q")
    dead = add(engine, JOBS, queue="q", status="failed", last_error="boom")
    page = client.get("/email_jobs/dead?status=pending").get_data(as_text=True)
    assert ids_on(page) == [dead] and "Dead letters" in page


def test_job_detail_shows_every_column_escaped(engine: Engine, client: Any) -> None:
    with engine.begin() as conn:
        conn.execute(insert(table_of(Order)).values(id=7, customer="ann"))
    error = "Traceback (most recent call last):\n  File x\n" + XSS + "\nValueError: " + "e" * 5000
    key = add(engine, JOBS, queue="q", status="failed", order_id=7, recipient=XSS, attempts=3, last_error=error,
              lease_owner="host:1:abcd/0")
    response = client.get(f"/email_jobs/job/{key}")
    page = response.get_data(as_text=True)
    assert response.status_code == 200
    for column in JOBS.c:
        assert f"<dt>{column.name}</dt>" in page or column.name == "last_error"
    assert "<h2>last_error</h2>" in page
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert str(escape(error)) in page  # the whole error, unabridged
    assert "Attempt 3 of 20" in page and "host:1:abcd/0" in page
    assert "script-src" not in response.headers["Content-Security-Policy"]  # default-src 'none': no script runs
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    assert client.get("/email_jobs/job/999999").status_code == 404
    assert client.get("/email_jobs/job/not-a-number").status_code == 404
    assert client.get("/nope/jobs").status_code == 404


def test_payloads_are_escaped_and_large_ones_truncated(engine: Engine, client: Any) -> None:
    big = {"html": XSS, "blob": "z" * 10_000}
    key = add(engine, TASKS, task="render", payload=big, last_error=XSS)
    listing = client.get("/tasks/jobs").get_data(as_text=True)
    assert "<script>" not in listing and "&lt;script&gt;" in listing
    page = client.get(f"/tasks/job/{key}").get_data(as_text=True)
    assert "<script>" not in page
    assert "z" * 10_000 not in page and "z" * 1000 in page
    match = re.search(r'<a href="([^"]+)" class="full-value">full value \((\d+) characters\)', page)
    assert match
    raw = client.get(html.unescape(match.group(1)))
    assert raw.mimetype == "text/plain" and raw.headers["X-Content-Type-Options"] == "nosniff"
    assert raw.get_data(as_text=True).count("z") == 10_000 and XSS in raw.get_data(as_text=True)
    assert int(match.group(2)) == len(raw.get_data(as_text=True))
    assert client.get(f"/tasks/job/{key}/raw/no_such_column").status_code == 404


def test_actions_run_the_fenced_statements(engine: Engine, client: Any) -> None:
    dead = [add(engine, JOBS, status="failed", attempts=20, last_error="x") for _ in range(2)]
    pending = [add(engine, JOBS) for _ in range(2)]
    running = add(engine, JOBS, status="running", lease_owner="w/0", attempts=1)
    token = csrf(client)

    def act(action: str, *keys: int) -> str:
        response = client.post(
            "/email_jobs/action",
            data={"csrf_token": token, "action": action, "id": [str(k) for k in keys], "next": "/email_jobs/dead"},
        )
        assert response.status_code == 302 and response.headers["Location"].endswith("/email_jobs/dead")
        return str(client.get("/email_jobs/dead").get_data(as_text=True))

    page = act("requeue", *dead, pending[0], running)  # a selection: only the dead letters move
    assert "requeued 2 of 4 job(s)" in page
    with engine.connect() as conn:
        rows = conn.execute(select(JOBS.c.id, JOBS.c.status, JOBS.c.attempts).where(JOBS.c.id.in_(dead))).all()
    assert {(r.status, r.attempts) for r in rows} == {("pending", 0)}
    assert "cancelled 2 of 2 job(s)" in act("cancel", pending[0], running)  # a pending job, and a running one
    assert status_of(engine, JOBS, pending[0]) == "cancelled" and status_of(engine, JOBS, running) == "cancelled"
    assert "cancelled 0 of 1 job(s)" in act("cancel", running)  # finished now: nothing to cancel
    still = add(engine, JOBS, status="running", lease_owner="w/0", attempts=1)
    assert "deleted 3 of 4 job(s)" in act("delete", pending[0], pending[1], running, still)
    assert status_of(engine, JOBS, pending[1]) is None and status_of(engine, JOBS, still) == "running"
    assert "select at least one job" in act("requeue")


def test_actions_need_the_csrf_token(engine: Engine, client: Any) -> None:
    key = add(engine, JOBS, status="failed")
    csrf(client)  # the session has a token; the forged request does not carry it
    for data in ({"action": "requeue", "id": str(key)}, {"action": "requeue", "id": str(key), "csrf_token": "x"}):
        response = client.post("/email_jobs/action", data=data)
        assert response.status_code == 400 and "CSRF" in response.get_data(as_text=True)
    assert status_of(engine, JOBS, key) == "failed"
    assert client.get("/email_jobs/action").status_code == 405  # actions are POSTs only
    token = csrf(client)
    assert client.post("/email_jobs/action", data={"csrf_token": token, "action": "drop", "id": "1"}).status_code == 400


def test_an_action_returns_only_to_the_dashboards_own_pages(engine: Engine, client: Any) -> None:
    key = add(engine, JOBS, status="failed")
    token = csrf(client)
    for target in ("https://evil.example/", "//evil.example/x"):
        response = client.post(
            "/email_jobs/action", data={"csrf_token": token, "action": "requeue", "id": str(key), "next": target}
        )
        assert response.headers["Location"].endswith("/email_jobs/jobs")


def test_read_only_mode_hides_and_refuses_actions(engine: Engine) -> None:
    key = add(engine, JOBS, status="failed")
    with client_of(create_app(engine, [EmailJob], read_only=True)) as client:
        page = client.get("/email_jobs/jobs").get_data(as_text=True)
        assert ids_on(page) == [key]
        assert 'value="requeue"' not in page and 'type="checkbox" name="id"' not in page
        assert 'value="requeue"' not in client.get(f"/email_jobs/job/{key}").get_data(as_text=True)
        response = client.post(
            "/email_jobs/action", data={"csrf_token": page_token(page) or "", "action": "requeue", "id": str(key)}
        )
        assert response.status_code == 403
    assert status_of(engine, JOBS, key) == "failed"


def test_workers_page_lists_lease_owners_with_their_last_heartbeat(engine: Engine, client: Any) -> None:
    with engine.begin() as conn:
        conn.execute(insert(JOBS).values(status="running", lease_owner="h:1:aa/0"), [{}] * 2)
        conn.execute(insert(JOBS).values(status="running", lease_owner="h:1:aa/1"))
        conn.execute(insert(JOBS).values(status="running", lease_owner="h:2:bb/0"))
        conn.execute(update(JOBS).where(JOBS.c.lease_owner.like("h:1:%"))
                     .values(lease_expires_at=func.now() + timedelta(seconds=50)))
        conn.execute(update(JOBS).where(JOBS.c.lease_owner == "h:2:bb/0")
                     .values(lease_expires_at=func.now() - timedelta(seconds=5)))
        heartbeat = conn.scalar(select(func.max(JOBS.c.lease_expires_at) - timedelta(seconds=60)))
    page = client.get("/email_jobs/workers").get_data(as_text=True)
    page = page[page.index('id="running"'):]
    rows = re.findall(r"<tr>\s*(.*?)</tr>", page, re.S)
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", row, re.S) for row in rows if "<td" in row]
    assert [c[0] for c in cells] == ["h:1:aa", "h:2:bb"]
    assert [c[1] for c in cells] == ["2", "1"]  # executors
    assert [re.sub("<[^>]+>", "", c[2]) for c in cells] == ["3", "1"]  # held jobs
    assert heartbeat is not None and heartbeat.isoformat(sep=" ", timespec="seconds") in cells[0][3]
    assert "expired" in cells[1][5] and "expired" not in cells[0][5]


def test_auth_callable_guards_every_page(engine: Engine) -> None:
    allowed: dict[str, Any] = {"verdict": False}
    app = Flask(__name__)
    app.secret_key = "test"
    app.register_blueprint(
        dashboard_blueprint(engine, [EmailJob], auth=lambda: allowed["verdict"]), url_prefix="/admin/queue"
    )
    with client_of(app) as client:
        for path in ("/admin/queue/", "/admin/queue/email_jobs/jobs", "/admin/queue/email_jobs/workers"):
            assert client.get(path).status_code == 403
        assert client.post("/admin/queue/email_jobs/action", data={}).status_code == 403
        allowed["verdict"] = redirect("/login")
        assert client.get("/admin/queue/").headers["Location"] == "/login"
        allowed["verdict"] = True
        page = client.get("/admin/queue/")
        assert page.status_code == 200 and 'href="/admin/queue/email_jobs/jobs"' in page.get_data(as_text=True)


def test_a_mounted_dashboard_needs_a_secret_key(engine: Engine) -> None:
    app = Flask(__name__)
    app.testing = True  # the error reaches the test, not a 500 page
    app.register_blueprint(dashboard_blueprint(engine, [EmailJob], auth=None))
    with app.test_client() as client, pytest.raises(RuntimeError, match="secret_key"):
        client.get("/")


def test_bad_arguments_are_refused_when_the_blueprint_is_made(engine: Engine) -> None:
    with pytest.raises(ValueError, match="at least one queue model"):
        dashboard_blueprint(engine, [], auth=None)
    with pytest.raises(ValueError, match="given twice"):
        dashboard_blueprint(engine, [EmailJob, EmailJob], auth=None)
    with pytest.raises(TypeError):
        dashboard_blueprint(engine, [EmailJob])  # type: ignore[call-arg]  # auth= must be said


def test_requeue_every_dead_letter_matching_the_filter(engine: Engine, client: Any) -> None:
    smtp = [add(engine, JOBS, queue="mail", status="failed", last_error=f"SMTPError {i}") for i in range(5)]
    dns = add(engine, JOBS, queue="mail", status="failed", last_error="DNS")
    other_queue = add(engine, JOBS, queue="sms", status="failed", last_error="SMTPError")
    page = client.get("/email_jobs/dead?queue=mail&error=smtp").get_data(as_text=True)
    assert 'value="requeue_matching"' in page and len(ids_on(page)) == 3  # a page of 3; the action takes all
    form = dict(re.findall(r'<input type="hidden" name="(queue|task|error)" value="([^"]*)">', page))
    assert form == {"queue": "mail", "task": "", "error": "smtp"}
    response = client.post("/email_jobs/action", data={"csrf_token": csrf(client), "action": "requeue_matching",
                                                       **form})
    assert response.status_code == 302
    assert all(status_of(engine, JOBS, key) == "pending" for key in smtp)
    assert status_of(engine, JOBS, dns) == "failed" and status_of(engine, JOBS, other_queue) == "failed"
    assert "requeued 5 dead-lettered job(s) matching the filter" in client.get("/email_jobs/dead").get_data(
        as_text=True)
    task = add(engine, TASKS, task="crop", status="failed")
    keep = add(engine, TASKS, task="send", status="failed")
    client.post("/tasks/action", data={"csrf_token": csrf(client), "action": "requeue_matching", "task": "crop,x"})
    assert status_of(engine, TASKS, task) == "pending" and status_of(engine, TASKS, keep) == "failed"


def count_of(engine: Engine, table: Any) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(table)) or 0)


def test_a_page_under_a_foreign_host_name_is_refused(engine: Engine, client: Any) -> None:
    """DNS rebinding: a page of attacker.example, its name now pointing at 127.0.0.1,
    reads the dashboard and posts to it with the token it read. Nothing is served,
    nothing changes."""
    keys = [add(engine, TASKS, task="pay", payload={"card": "4111111111111111"}) for _ in range(3)]
    forged = {"Host": "attacker.example", "Origin": "http://attacker.example"}
    for path in ("/", "/tasks/jobs", f"/tasks/job/{keys[0]}", f"/tasks/job/{keys[0]}/raw/payload", "/tasks/workers"):
        response = client.get(path, headers=forged)
        assert response.status_code == 400, path
        assert "4111" not in response.get_data(as_text=True) and "csrf_token" not in response.get_data(as_text=True)
    token = csrf(client, "/tasks/jobs")  # even with a token read under the right name
    response = client.post("/tasks/action", headers=forged,
                           data={"csrf_token": token, "action": "delete", "id": [str(k) for k in keys]})
    assert response.status_code == 400
    assert count_of(engine, TASKS) == 3
    for host in ("localhost", "LOCALHOST:8787", "127.0.0.1:8787", "[::1]:8787"):  # this machine's names pass
        assert client.get("/tasks/jobs", headers={"Host": host}).status_code == 200, host


def test_a_post_from_another_origin_is_refused(engine: Engine, client: Any) -> None:
    keys = [add(engine, JOBS, status="failed") for _ in range(3)]
    token = csrf(client)
    data = {"csrf_token": token, "action": "delete", "id": [str(k) for k in keys]}
    for headers in (
        {"Origin": "http://evil.example"},
        {"Origin": "null"},  # a sandboxed frame, a data: page
        {"Origin": "http://localhost:9999"},  # another server of this machine
        {"Origin": "", "Referer": "http://evil.example/page"},
        {"Origin": ""},  # neither header: not sent by a page of the dashboard
    ):
        response = client.post("/email_jobs/action", headers=headers, data=data)
        assert response.status_code == 400, headers
        assert "did not come from a page of the dashboard" in response.get_data(as_text=True)
    assert count_of(engine, JOBS) == 3
    response = client.post("/email_jobs/action", headers={"Origin": "", "Referer": "http://localhost/email_jobs/jobs"},
                           data=data)
    assert response.status_code == 302 and count_of(engine, JOBS) == 0  # a browser that sends only Referer


def test_a_mounted_dashboard_checks_the_hosts_it_is_given_before_auth(engine: Engine) -> None:
    calls: list[str] = []

    def auth() -> bool:
        calls.append(request.host)
        return True

    app = Flask(__name__)
    app.secret_key = "test"
    app.register_blueprint(
        dashboard_blueprint(engine, [EmailJob], auth=auth, trusted_hosts=[".example.com"]), url_prefix="/queue"
    )
    with app.test_client() as client:
        assert client.get("/queue/", headers={"Host": "evil.example"}).status_code == 400
        assert client.get("/queue/", headers={"Host": "example.com.evil.example"}).status_code == 400
        assert calls == []  # refused before auth ran
        assert client.get("/queue/", headers={"Host": "ops.example.com"}).status_code == 200
        assert client.get("/queue/", headers={"Host": "example.com"}).status_code == 200
    with pytest.raises(ValueError, match="not a host name"):
        dashboard_blueprint(engine, [EmailJob], auth=None, trusted_hosts=["a/b"])
    with pytest.raises(ValueError, match="list of names"):
        dashboard_blueprint(engine, [EmailJob], auth=None, trusted_hosts="localhost")


BIG = "99999999999999999999"


@pytest.mark.parametrize(
    ("method", "path", "data", "status"),
    [
        ("GET", f"/email_jobs/job/{BIG}", None, 404),
        ("GET", f"/email_jobs/job/-{BIG}", None, 404),
        ("GET", "/email_jobs/job/9223372036854775808", None, 404),  # bigint's largest plus one
        ("GET", "/email_jobs/job/-9223372036854775809", None, 404),
        ("GET", f"/email_jobs/job/{BIG}/raw/payload", None, 404),
        ("GET", f"/email_jobs/jobs?before={BIG}", None, 404),
        ("GET", f"/email_jobs/dead?before=-{BIG}", None, 404),
        ("GET", "/email_jobs/jobs?queue=a%00b", None, 400),
        ("GET", "/email_jobs/jobs?error=%00", None, 400),
        ("GET", "/email_jobs/jobs?queue=a&queue=%00", None, 400),  # a repeated argument, not only the first
        ("GET", "/email_jobs/dead?queue=x%00", None, 400),
        ("GET", "/tasks/jobs?task=%00", None, 400),
        ("GET", "/email_jobs/job/1%00", None, 400),
        ("GET", "/uuid_jobs/job/%00", None, 400),
        ("POST", "/email_jobs/action", {"action": "delete", "id": BIG}, 404),
        ("POST", "/email_jobs/action", {"action": "requeue", "id": ["1", f"-{BIG}"]}, 404),
        ("POST", "/email_jobs/action", {"action": "requeue_matching", "error": "\x00"}, 400),
        ("POST", "/email_jobs/action", {"action": "requeue_matching", "queue": "q\x00"}, 400),
        ("POST", "/tasks/action", {"action": "requeue_matching", "task": "\x00"}, 400),
        ("POST", "/email_jobs/action", {"action": "cancel", "id": "1", "next\x00": "x"}, 400),
    ],
)
def test_hostile_input_is_a_400_or_404_and_changes_nothing(
    engine: Engine, method: str, path: str, data: dict[str, Any] | None, status: int
) -> None:
    app = create_app(engine, [EmailJob, Task, UuidJob])  # not testing: a failure is the 500 a browser would see
    key = add(engine, JOBS, status="failed", last_error="x")
    task = add(engine, TASKS, task="t", status="failed")
    with client_of(app) as client:
        if method == "GET":
            response = client.get(path)
        else:
            assert data is not None
            response = client.post(path, data={**data, "csrf_token": csrf(client)})
    assert response.status_code == status, response.get_data(as_text=True)[:300]
    assert status_of(engine, JOBS, key) == "failed" and status_of(engine, TASKS, task) == "failed"


def _page_cost(client: Any, path: str, runs: int = 5) -> tuple[float, int, str]:
    """The least CPU time of this thread over ``runs`` renderings of ``path`` (seconds:
    the page's own work, which held every value whole before, and which other processes
    on the machine do not stretch; the server's reading is ``benchmarks/dashboard_page.py``'s),
    the Python memory one takes at its peak (bytes), and the page."""
    best = float("inf")
    page = ""
    for _ in range(runs):
        started = time.thread_time()
        response = client.get(path)
        best = min(best, time.thread_time() - started)
        assert response.status_code == 200
        page = response.get_data(as_text=True)
    tracemalloc.start()
    try:
        client.get(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return best, peak, page


def test_a_page_of_big_payloads_costs_what_a_page_of_small_ones_does(engine: Engine) -> None:
    blob = "z" * 1_000_000
    with engine.begin() as conn:
        conn.execute(insert(TASKS), [{"task": "t", "queue": "big", "payload": {"blob": blob, "n": i},
                                      "last_error": "Traceback\n" + "e" * 100_000 + "\nValueError: big"}
                                     for i in range(20)])
        conn.execute(insert(TASKS), [{"task": "t", "queue": "small", "payload": {"html": XSS, "n": i},
                                      "last_error": "Traceback\nValueError: small"} for i in range(20)])
    app = create_app(engine, [Task], page_size=20)
    small_time = big_time = float("inf")
    with app.test_client() as client:
        # Rounds of one of each, the fastest of each kept: a busy moment of the machine
        # falls on both kinds, not on all the runs of one.
        for _ in range(7):
            took, small_peak, small_page = _page_cost(client, "/tasks/jobs?queue=small", runs=1)
            small_time = min(small_time, took)
            took, big_peak, big_page = _page_cost(client, "/tasks/jobs?queue=big", runs=1)
            big_time = min(big_time, took)
    assert len(ids_on(small_page)) == len(ids_on(big_page)) == 20
    assert big_peak <= 2 * small_peak, (big_peak, small_peak)
    assert big_time <= 2 * small_time, (big_time, small_time)
    assert "&lt;script&gt;" in small_page and "ValueError: small" in small_page  # small values: their start
    assert big_page.count('<span class="muted">97.7 kB</span>') == 20  # a big error: its size
    assert len(re.findall(r'<span class="muted">\d+\.\d kB stored</span>', big_page)) == 20  # a payload: its size


def test_a_job_page_shows_a_bounded_view_of_a_big_value(engine: Engine, client: Any) -> None:
    key = add(engine, TASKS, task="t", payload={"blob": "z" * 4_000_000, "html": XSS},
              last_error="Traceback\n" + "e" * 150_000 + "\nValueError: the end")
    tracemalloc.start()
    try:
        response = client.get(f"/tasks/job/{key}")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    page = response.get_data(as_text=True)
    assert response.status_code == 200 and len(page) < 200_000
    assert peak < 2_000_000, peak  # the 4 MB value never reaches Python
    links = {
        column: (html.unescape(url), int(length))
        for url, column, length in re.findall(
            r'<a href="([^"]+/raw/([a-z_]+))" class="full-value">full value \((\d+) characters\)', page
        )
    }
    assert set(links) == {"payload", "last_error"}
    for column, (url, length) in links.items():
        raw = client.get(url).get_data(as_text=True)  # the whole value, on request
        assert len(raw) == length, column
    assert client.get(links["payload"][0]).get_data(as_text=True).count("z") == 4_000_000
    assert "ValueError: the end" not in page and "ValueError: the end" in client.get(links["last_error"][0]).get_data(
        as_text=True)


def _listening(engine: Engine) -> dict[int, Any]:
    """The listeners' connections of this test's database, by pid: their last activity."""
    with engine.connect() as conn:
        return {int(pid): changed for pid, changed in conn.execute(text(
            "SELECT pid, state_change FROM pg_stat_activity WHERE datname = current_database() "
            "AND query LIKE 'LISTEN %' AND pid <> pg_backend_pid()"
        ))}


def _workers_page(client: Any) -> tuple[list[str], dict[str, list[int]]]:
    """The pids of the connected workers, and the running jobs named for each worker."""
    page = client.get("/tasks/workers").get_data(as_text=True)
    listening = page[page.index('id="listening"'):page.index('id="running"')]
    running = page[page.index('id="running"'):]
    pids = re.findall(r'<td class="num mono">(\d+)</td>', listening)
    jobs = {
        owner: [int(k) for k in re.findall(r'class="running-job">(\d+)</a>', cells)]
        for owner, cells in re.findall(r'<td class="mono">([^<]+)</td>.*?<td class="mono">(.*?)</td>\s*</tr>',
                                       running, re.S)
    }
    return pids, jobs


def test_workers_page_shows_idle_workers_and_what_each_runs(
    engine: Engine, start_worker: Callable[..., Any]
) -> None:
    started, release = threading.Event(), threading.Event()
    tasks = Tasks()

    @tasks.task(name="hold")
    def hold(job: Any) -> None:
        started.set()
        while not release.is_set() and not current_job().cancelled:
            release.wait(0.02)

    app = create_app(engine, [Task], lease=30.0)
    workers = [start_worker(tasks, lease=30.0) for _ in range(3)]
    try:
        with client_of(app) as client:
            wait_for(lambda: len(_listening(engine)) == 3, what="three listeners")
            pids, jobs = _workers_page(client)
            assert sorted(map(int, pids)) == sorted(_listening(engine)) and jobs == {}  # three idle workers
            assert "No job is running" in client.get("/tasks/workers").get_data(as_text=True)

            key = add(engine, TASKS, task="hold")
            assert started.wait(20)
            wait_for(lambda: status_of(engine, TASKS, key) == "running", what="the job running")
            pids, jobs = _workers_page(client)
            assert len(pids) == 3 and list(jobs.values()) == [[key]]  # what it runs, beside the three
            (shown,) = jobs
            assert shown in {w.owner for w in workers}  # the worker, its executors' names taken together

            # A worker whose listener read the rows of a job cancelled under it is still seen.
            before = _listening(engine)
            with Session(engine) as session:
                assert cancel(session, Task, ids=[key]) == [key]
                session.commit()
            wait_for(lambda: any(_activity(engine, pid) != changed for pid, changed in before.items()),
                     what="a listener acted on the cancel")
            wait_for(lambda: len(_workers_page(client)[0]) == 3, what="three connected workers again")
    finally:
        release.set()


def table_row(engine: Engine, key: int) -> Any:
    with engine.connect() as conn:
        return conn.execute(select(TASKS).where(TASKS.c.id == key)).one()


def _activity(engine: Engine, pid: int) -> Any:
    with engine.connect() as conn:
        return conn.scalar(text("SELECT state_change FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid})


def test_a_job_page_shows_the_result_and_the_progress_first_escaped(engine: Engine) -> None:
    results = table_of(ResultTask)
    app = dashboard_app(engine, [ResultTask], lease=60.0)
    done = add(engine, results, task="t", status="done", result={"html": XSS, "n": 1}, progress=[1, 2])
    waiting = add(engine, results, task="t")
    with app.test_client() as client:
        page = client.get(f"/result_tasks/job/{done}").get_data(as_text=True)
        other = client.get(f"/result_tasks/job/{waiting}").get_data(as_text=True)
    result_at, progress_at, columns_at = page.index("<h2>Result</h2>"), page.index("<h2>Progress</h2>"), page.index(
        "<h2>Columns</h2>")
    assert result_at < progress_at < columns_at
    shown = page[result_at:progress_at]
    assert XSS not in page and "&lt;script&gt;" in shown
    assert '"n": 1' in html.unescape(shown)
    assert "<dt>result</dt>" not in page and "<dt>progress</dt>" not in page  # not twice
    assert 'id="result-value"' in other and "none yet" in other


def test_a_job_page_lists_its_attempts_newest_first_escaped(engine: Engine) -> None:
    results = table_of(ResultTask)
    app = dashboard_app(engine, [ResultTask], lease=60.0)
    entries = [
        {"attempt": 1, "outcome": "retried", "worker": "w/1", "started_at": "t1", "seconds": 0.5, "error": XSS},
        {"attempt": 2, "outcome": "done", "worker": "w/2", "started_at": "t2", "seconds": 1, "error": None},
    ]
    key = add(engine, results, task="t", status="done", history=entries)
    fresh = add(engine, results, task="t")
    with app.test_client() as client:
        page = client.get(f"/result_tasks/job/{key}").get_data(as_text=True)
        other = client.get(f"/result_tasks/job/{fresh}").get_data(as_text=True)
    table = page[page.index('<table id="attempts">'):page.index("</table>")]
    rows = re.findall(r"<tr><td>(\d+)</td><td><span class=\"status\">([a-z ]+)</span>", table)
    assert rows == [("2", "done"), ("1", "retried")]
    assert XSS not in page and "&lt;script&gt;" in table and "0.500" in table and "1.000" in table
    assert "<dt>history</dt>" not in page
    assert "<h2>Attempts</h2>" in other and "none ended yet" in other
