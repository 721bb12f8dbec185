"""Flask-SQLAlchemy integration, through the example shop: a real app, real PostgreSQL."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

import sqla_queue

from . import console
from .helpers import SENTINEL_CHANNEL, Server, notifications_until_sentinel

pytest.importorskip("flask_sqlalchemy")

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "flask_shop.py"


def _load_shop() -> Any:
    spec = importlib.util.spec_from_file_location("flask_shop", EXAMPLE)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["flask_shop"] = module
    spec.loader.exec_module(module)
    return module


shop = _load_shop()


@pytest.fixture
def app(server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("SHOP_OUTBOX", str(tmp_path))
    app = shop.create_app(server.url.render_as_string(hide_password=False))
    with app.app_context():
        shop.db.create_all()
        shop.db.session.add(shop.Product(id=1, name="teapot", stock=3))
        shop.db.session.commit()
    yield app
    with app.app_context():
        shop.db.session.close()
        shop.db.drop_all()
        shop.db.engine.dispose()


def counts(app: Any) -> tuple[int, int]:
    with app.app_context():
        orders = shop.db.session.scalar(select(func.count()).select_from(shop.ShopOrder))
        jobs = shop.db.session.scalar(select(func.count()).select_from(shop.ConfirmationEmail))
        return orders, jobs


def test_order_and_its_email_job_commit_together(app: Any, listener: Any, server: Server) -> None:
    from sqla_queue import queue_table

    channel = queue_table(shop.ConfirmationEmail).channel
    listener.execute(f'LISTEN "{channel}"')
    listener.execute(f'LISTEN "{SENTINEL_CHANNEL}"')
    response = app.test_client().post("/orders", json={"product_id": 1, "quantity": 2, "email": "a@example.com"})
    assert response.status_code == 201
    assert counts(app) == (1, 1)
    assert notifications_until_sentinel(listener, server.conninfo) == [(channel, "default")]


def test_failure_after_enqueue_rolls_back_both(app: Any, listener: Any, server: Server) -> None:
    from sqla_queue import queue_table

    listener.execute(f'LISTEN "{queue_table(shop.ConfirmationEmail).channel}"')
    listener.execute(f'LISTEN "{SENTINEL_CHANNEL}"')
    response = app.test_client().post("/orders", json={"product_id": 1, "quantity": 5, "email": "a@example.com"})
    assert response.status_code == 409  # out of stock, raised after the job was enqueued
    assert counts(app) == (0, 0)
    assert notifications_until_sentinel(listener, server.conninfo) == []


def test_concurrent_orders_for_one_product_neither_deadlock_nor_oversell(app: Any) -> None:
    """Six orders at once for the three teapots in stock: three placed, three refused."""
    import threading

    start = threading.Barrier(6, timeout=10)
    statuses: list[int] = []

    def order(n: int) -> None:
        client = app.test_client()
        start.wait()
        response = client.post("/orders", json={"product_id": 1, "quantity": 1, "email": f"{n}@example.com"})
        statuses.append(response.status_code)

    threads = [threading.Thread(target=order, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(statuses) == [201, 201, 201, 409, 409, 409]
    assert counts(app) == (3, 3)


def test_db_session_enqueue_is_the_current_session(app: Any) -> None:
    with app.app_context():
        order = shop.ShopOrder(product_id=1, quantity=1, email="x@example.com")
        shop.db.session.add(order)
        shop.db.session.flush()
        job = shop.db.session.enqueue(shop.ConfirmationEmail(order_id=order.id, to=order.email), priority=3)
        assert job in shop.db.session() and job.priority == 3
        rows = [{"order_id": order.id, "to": f"bulk{i}@example.com"} for i in range(3)]
        assert shop.db.session.enqueue_many(shop.ConfirmationEmail, rows, queue="bulk") == 3
        shop.db.session.flush()
        assert counts(app) == (0, 0)  # another session sees nothing uncommitted
        shop.db.session.rollback()
    assert counts(app) == (0, 0)


def test_flask_queue_commands(app: Any, tmp_path: Path) -> None:
    client = app.test_client()
    for email in ("a@example.com", "b@undeliverable.example"):
        assert client.post("/orders", json={"product_id": 1, "quantity": 1, "email": email}).status_code == 201
    runner = app.test_cli_runner()

    stats = runner.invoke(args=["queue", "stats"])
    assert stats.exit_code == 0, stats.output
    assert stats.output.splitlines()[2].split()[:3] == ["default", "pending", "2"]

    worker = runner.invoke(args=["queue", "worker", "--until-idle", "--concurrency", "1"])
    assert worker.exit_code == 0, worker.output
    with app.app_context():
        jobs = {j.to: j for j in shop.db.session.scalars(select(shop.ConfirmationEmail))}
        assert jobs["a@example.com"].status == "done"
        assert jobs["b@undeliverable.example"].status == "failed"
        assert jobs["b@undeliverable.example"].attempts == 3
        confirmed = shop.db.session.scalars(select(shop.ShopOrder.confirmed).order_by(shop.ShopOrder.id)).all()
        assert confirmed == [True, False]  # the handler's write committed with its completion
    as_json = runner.invoke(args=["queue", "stats", "--json"])
    assert as_json.exit_code == 0, as_json.output
    counts = {(q["queue"], q["status"]): q["jobs"] for q in json.loads(as_json.output)["queues"]}
    assert counts == {("default", "done"): 1, ("default", "failed"): 1}
    # the handler ran in its thread inside an app context: it used db.session and current_app
    assert (tmp_path / "order-1.eml").read_text().startswith("To: a@example.com")

    everything = runner.invoke(args=["queue", "requeue", "confirmation_email"])
    assert everything.exit_code == 2 and "name the jobs to requeue" in everything.output  # asked for, as delete
    requeue = runner.invoke(args=["queue", "requeue", "confirmation_email", "--status", "failed"])
    assert requeue.exit_code == 0 and "requeued 1" in requeue.output
    assert runner.invoke(args=["queue", "sweep"]).output.startswith("swept 0 expired")
    unknown = runner.invoke(args=["queue", "stats", "nope"])
    assert unknown.exit_code != 0 and "no worker named 'nope'" in unknown.output
    bad = runner.invoke(args=["queue", "worker", "--lease", "soon"])
    assert bad.exit_code != 0 and "not a duration" in bad.output


def test_flask_queue_enqueue_is_the_current_session(app: Any) -> None:
    with app.app_context():
        order = shop.ShopOrder(product_id=1, quantity=1, email="x@example.com")
        shop.db.session.add(order)
        shop.db.session.flush()
        job = shop.queue.enqueue(shop.ConfirmationEmail(order_id=order.id, to=order.email), queue="vip")
        assert job in shop.db.session() and job.queue == "vip"
        rows = [{"order_id": order.id, "to": f"bulk{i}@example.com"} for i in range(3)]
        assert shop.queue.enqueue_many(shop.ConfirmationEmail, rows, method="copy") == 3
        shop.db.session.commit()
    assert counts(app) == (1, 4)


def test_unique_keys_through_flask_queue_and_db_session(app: Any) -> None:
    with app.app_context():
        order = shop.ShopOrder(product_id=1, quantity=1, email="x@example.com")
        shop.db.session.add(order)
        shop.db.session.flush()
        first = shop.queue.enqueue(shop.ConfirmationEmail(order_id=order.id, to=order.email), unique_key="o:1")
        assert first.inserted and first.job in shop.db.session()
        again = shop.db.session.enqueue(shop.ConfirmationEmail(order_id=order.id, to=order.email), unique_key="o:1")
        assert (again.skipped, again.job_id) == (True, first.job_id)
        rows = [{"order_id": order.id, "to": "bulk@example.com", "unique_key": "o:1"}]
        written = shop.queue.enqueue_many(shop.ConfirmationEmail, rows)
        assert (written, written.skipped) == (0, 1)
        shop.db.session.commit()
    assert counts(app) == (1, 1)


def test_module_functions_accept_db_session(app: Any, listener: Any, server: Server) -> None:
    """``db.session`` is a scoped_session: it stands for the session of the current scope."""
    from sqlalchemy import insert

    from sqla_queue import enqueue, enqueue_many, notify_on_commit, queue_table

    channel = queue_table(shop.ConfirmationEmail).channel
    listener.execute(f'LISTEN "{channel}"')
    listener.execute(f'LISTEN "{SENTINEL_CHANNEL}"')
    with app.app_context():
        order = shop.ShopOrder(product_id=1, quantity=1, email="x@example.com")
        shop.db.session.add(order)
        shop.db.session.flush()
        job = enqueue(shop.db.session, shop.ConfirmationEmail(order_id=order.id, to=order.email))
        assert job in shop.db.session()
        assert enqueue_many(shop.db.session, shop.ConfirmationEmail, [{"order_id": order.id, "to": "b@x.org"}]) == 1
        shop.db.session.execute(insert(shop.ConfirmationEmail).values(order_id=order.id, to="c@x.org", queue="core"))
        notify_on_commit(shop.db.session, shop.ConfirmationEmail, "core")
        shop.db.session.commit()
    assert counts(app) == (1, 3)
    assert sorted(notifications_until_sentinel(listener, server.conninfo)) == [(channel, "core"), (channel, "default")]


def _flask(
    *args: str, env: dict[str, str], fresh: bool = False
) -> subprocess.CompletedProcess[str] | console.Result:
    """``python -m flask --app examples/flask_shop.py queue ARGS``. ``fresh``: in a new
    interpreter, as typed; else in a process forked from one that imported Flask and
    SQLAlchemy already (``tests/console.py``)."""
    command = [sys.executable, "-m", "flask", "--app", str(EXAMPLE), "queue", *args]
    if not fresh:
        return console.run(command, REPO, {**os.environ, **env}, timeout=90)
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, env={**os.environ, **env}, timeout=90,
                          check=False)


@pytest.mark.system
def test_flask_queue_worker_logs(app: Any, server: Server, tmp_path: Path) -> None:
    response = app.test_client().post("/orders", json={"product_id": 1, "quantity": 1, "email": "a@example.com"})
    assert response.status_code == 201
    env = {"DATABASE_URL": server.url.render_as_string(hide_password=False), "SHOP_OUTBOX": str(tmp_path)}

    quiet = _flask("worker", "--until-idle", "--log-level", "warning", env=env, fresh=True)  # as typed
    assert quiet.returncode == 0, quiet.stderr
    assert " INFO sqla_queue." not in quiet.stderr  # the level is honoured
    assert counts(app) == (1, 1)
    with app.app_context():
        assert shop.db.session.scalar(select(shop.ConfirmationEmail.status)) == "done"

    app.test_client().post("/orders", json={"product_id": 1, "quantity": 1, "email": "b@example.com"})
    loud = _flask("worker", "--until-idle", env=env)  # default INFO
    assert loud.returncode == 0, loud.stderr
    assert re.search(r"^\S+ \S+ INFO sqla_queue\.\S+ \[\d+\] ", loud.stderr, re.M), loud.stderr


BEYOND_BIGINT = "99999999999999999999"


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["show", BEYOND_BIGINT], "not a job id (out of range"),
        (["cancel", "--id", BEYOND_BIGINT], "not a job id (out of range"),
        (["requeue", "--id", BEYOND_BIGINT], "not a job id (out of range"),
        (["delete", "--id", BEYOND_BIGINT], "not a job id (out of range"),
        (["jobs", "--before", BEYOND_BIGINT], "not a job id (out of range"),
        (["prune", "--older-than", "99999999d"], "age too long"),
        (["prune", "--older-than", "7"], "give the unit of '7'"),
        (["worker", "--retention", "99999999d"], "age too long"),
        (["requeue"], "name the jobs to requeue"),
    ],
)
def test_flask_queue_refuses_what_the_server_would(app: Any, args: list[str], problem: str) -> None:
    """A usage error (exit 2, no traceback) before any statement, and nothing changed."""
    client = app.test_client()
    assert client.post("/orders", json={"product_id": 1, "quantity": 1, "email": "a@example.com"}).status_code == 201
    result = app.test_cli_runner().invoke(args=["queue", *args])
    assert result.exit_code == 2, result.output
    assert problem in result.output and "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)  # click's usage error, not a DataError
    assert counts(app) == (1, 1)
    with app.app_context():
        assert shop.db.session.scalars(select(shop.ConfirmationEmail.status)).all() == ["pending"]


def test_flask_queue_help_version_and_option_names(app: Any) -> None:
    runner = app.test_cli_runner()
    version = runner.invoke(args=["queue", "--version"])
    assert version.exit_code == 0 and version.output == f"sqla_queue {sqla_queue.__version__}\n"
    for command in ("worker", "prune"):
        shown = runner.invoke(args=["queue", command, "--help"]).output
        assert "PARSE_" not in shown and "parse_" not in shown, shown
    shown = runner.invoke(args=["queue", "worker", "--help"]).output
    assert "--lease DURATION" in shown and "--heartbeat-interval, --heartbeat DURATION" in shown
    assert "--older-than AGE" in runner.invoke(args=["queue", "prune", "--help"]).output
    refused = runner.invoke(args=["queue", "worker", "--lease", "1s", "--heartbeat-interval", "2s"])
    assert refused.exit_code == 2 and "must be shorter than the lease" in refused.output


@pytest.mark.system
def test_flask_queue_worker_refuses_bad_options(app: Any, server: Server) -> None:
    env = {"DATABASE_URL": server.url.render_as_string(hide_password=False)}
    for args, problem in [
        (["--concurrency", "0"], "--concurrency"),
        (["--lease", "1s", "--heartbeat", "2s"], "must be shorter than the lease"),
        (["--queue", ""], "a queue name must be a non-empty string"),
        (["--log-level", "LOUD"], "--log-level"),
        (["--metrics-port", "0"], "--metrics-port"),
    ]:
        result = _flask("worker", "--until-idle", *args, env=env)
        assert result.returncode == 2, (args, result.stderr)
        assert problem in result.stderr and "Traceback" not in result.stderr, (args, result.stderr)


def _docs_flask_example() -> str:
    """The Flask snippet of the documentation (docs/get-started/flask.md, docs/guides/flask.md)."""
    source = (REPO / "examples" / "docs" / "flask_app.py").read_text()
    block = re.search(r"^# --8<-- \[start:app\]\n(.*?)^# --8<-- \[end:app\]", source, re.S | re.M)
    assert block, "examples/docs/flask_app.py needs its app section"
    return block.group(1)


@pytest.mark.system
def test_docs_flask_example_passes_mypy_strict(tmp_path: Path) -> None:
    example = tmp_path / "docs_flask_example.py"
    example.write_text(_docs_flask_example())
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", str(example)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        # this checkout's sqla_queue, whatever the environment has installed
        env={**os.environ, "MYPYPATH": str(REPO)},
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "queue.enqueue(" in example.read_text()  # the typed way is the one shown


def test_flask_queue_cancel_and_requeue_cancelled(app: Any) -> None:
    client = app.test_client()
    assert client.post("/orders", json={"product_id": 1, "quantity": 1, "email": "c@example.com"}).status_code == 201
    runner = app.test_cli_runner()
    refused = runner.invoke(args=["queue", "cancel"])
    assert refused.exit_code != 0 and "give --id or --queue" in refused.output
    with app.app_context():
        (job_id,) = shop.db.session.scalars(select(shop.ConfirmationEmail.id)).all()
    cancelled = runner.invoke(args=["queue", "cancel", "--id", str(job_id)])
    assert cancelled.exit_code == 0 and "cancelled 1 job(s)" in cancelled.output, cancelled.output
    again = runner.invoke(args=["queue", "requeue", "--status", "cancelled"])
    assert again.exit_code == 0 and "requeued 1 cancelled job(s)" in again.output, again.output
    worker = runner.invoke(args=["queue", "worker", "--until-idle", "--concurrency", "1", "--timeout", "30s"])
    assert worker.exit_code == 0, worker.output
    with app.app_context():
        assert shop.db.session.scalar(select(shop.ConfirmationEmail.status)) == "done"


def test_flask_queue_inspection_commands(app: Any) -> None:
    """``flask queue jobs|show|requeue|delete``: the filters of ``sqla-queue``, one value and several."""
    client = app.test_client()
    for email in ("a@example.com", "b@undeliverable.example", "c@undeliverable.example"):
        assert client.post("/orders", json={"product_id": 1, "quantity": 1, "email": email}).status_code == 201
    runner = app.test_cli_runner()
    assert runner.invoke(args=["queue", "worker", "--until-idle", "--concurrency", "1"]).exit_code == 0
    with app.app_context():
        jobs = {j.to: j.id for j in shop.db.session.scalars(select(shop.ConfirmationEmail))}

    def ids(*args: str) -> list[int]:
        result = runner.invoke(args=["queue", "jobs", *args])
        assert result.exit_code == 0, result.output
        lines = result.output.splitlines()
        return [] if lines == ["(no jobs)"] else [int(line.split()[0]) for line in lines[2:]
                                                  if not line.startswith("(more")]

    a, b, c = jobs["a@example.com"], jobs["b@undeliverable.example"], jobs["c@undeliverable.example"]
    assert ids() == [c, b, a]
    assert ids("--status", "failed") == [c, b]
    assert ids("--status", "failed", "--status", "done") == [c, b, a]
    assert ids("--queue", "default") == [c, b, a]
    assert ids("--queue", "default", "--queue", "other", "--error", "C@UNDELIVERABLE") == [c]
    paged = runner.invoke(args=["queue", "jobs", "--limit", "1"])
    assert f"(more: --before {c})" in paged.output
    assert ids("--limit", "1", "--before", str(c)) == [b]

    show = runner.invoke(args=["queue", "show", str(b)])
    assert show.exit_code == 0 and "b@undeliverable.example" in show.output
    assert "Undeliverable: mail server refused b@undeliverable.example" in show.output
    assert runner.invoke(args=["queue", "show", "424242"]).exit_code != 0
    assert "not a job id" in runner.invoke(args=["queue", "show", "x"]).output
    named = runner.invoke(args=["queue", "show", "confirmation_email", str(b)])  # NAME ID, as other commands
    assert named.exit_code == 0 and named.output == show.output
    assert runner.invoke(args=["queue", "show", "--table", "confirmation_email", str(b)]).output == show.output
    assert "no worker named 'nope'" in runner.invoke(args=["queue", "show", "nope", str(b)]).output
    assert runner.invoke(args=["queue", "show"]).exit_code == 2
    assert runner.invoke(args=["queue", "show", "confirmation_email", str(b), "1"]).exit_code == 2

    requeue = runner.invoke(args=["queue", "requeue", "--error", "c@undeliverable"])
    assert requeue.exit_code == 0 and "requeued 1" in requeue.output
    requeue = runner.invoke(args=["queue", "requeue", "--id", str(a), "--id", str(b)])
    assert "requeued 1" in requeue.output  # a is done, not a dead letter
    assert "no task column" in runner.invoke(args=["queue", "requeue", "--task", "x"]).output
    delete = runner.invoke(args=["queue", "delete"])
    assert delete.exit_code != 0 and "name the jobs to delete" in delete.output
    delete = runner.invoke(args=["queue", "delete", "--status", "done", "--status", "pending", "--queue", "default"])
    assert delete.exit_code == 0 and "deleted 3 job(s)" in delete.output
    assert ids() == []


def test_flask_queue_dashboard_answers_only_its_trusted_hosts(app: Any) -> None:
    app.secret_key = "test"
    app.register_blueprint(shop.queue.dashboard(auth=lambda: True, trusted_hosts=["shop.example"]),
                           url_prefix="/queue")
    client = app.test_client()
    assert client.get("/queue/", headers={"Host": "shop.example"}).status_code == 200
    assert client.get("/queue/", headers={"Host": "attacker.example"}).status_code == 400


def test_flask_queue_dashboard_is_a_blueprint_behind_the_apps_auth(app: Any) -> None:
    app.secret_key = "test"
    allowed = {"yes": False}
    app.register_blueprint(shop.queue.dashboard(auth=lambda: allowed["yes"]), url_prefix="/queue")
    client = app.test_client()
    assert client.post("/orders", json={"product_id": 1, "quantity": 1, "email": "a@x.example"}).status_code == 201
    assert client.get("/queue/").status_code == 403
    allowed["yes"] = True
    page = client.get("/queue/confirmation_email/jobs").get_data(as_text=True)
    assert 'data-id="1"' in page
    detail = client.get("/queue/confirmation_email/job/1").get_data(as_text=True)
    assert "a@x.example" in detail and "<dt>order_id</dt>" in detail
    token = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert token
    cancel = client.post("/queue/confirmation_email/action", headers={"Origin": "http://localhost"},
                         data={"csrf_token": token.group(1), "action": "cancel", "id": "1"})
    assert cancel.status_code == 302
    with app.app_context():
        assert shop.db.session.get(shop.ConfirmationEmail, 1).status == "cancelled"


def _tables_app(server: Server) -> Any:
    from .flask_tables_app import create_app

    return create_app(server.url.render_as_string(hide_password=False))


def _fill_two_tables(engine: Any, n: int) -> None:
    from sqlalchemy import insert

    from .helpers import table_of
    from .models import EmailJob, Task

    with engine.begin() as conn:
        conn.execute(insert(table_of(Task)), [{"task": "report", "payload": {"name": f"r{i}"}} for i in range(n)])
        conn.execute(insert(table_of(EmailJob)), [{"recipient": f"m{i}@example.com"} for i in range(n)])


def _effects(engine: Any) -> list[tuple[str, str]]:
    from .helpers import table_of
    from .models import Effect

    effects = table_of(Effect)
    with engine.connect() as conn:
        return sorted((row.worker, row.note) for row in conn.execute(select(effects.c.worker, effects.c.note)))


def test_flask_queue_worker_without_a_name_runs_every_registered_worker(engine: Any, server: Server) -> None:
    app = _tables_app(server)
    runner = app.test_cli_runner()
    _fill_two_tables(engine, 2)
    one = runner.invoke(args=["queue", "worker", "mail", "--until-idle"])  # NAME: that worker alone
    assert one.exit_code == 0, one.output
    assert _effects(engine) == [("email", "m0@example.com"), ("email", "m1@example.com")]
    every = runner.invoke(args=["queue", "worker", "--until-idle", "--concurrency", "1"])
    assert every.exit_code == 0, every.output
    assert _effects(engine) == [("email", "m0@example.com"), ("email", "m1@example.com"),
                                ("report", "r0"), ("report", "r1")]
    with app.app_context():
        app.extensions["sqlalchemy"].engine.dispose()


@pytest.mark.system
def test_flask_queue_worker_serves_every_table_in_one_process_and_stops_on_sigterm(
    engine: Any, server: Server, tmp_path: Path
) -> None:
    import signal

    from .helpers import wait_for

    _fill_two_tables(engine, 3)
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "flask", "--app", "tests.flask_tables_app", "queue", "worker"],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
        )
        try:
            wait_for(lambda: len(_effects(engine)) == 6, timeout=60, what="both tables' jobs done")
            process.send_signal(signal.SIGTERM)
            assert process.wait(30) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    text = log.read_text()
    assert "table=tasks" in text and "table=email_jobs" in text
    assert text.count(" stopped: ") == 2, text
