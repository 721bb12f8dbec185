"""The overview's charts and live refresh through Flask's test client, against real
PostgreSQL: each queue's counts and charts for a known set of finished jobs (per minute
and per quarter of an hour, the p50 and p99 shown), read from the queue table and from
the activity table alike; an empty table; queue names with markup; the policy of the
page with and without its script; the live parts, their ETag and 304."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, func, insert
from sqlalchemy.orm import DeclarativeBase

pytest.importorskip("flask")

from flask import Flask

from sqla_queue import JobMixin, activity_table
from sqla_queue import sql as q
from sqla_queue.activity import MINUTES, QUARTERS, bucket_start, due_range
from sqla_queue.dashboard import create_app
from sqla_queue.dashboard.charts import LIVE_CSP, duration

from .dashboard_helpers import XSS, client_of, dashboard_app
from .helpers import Server, table_of
from .models import ChartJob, EmailJob
from .test_activity import RUNS, WAITS, db_now, finished, p

JOBS = table_of(ChartJob)
EMAILS = table_of(EmailJob)
MINUTE = timedelta(minutes=1)


@pytest.fixture
def client(engine: Engine) -> Iterator[Any]:
    with client_of(dashboard_app(engine, [ChartJob, EmailJob]), origin=None) as client:  # reads only: no Origin
        yield client


def card(page: str, queue: str) -> str:
    """The section of one queue of chart_jobs (the first table of the page)."""
    start = page.index(f'<section class="card" data-queue="{html.escape(queue)}">')
    return page[start:page.index("</section>", start)]


def titles(part: str, chart: str) -> list[str]:
    """The tooltips of one chart of a card, one per bucket, oldest first."""
    start = part.index(f'<figure class="chart-{chart}">')
    figure = part[start:part.index("</figure>", start)]
    return [html.unescape(t) for t in re.findall(r"<title>([^<]*)</title>", figure)]


def known_jobs(engine: Engine) -> datetime:
    """Ten jobs of queue mail that finished three minutes ago (eight done, two failed),
    one failed a minute later, one cancelled: the minute of the ten."""
    minute = bucket_start(db_now(engine), 60) - 3 * MINUTE
    with engine.begin() as conn:
        conn.execute(insert(JOBS), [
            *finished(minute, "mail", "done", WAITS[:8], RUNS[:8]),
            *finished(minute, "mail", "failed", WAITS[8:], RUNS[8:]),
            *finished(minute + MINUTE, "mail", "failed", [1.0], [1.0]),
            *finished(minute + MINUTE, "mail", "cancelled", [1.0], [1.0]),
        ])
        conn.execute(insert(JOBS), [{"queue": "mail"}] * 2)
        conn.execute(insert(JOBS).values(queue="mail", run_after=func.now() - timedelta(minutes=5)))
    return minute


def check_the_known_jobs(page: str, minute: datetime) -> None:
    mail = card(page, "mail")
    counts = dict(re.findall(r'<div class="count-(\w+)">\w+ ?\w*<b>(?:<a [^>]*>)?([^<]+)<', mail))
    assert counts == {"pending": "3", "running": "0", "done": "8", "failed": "3", "cancelled": "1",
                      "oldest": "5.0m"}, counts
    label = f"{minute:%H:%M} UTC"
    bars = titles(mail, "finished")
    assert len(bars) == 60 and f"{label}: 8 done, 2 failed" in bars
    assert f"{minute + MINUTE:%H:%M} UTC: 0 done, 1 failed" in bars
    assert mail.count('class="done"') == 1 and mail.count('class="failed"') == 2  # a bar each
    pickup = titles(mail, "pickup")
    assert f"{label}: p50 {duration(p(WAITS, 50))}, p99 {duration(p(WAITS, 99))}" in pickup, pickup
    run = titles(mail, "run")
    assert f"{label}: p50 {duration(p(RUNS, 50))}, p99 {duration(p(RUNS, 99))}" in run, run
    assert titles(mail, "waiting")[-1].endswith(": waiting 3")  # now, on the bucket in progress


def test_the_charts_of_known_jobs_read_from_the_queue_table(engine: Engine, client: Any) -> None:
    minute = known_jobs(engine)
    response = client.get("/")
    page = response.get_data(as_text=True)
    assert response.status_code == 200
    check_the_known_jobs(page, minute)
    assert "Content-Security-Policy" in response.headers and "script-src" not in response.headers[
        "Content-Security-Policy"]  # live refresh off: no script at all
    assert '<script' not in page


def test_the_same_charts_read_from_the_activity_table(engine: Engine, client: Any) -> None:
    minute = known_jobs(engine)
    with engine.begin() as conn:  # what the workers record: every minute up to the last one ended
        now, mark_60, mark_900 = conn.execute(q.activity_marks(ChartJob)).one()
        for resolution, mark in ((MINUTES, mark_60), (QUARTERS, mark_900)):
            while (due := due_range(now, mark, resolution)) is not None:
                since, until, sample = due
                conn.execute(q.record_activity(ChartJob, seconds=resolution.seconds), {
                    q.ACTIVITY_SINCE_PARAM: since, q.ACTIVITY_UNTIL_PARAM: until, q.ACTIVITY_SAMPLE_PARAM: sample})
                mark = until - timedelta(seconds=resolution.seconds)
            if resolution is MINUTES:
                counted = mark  # the latest minute recorded: its waiting jobs were counted
        # Changed after the recording, the queue table no longer says what the charts show.
        conn.execute(JOBS.delete().where(JOBS.c.finished_at < minute + MINUTE))
        conn.execute(insert(EMAILS).values(queue="mail"))
    page = client.get("/").get_data(as_text=True)
    check_the_known_jobs(page, minute)
    waiting = titles(card(page, "mail"), "waiting")
    assert f"{counted:%H:%M} UTC: waiting 3" in waiting
    assert f"{minute:%H:%M} UTC: none" in waiting  # recorded while catching up: not counted
    assert "Read from the table itself" not in page.split("<h2>email_jobs</h2>")[0]
    assert "Read from the table itself" in page.split("<h2>email_jobs</h2>")[1]  # no activity table there


def test_the_last_24_hours_by_quarter_of_an_hour(engine: Engine, client: Any) -> None:
    minute = known_jobs(engine)
    with engine.begin() as conn:
        conn.execute(insert(JOBS), finished(minute - timedelta(hours=20), "mail", "done", [1.0, 3.0], [2.0, 4.0]))
    page = client.get("/?window=24h").get_data(as_text=True)
    mail = card(page, "mail")
    bars = titles(mail, "finished")
    assert len(bars) == 96
    quarter = bucket_start(minute, 900)
    old = bucket_start(minute - timedelta(hours=20), 900)
    failed = 3 if bucket_start(minute + MINUTE, 900) == quarter else 2  # the next minute, in the same quarter?
    assert f"{quarter:%H:%M} to {quarter + timedelta(minutes=15):%H:%M} UTC: 8 done, {failed} failed" in bars
    assert f"{old:%H:%M} to {old + timedelta(minutes=15):%H:%M} UTC: 2 done, 0 failed" in bars
    run = titles(mail, "run")
    assert f"{old:%H:%M} to {old + timedelta(minutes=15):%H:%M} UTC: p50 3.0 s, p99 4.0 s" in run
    assert "Finished per 15 minutes" in mail and "<b class=\"window-24h\">last 24 hours</b>" in page
    assert "done<b><a" in mail and re.search(r'count-done">done<b><a [^>]*>10<', mail)  # over the 24 hours


def test_an_empty_table_and_an_idle_queue(engine: Engine, client: Any) -> None:
    page = client.get("/").get_data(as_text=True)
    assert page.count("No job pending or running in this table, nor finished in the last hour.") == 2
    with engine.begin() as conn:
        conn.execute(insert(JOBS).values(queue="idle", run_after=func.now() + timedelta(hours=1)))
    page = client.get("/?window=24h").get_data(as_text=True)
    idle = card(page, "idle")
    assert re.search(r'count-pending">pending<b><a [^>]*>1<', idle)
    assert all(t.endswith("0 done, 0 failed") for t in titles(idle, "finished"))
    assert all(t.endswith(": none") for t in titles(idle, "pickup"))
    assert titles(idle, "waiting")[-1].endswith("waiting 0")  # not runnable yet


def test_queue_names_with_markup_reach_no_chart_as_markup(engine: Engine, client: Any) -> None:
    with engine.begin() as conn:
        conn.execute(insert(JOBS), finished(bucket_start(db_now(engine), 60) - MINUTE, XSS, "done", [1.0], [1.0]))
        conn.execute(insert(JOBS), [{"queue": XSS}, {"queue": "a'b\"c"}])
    for path in ("/", "/?window=24h&live=5", "/live", "/live?window=24h"):
        page = client.get(path).get_data(as_text=True)
        assert XSS not in page and "<script>alert" not in page, path
        assert "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;" in page or "\\u003cscript\\u003e" in page, path
    page = client.get("/?live=5").get_data(as_text=True)
    ids = [json.loads(html.unescape(i)) for i in re.findall(r"data-live-id='([^']*)'", page)]
    assert ["chart_jobs", XSS, "counts"] in ids and ["chart_jobs", "a'b\"c", "charts"] in ids


def test_the_policy_allows_the_dashboard_s_own_script_only_with_live_refresh(client: Any) -> None:
    off = client.get("/")
    assert "script-src" not in off.headers["Content-Security-Policy"]
    on = client.get("/?live=5")
    policy = on.headers["Content-Security-Policy"]
    assert policy == LIVE_CSP
    directives = dict(d.strip().split(" ", 1) for d in policy.split(";"))
    assert directives["script-src"] == "'self'" and directives["connect-src"] == "'self'"
    assert directives["default-src"] == "'none'" and directives["frame-ancestors"] == "'none'"
    assert "unsafe" not in directives["script-src"] and "data:" not in directives["script-src"]
    page = on.get_data(as_text=True)
    scripts = re.findall(r"<script[^>]*>(.*?)</script>", page, re.S)
    assert scripts == [""]  # one, by src: no inline script
    assert re.search(r'<script src="/live\.js" defer></script>', page)
    assert 'id="live" data-url="/live?window=1h" data-every="5"' in page
    script = client.get("/live.js")
    assert script.mimetype == "text/javascript" and script.headers["X-Content-Type-Options"] == "nosniff"
    assert "eval(" not in script.get_data(as_text=True) and "innerHTML =" not in script.get_data(as_text=True)
    assert client.get("/?live=0").headers["Content-Security-Policy"] == off.headers["Content-Security-Policy"]
    assert 'data-every="1"' in client.get("/?live=1").get_data(as_text=True)
    assert 'data-every="600"' in client.get("/?live=99999").get_data(as_text=True)
    assert "id=\"live\"" not in client.get("/?live=x").get_data(as_text=True)


def test_the_live_parts_answer_304_until_a_count_changes(engine: Engine, client: Any) -> None:
    known_jobs(engine)
    first = client.get("/live")
    assert first.status_code == 200 and first.mimetype == "text/html"
    parts = first.get_data(as_text=True)
    page = client.get("/?live=5").get_data(as_text=True)
    ids = re.findall(r"data-live-id='([^']*)'", parts)
    assert ids and ids == re.findall(r"data-live-id='([^']*)'", page)  # the same parts as the page's
    assert "<form" not in parts and "csrf_token" not in parts  # never a form
    etag = first.headers["ETag"]
    again = client.get("/live", headers={"If-None-Match": etag})
    assert again.status_code == 304 and again.data == b"" and again.headers["ETag"] == etag
    with engine.begin() as conn:
        conn.execute(insert(JOBS).values(queue="mail"))
    changed = client.get("/live", headers={"If-None-Match": etag})
    assert changed.status_code == 200 and changed.headers["ETag"] != etag
    assert re.search(r'count-pending">pending<b><a [^>]*>4<', changed.get_data(as_text=True))
    assert client.get("/live?window=24h").headers["ETag"] != changed.headers["ETag"]


def test_the_live_parts_are_behind_the_dashboard_s_checks(engine: Engine) -> None:
    app = Flask(__name__)
    app.secret_key = "x"
    from sqla_queue.dashboard import dashboard_blueprint

    app.register_blueprint(dashboard_blueprint(engine, [ChartJob], auth=lambda: False), url_prefix="/queue")
    with app.test_client() as client:
        assert client.get("/queue/live").status_code == 403
        assert client.get("/queue/").status_code == 403
    app = create_app(engine, [ChartJob])
    with app.test_client() as client:
        assert client.get("/live", headers={"Host": "evil.example"}).status_code == 400


def test_an_activity_table_declared_but_not_migrated_yet(server: Server) -> None:
    """The overview reads the queue table and says the activity table is missing."""

    class Base(DeclarativeBase):
        pass

    class UnmigratedJob(Base, JobMixin):
        __tablename__ = "unmigrated_jobs"

    activity_table(UnmigratedJob)
    engine = create_engine(server.url)
    jobs = table_of(UnmigratedJob)
    try:
        jobs.create(engine)
        with engine.begin() as conn:
            conn.execute(insert(jobs), finished(bucket_start(db_now(engine), 60) - MINUTE, "q", "done", [1.0], [2.0]))
        with create_app(engine, [UnmigratedJob]).test_client() as client:
            response = client.get("/")
        page = response.get_data(as_text=True)
        assert response.status_code == 200
        assert "its activity table is declared, but not in the database yet" in page
        assert "1 done" in card(page, "q")
    finally:
        jobs.drop(engine)
        engine.dispose()
