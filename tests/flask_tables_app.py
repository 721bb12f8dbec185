"""A Flask app with two queue tables (``tasks`` and ``email_jobs``), for ``flask queue
worker`` without NAME: every registered worker in one process.

``flask --app tests.flask_tables_app queue worker`` builds it on the test database
(``SQLA_QUEUE_TEST_URL``); each job writes an Effect row with ``db.session``, the
session of transactional handlers, so both tables' work shows in one place.
"""

from __future__ import annotations

import os
from typing import Any

from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from sqla_queue import Tasks
from sqla_queue.flask import FlaskQueue

from .models import Effect, EmailJob, Task

tasks = Tasks(Task)


@tasks.task
def report(job: Task, session: Any, *, name: str) -> None:
    session.add(Effect(job_id=job.id, worker="report", note=name))


def send(job: EmailJob, session: Any) -> None:
    session.add(Effect(job_id=job.id, worker="email", note=job.recipient))


def create_app(database_url: str | None = None) -> Flask:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = database_url or os.environ["SQLA_QUEUE_TEST_URL"]
    db = SQLAlchemy(app)
    queue = FlaskQueue(app, db)
    queue.add_worker(Task, tasks, poll_interval=0.5)
    queue.add_worker(EmailJob, send, name="mail", poll_interval=0.5)
    return app
