"""The dashboard's JSON API, read and driven by scripts: the stand-alone dashboard served
on a free port with its API's actions allowed, then the page's shell examples
(dashboard_api.sh, with curl) and its Python client run against it; and the API of a
dashboard mounted behind your own auth.

    python examples/docs/dashboard_api.py      # DATABASE_URL, or an embedded server
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from datetime import datetime
from pathlib import Path

from sqlalchemy import Engine, create_engine, insert, select
from sqlalchemy.orm import DeclarativeBase, Mapped

from sqla_queue import JobMixin, Schedule, schedules_table
from sqla_queue.dashboard import serve

from _db import database_url

HERE = Path(__file__).resolve().parent


class Base(DeclarativeBase):
    pass


class NewsletterJob(Base, JobMixin):
    __tablename__ = "newsletter_jobs"
    recipient: Mapped[str]


schedules_table(NewsletterJob)  # its workers run schedules: the watermark table
DIGEST = Schedule("weekly digest", "0 8 * * 1", values={"recipient": "list@example.com"}, queue="digest")


# isort: split
# --8<-- [start:client]
import json
from collections.abc import Iterator
from http.cookiejar import CookieJar
from typing import Any
from urllib.error import HTTPError
from urllib.parse import urljoin, urlsplit
from urllib.request import HTTPCookieProcessor, Request, build_opener


class QueueApi:
    """A client of the dashboard's JSON API at ``base``, its root URL."""

    def __init__(self, base: str) -> None:
        self.base = base.rstrip("/") + "/"
        parts = urlsplit(self.base)
        self.origin = f"{parts.scheme}://{parts.netloc}"  # what the dashboard checks a POST's Origin against
        self.http = build_opener(HTTPCookieProcessor(CookieJar()))  # keeps the session cookie
        self.token: str | None = None

    def get(self, path: str) -> Any:
        with self.http.open(urljoin(self.base, path)) as response:
            return json.load(response)

    def jobs(self, path: str) -> Iterator[dict[str, Any]]:
        """Every job of a list, page after page (each page names the next one)."""
        page = self.get(path)
        yield from page["jobs"]
        while page["next"]:
            page = self.get(page["next"])
            yield from page["jobs"]

    def act(self, table: str, action: str, **body: Any) -> Any:
        if self.token is None:
            self.token = self.get("csrf")["csrf_token"]  # and the session cookie it belongs to
        request = Request(
            urljoin(self.base, f"tables/{table}/actions/{action}"), method="POST", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "X-CSRF-Token": self.token, "Origin": self.origin},
        )
        with self.http.open(request) as response:
            return json.load(response)
# --8<-- [end:client]


def use(base: str) -> tuple[int, str]:
    # --8<-- [start:use]
    api = QueueApi(base)  # "http://127.0.0.1:8787/api", or your mount's: "https://app.example.com/admin/queue/api"
    dead = [job["id"] for job in api.jobs("tables/newsletter_jobs/dead?queue=sms&limit=2")]
    answer = api.act("newsletter_jobs", "requeue", ids=dead)
    print(f"requeued {answer['requeued']} of {answer['requested']} dead letters of queue sms")
    try:
        api.get("tables/no_such_table/jobs")
    except HTTPError as error:
        problem = json.load(error)  # {"error": "no_such_table", "message": "...", "status": 404}

    # A bulk action by filter: the count first, then the action over the jobs of that count.
    count = api.get("tables/newsletter_jobs/bulk?action=cancel&queue=digest")
    done = api.act("newsletter_jobs", "bulk_cancel", queue=["digest"], as_of=count["as_of"])
    print(f"cancelled {done['done']} of the {count['acting']} jobs counted in queue digest")

    # Run a schedule now, fenced by the last tick read (a 409 "schedule_ticked" if it ticked since).
    (digest,) = api.get("tables/newsletter_jobs/schedules")["schedules"]
    ran = api.act("newsletter_jobs", "run_now", name=digest["name"], seen=digest["last_tick"])
    print(f"ran {ran['name']} now: job {ran['job']}")
    # --8<-- [end:use]
    assert len(dead) == 5 and count["acting"] == done["done"] == 2
    return answer["requeued"], problem["error"]


# --8<-- [start:mount]
from flask import Flask, session

from sqla_queue.dashboard import dashboard_blueprint


def is_admin() -> bool:
    """Your own check: a logged-in operator (here, a flag in Flask's session)."""
    return bool(session.get("is_admin"))


