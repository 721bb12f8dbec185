""""At most once, ever" survives retention: a finished job that still holds its unique
key (``done`` under ``UNIQUE_EVER``) is never pruned nor archived, by the builders, the
workers' pruner (both runtimes) or ``sqla-queue prune``; ``delete_jobs``, ``sqla-queue
delete`` and the dashboard delete it only when told that this frees the key. Real
PostgreSQL throughout."""

from __future__ import annotations

import re
from typing import Any

import pytest
from sqlalchemy import Engine, func, insert, select
from sqlalchemy.orm import Session, sessionmaker

from sqla_queue import QueueSession, archive_table
from sqla_queue import sql as q
from sqla_queue.cli import main

from .helpers import Server, table_of, wait_for
from .models import Base, Effect, EmailJob, OnceJob

ONCE = table_of(OnceJob)
EMAIL = table_of(EmailJob)
DAY = 86400.0
#: A form posted from the dashboard's own page (every POST must come from its own origin).
SAME_ORIGIN = {"Origin": "http://localhost"}


def _add(engine: Engine, table: Any = ONCE, *, status: str = "done", key: str | None = None) -> int:
    """A job in ``status`` holding ``key``, finished two days ago if finished."""
    finished = func.now() - q.seconds_interval(2 * DAY) if status in ("done", "failed", "cancelled") else None
    with engine.begin() as conn:
        stmt = insert(table).values(status=status, unique_key=key, finished_at=finished).returning(table.c.id)
        return int(conn.execute(stmt).scalar_one())


def _left(engine: Engine, table: Any = ONCE) -> set[int]:
    with engine.connect() as conn:
        return set(conn.scalars(select(table.c.id)))


def _enqueue_again(engine: Engine, key: str) -> bool:
    with sessionmaker(engine, class_=QueueSession)() as session:
        again = session.enqueue(OnceJob(), unique_key=key)
        session.commit()
    return again.inserted


def test_prune_and_archive_keep_a_done_job_that_holds_its_key_ever(engine: Engine) -> None:
    held = _add(engine, key="order:42")
    keyless = _add(engine)
    failed = _add(engine, status="failed", key="order:7")  # failed does not hold it: prunable
    with engine.begin() as conn:
        assert conn.execute(q.prune_finished(OnceJob, older_than=DAY, statuses=["done", "failed"])).rowcount == 2
    assert _left(engine) == {held} and keyless not in _left(engine)
    archive = archive_table(OnceJob, "once_jobs_archive_ever", Base.metadata)
    archive.create(engine)
    try:
        with engine.begin() as conn:
            assert list(conn.scalars(q.archive_finished(OnceJob, archive, older_than=DAY))) == []
    finally:
        archive.drop(engine)
        Base.metadata.remove(archive)
    assert _left(engine) == {held}
    assert not _enqueue_again(engine, "order:42")
    assert failed not in _left(engine)


def test_pruning_still_removes_finished_keyed_jobs_of_active_only_keys(engine: Engine) -> None:
    """``UNIQUE_ACTIVE`` (the default): a finished job holds no key, so nothing to keep."""
    done = _add(engine, EMAIL, key="invoice:1")
    with engine.begin() as conn:
        assert conn.execute(q.prune_finished(EmailJob, older_than=DAY)).rowcount == 1
        assert conn.execute(q.delete_jobs(EmailJob, statuses=["done"])).all() == []
    assert done not in _left(engine, EMAIL)
    assert q.keeps_unique_key(EmailJob) is None


def test_delete_jobs_frees_a_key_only_when_told(engine: Engine) -> None:
    held, keyless = _add(engine, key="order:42"), _add(engine)
    pending = _add(engine, status="pending", key="order:43")  # never ran: deleting it runs nothing twice
    with engine.begin() as conn:
        assert set(conn.scalars(q.delete_jobs(OnceJob, statuses=["done", "pending"]))) == {keyless, pending}
    assert _left(engine) == {held}
    with engine.begin() as conn:
        assert list(conn.scalars(q.delete_jobs(OnceJob, ids=[held], free_keys=True))) == [held]
    assert _enqueue_again(engine, "order:42")  # what the caller asked for, knowingly


def _invoice(job: OnceJob, session: Session) -> None:
    session.add(Effect(job_id=job.id, worker="w", note=f"invoice {job.unique_key}"))


