"""The web dashboard mounted in an app of your own, behind your own login check; and the
inspection builders it runs, in a statement of your own.

    python examples/docs/dashboard_app.py      # DATABASE_URL, or an embedded server
"""

from __future__ import annotations

import re

from sqlalchemy import create_engine, insert

from _db import database_url

# isort: split
# --8<-- [start:models]
from sqlalchemy.orm import DeclarativeBase, Mapped

from sqla_queue import JobMixin, TaskMixin


class Base(DeclarativeBase):
    pass


class EmailJob(Base, JobMixin):
    __tablename__ = "dashboard_email_jobs"
    recipient: Mapped[str]


class Task(Base, TaskMixin):
    __tablename__ = "dashboard_tasks"
# --8<-- [end:models]


# --8<-- [start:activity]
from sqla_queue import activity_table

# The workers of dashboard_email_jobs record its activity, which the overview's charts read.
activity_table(EmailJob)
# --8<-- [end:activity]


# --8<-- [start:mount]
from flask import Flask, session
from sqlalchemy import Engine

from sqla_queue.dashboard import dashboard_blueprint


def is_admin() -> bool:
    """Your own check: a logged-in operator (here, a flag in Flask's session)."""
    return bool(session.get("is_admin"))


def create_app(engine: Engine) -> Flask:
    app = Flask(__name__)
    app.secret_key = "change me"  # the dashboard keeps its CSRF token in the session
    app.register_blueprint(
        dashboard_blueprint(engine, [EmailJob, Task], auth=is_admin, lease=60.0),
        url_prefix="/admin/queue",
    )
    return app
# --8<-- [end:mount]


def builders(engine: Engine) -> list[int]:
    # --8<-- [start:builders]
    from sqlalchemy import select

    from sqla_queue import sql

    newest_smtp_failures = (
        select(EmailJob.id, EmailJob.recipient)
        .where(*sql.job_filter(EmailJob, statuses=["failed"], error_contains="SMTP"))
        .order_by(EmailJob.id.desc())
        .limit(20)
    )
    with engine.connect() as conn:
        page = conn.execute(sql.list_jobs(EmailJob, queues=["mail", "sms"], limit=50)).all()
        failures = conn.execute(newest_smtp_failures).all()
    # --8<-- [end:builders]
    assert len(page) == 2
    return [row.id for row in failures]


def tour(url: str) -> None:
    engine = create_engine(url)
    Base.metadata.create_all(engine)
    try:
        with engine.begin() as conn:
            conn.execute(insert(EmailJob), [{"recipient": "a@example.com", "queue": "mail"}])
            conn.execute(insert(EmailJob).values(recipient="b@example.com", queue="sms", status="failed",
                                                 last_error="SMTPError: 550"))
        app = create_app(engine)
        client = app.test_client()
        assert client.get("/admin/queue/").status_code == 403  # not an admin yet
        with client.session_transaction() as state:
            state["is_admin"] = True
        page = client.get("/admin/queue/dashboard_email_jobs/dead").get_data(as_text=True)
        token = re.search(r'name="csrf_token" value="([^"]+)"', page)
        assert token and 'data-id="2"' in page
        response = client.post("/admin/queue/dashboard_email_jobs/action",
                               data={"csrf_token": token.group(1), "action": "requeue", "id": "2"},
                               headers={"Origin": "http://localhost"})  # as the browser sends it
        assert response.status_code == 302
        assert builders(engine) == []  # requeued: no dead letter left
        overview = client.get("/admin/queue/?window=24h&live=5")
        assert overview.status_code == 200 and "script-src 'self'" in overview.headers["Content-Security-Policy"]
        assert '<figure class="chart-pickup">' in overview.get_data(as_text=True)
        print("dashboard mounted behind is_admin; the dead letter was requeued from it")
    finally:
        Base.metadata.drop_all(engine)
        engine.dispose()


if __name__ == "__main__":
    with database_url() as url:
        tour(url)