def create_app(engine: Engine) -> Flask:
    app = Flask(__name__)
    app.secret_key = "change me"  # the CSRF tokens live in the session
    app.register_blueprint(
        dashboard_blueprint(engine, [NewsletterJob], auth=is_admin, api_actions=True),
        url_prefix="/admin/queue",  # the pages; the API is /admin/queue/api/
    )
    return app
# --8<-- [end:mount]


def statuses(engine: Engine) -> dict[int, str]:
    with engine.connect() as conn:
        return {row.id: row.status for row in conn.execute(select(NewsletterJob.id, NewsletterJob.status))}


def shell_examples(base: str, origin: str) -> str:
    """Run dashboard_api.sh against the served API, in a scratch folder (its cookies)."""
    with tempfile.TemporaryDirectory() as scratch:
        result = subprocess.run(
            ["bash", str(HERE / "dashboard_api.sh")], cwd=scratch, capture_output=True, text=True, timeout=60,
            env={**os.environ, "BASE": base, "ORIGIN": origin,
                 "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"},
            check=False,
        )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def tour(url: str) -> None:
    engine = create_engine(url)
    Base.metadata.create_all(engine)
    try:
        with engine.begin() as conn:
            conn.execute(insert(NewsletterJob).values(recipient="a@example.com", queue="mail"))  # 1
            conn.execute(insert(NewsletterJob).values(recipient="<b>b</b>", queue="mail", status="failed",
                                                      last_error="SMTPError: 550 no such user"))  # 2
            conn.execute(insert(NewsletterJob).values(recipient="c@example.com", queue="mail", status="failed",
                                                      last_error="SMTPError: 421 try again later"))  # 3
            conn.execute(insert(NewsletterJob), [  # 4-8
                {"recipient": f"{n}@example.com", "queue": "sms", "status": "failed", "last_error": "SMTPError: 421"}
                for n in range(5)
            ])
            conn.execute(insert(NewsletterJob), [{"recipient": f"{n}@example.com", "queue": "digest"}  # 9-10
                                                 for n in range(2)])
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
        served: queue.Queue[str] = queue.Queue()
        # What `sqla-queue dashboard ... --api-actions` runs, on a free port.
        threading.Thread(target=serve, args=(engine, [NewsletterJob]),
                         kwargs={"port": 0, "api_actions": True, "ready": served.put,
                                 "schedules": {NewsletterJob: [DIGEST]}}, daemon=True).start()
        address = served.get(timeout=30)  # http://127.0.0.1:PORT/
        base, origin = address + "api", address.rstrip("/")

        # The answer the page shows (dashboard_api_dead.json), but for its moments.
        shown = json.loads((HERE / "dashboard_api_dead.json").read_text())
        answer = QueueApi(base).get("tables/newsletter_jobs/dead?queue=mail&limit=1")
        for job, sample in zip(answer["jobs"], shown["jobs"], strict=True):
            for moment in ("run_after", "created_at"):
                datetime.fromisoformat(job[moment])
                job[moment] = sample[moment]
        assert answer == shown, answer

        if shutil.which("curl"):
            out = shell_examples(base, origin)
            assert '"table": "newsletter_jobs"' in out and "\\u003cb\\u003eb\\u003c/b\\u003e" in out
            assert '"requeued": 1' in out and '"requested": 1' in out  # by id, then by filter
            assert statuses(engine)[2] == statuses(engine)[3] == "pending"
            print("the shell examples read the API and requeued jobs 2 and 3 with curl")
        else:
            print("curl is not installed: the shell examples were not run")

        assert use(base) == (5, "no_such_table")
        now = statuses(engine)
        assert now[9] == now[10] == "cancelled" and now[11] == "pending"  # the digest's run now: job 11
        assert {now[k] for k in range(1, 9)} <= {"pending"} | ({"failed"} if not shutil.which("curl") else set())

        client = create_app(engine).test_client()
        assert client.get("/admin/queue/api/overview").status_code == 403  # your auth first
        with client.session_transaction() as state:
            state["is_admin"] = True
        overview = client.get("/admin/queue/api/overview").get_json()
        pending = sum(q["counts"]["pending"] for q in overview["tables"][0]["queues"])  # now; the others: the hour
        assert pending == list(statuses(engine).values()).count("pending")
        print("the API of the mounted dashboard answers behind is_admin")
    finally:
        Base.metadata.drop_all(engine)
        engine.dispose()


if __name__ == "__main__":
    with database_url() as url:
        tour(url)