def test_a_worker_with_retention_never_prunes_the_key_of_a_done_job_on_both_runtimes(
    engine: Engine, make_worker: Any
) -> None:
    Sessions = sessionmaker(engine, class_=QueueSession)
    with Sessions() as session:
        first = session.enqueue(OnceJob(), unique_key="order:42")
        session.commit()
    worker = make_worker(engine, OnceJob, _invoice, retention={"done": 0.001}, retention_interval=0.1,
                         poll_interval=0.2)
    worker.start()
    try:
        wait_for(lambda: _invoices(engine) == 1 and _status(engine, first.job_id) != "running",
                 what="the invoice job done")
        with Sessions() as session:  # a job without a key, done after it: the pruner's witness
            witness = session.enqueue(OnceJob())
            session.flush()
            witness_id = witness.id  # before the commit: the worker may prune it right after
            session.commit()
        wait_for(lambda: witness_id not in _left(engine), what="the keyless done job pruned")
        assert first.job_id in _left(engine)
        assert not _enqueue_again(engine, "order:42")
    finally:
        worker.stop(grace=1)
    assert _invoices(engine) == 1


def _invoices(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(Effect).where(Effect.note == "invoice order:42")) or 0)


def _status(engine: Engine, job_id: int) -> str | None:
    with engine.connect() as conn:
        return conn.scalar(select(ONCE.c.status).where(ONCE.c.id == job_id))


@pytest.fixture
def url(server: Server) -> str:
    return server.url.render_as_string(hide_password=False)


def test_the_command_lines_keep_key_holders_and_say_how_to_free_them(
    engine: Engine, url: str, capsys: Any
) -> None:
    model = "tests.models:OnceJob"
    held, _keyless = _add(engine, key="order:42"), _add(engine)
    assert main(["prune", model, "--url", url, "--older-than", "1d"]) == 0
    assert _left(engine) == {held}
    _add(engine)
    assert main(["delete", model, "--url", url, "--status", "done"]) == 0
    out, err = capsys.readouterr()
    assert "deleted 1 job(s)" in out and "kept 1 finished job(s) that still hold their unique key" in err
    assert "--free-keys" in err and _left(engine) == {held}
    assert main(["delete", model, "--url", url, "--status", "done", "--free-keys"]) == 0
    out, err = capsys.readouterr()
    assert "deleted 1 job(s)" in out and err == ""
    assert _left(engine) == set()


def test_the_dashboard_asks_before_freeing_a_key(engine: Engine) -> None:
    pytest.importorskip("flask")
    from sqla_queue.dashboard import create_app

    app = create_app(engine, [OnceJob])
    app.testing = True
    held, keyless = _add(engine, key="order:42"), _add(engine)
    with app.test_client() as client:
        page = client.get("/once_jobs/jobs").get_data(as_text=True)
        token = re.search(r'name="csrf_token" value="([^"]+)"', page)
        assert token
        form = {"csrf_token": token.group(1), "action": "delete", "id": [str(held), str(keyless)]}
        asked = client.post("/once_jobs/action", data=form, headers=SAME_ORIGIN)
        assert asked.status_code == 200
        text = asked.get_data(as_text=True)
        assert "1 of the selected job(s) finished but still hold their unique key" in text
        assert 'name="free_keys" value="1"' in text and "run, again" in text
        assert _left(engine) == {held}
        confirmed = client.post("/once_jobs/action", data={**form, "free_keys": "1"}, headers=SAME_ORIGIN)
        assert confirmed.status_code == 302
    assert _left(engine) == set()


def test_flask_queue_delete_keeps_key_holders_unless_told(engine: Engine, url: str) -> None:
    pytest.importorskip("flask_sqlalchemy")
    from flask import Flask
    from flask_sqlalchemy import SQLAlchemy

    from sqla_queue.flask import FlaskQueue

    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = url
    db = SQLAlchemy(app)
    queue = FlaskQueue(app, db)
    queue.add_worker(OnceJob, lambda job: None)
    held, _keyless = _add(engine, key="order:42"), _add(engine)
    runner = app.test_cli_runner()
    try:
        kept = runner.invoke(args=["queue", "delete", "once_jobs", "--status", "done"])
        assert kept.exit_code == 0, kept.output
        assert "deleted 1 job(s)" in kept.output and "add --free-keys" in kept.output
        assert _left(engine) == {held}
        freed = runner.invoke(args=["queue", "delete", "once_jobs", "--status", "done", "--free-keys"])
        assert freed.exit_code == 0 and "deleted 1 job(s)" in freed.output and "kept" not in freed.output
        assert _left(engine) == set()
    finally:
        with app.app_context():
            db.engine.dispose()
