"""``sqla-queue schedules``, ``flask queue schedules`` and the retention flags, as users run them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine

from sqla_queue import Tasks, Worker
from sqla_queue import sql as q
from sqla_queue.cli import build_parser, main, worker_overrides

from .helpers import Server
from .models import Task

TICK = datetime(2026, 6, 1, 12, 0, 5, tzinfo=UTC)


@pytest.fixture
def url(server: Server) -> str:
    return server.url.render_as_string(hide_password=False)


def _watermark(engine: Engine, name: str, tick: datetime) -> None:
    with engine.begin() as conn:
        conn.execute(q.claim_schedule_tick(Task, schedule=name, tick=tick))


@pytest.mark.parametrize("runtime_name", ["thread", "asyncio"])
def test_schedules_lists_each_schedule_with_its_last_and_next_tick(
    engine: Engine, capsys: Any, monkeypatch: pytest.MonkeyPatch, runtime_name: str
) -> None:
    monkeypatch.setenv("SQLA_QUEUE_TEST_RUNTIME", runtime_name)
    _watermark(engine, "beat", TICK)
    _watermark(engine, "gone", TICK - timedelta(days=1))
    assert main(["schedules", "tests.periodic_app:make_worker"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["schedule", "when", "timezone", "last", "tick", "next", "tick"]
    beat, gone = lines[2], lines[3]
    assert beat.split()[:6] == ["beat", "every", "1s", "UTC", "2026-06-01", "12:00:05"]
    assert gone.split()[:4] == ["gone", "(not", "in", "code)"]
    next_tick = datetime.strptime(" ".join(beat.split()[7:9]), "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
    assert abs((next_tick - datetime.now(UTC)).total_seconds()) < 5


def test_schedules_of_a_model_target_are_its_rows(engine: Engine, url: str, capsys: Any) -> None:
    assert main(["schedules", "tests.models:Task", "--url", url]) == 0
    assert capsys.readouterr().out.strip() == "(no schedules)"
    _watermark(engine, "nightly", TICK)
    assert main(["schedules", "tests.models:Task", "--url", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    # A model does not say which schedules its code declares: a live schedule is not
    # called "(not in code)", and the last line says how to see them.
    assert lines[2].split()[:4] == ["nightly", "?", "-", "2026-06-01"]
    assert "not in code" not in "\n".join(lines)
    assert lines[-1] == "(the schedules in code are unknown: give the worker, not the model, to see them)"


@pytest.mark.parametrize(
    ("flags", "retention"),
    [
        (["--retention", "7d"], 7 * 86400.0),
        (["--retention", "failed=30d"], {"failed": 30 * 86400.0}),
        (["--retention", "2d", "--retention", "failed=30d"],
         {"done": 2 * 86400.0, "cancelled": 2 * 86400.0, "failed": 30 * 86400.0}),
    ],
)
def test_retention_flags_become_the_worker_option(engine: Engine, flags: list[str], retention: Any) -> None:
    args = build_parser().parse_args(["worker", "x:y", *flags, "--no-periodic"])
    overrides = worker_overrides(retention=args.retention, no_periodic=args.no_periodic)
    assert overrides == {"retention": retention, "periodic": False}
    worker = Worker(engine, Task, Tasks()).with_options(**overrides)
    assert worker.pruner is not None and worker.config.periodic is False


@pytest.mark.parametrize("value", ["pending=1d", "0s", "soon", "done=", "7", "failed=30", "99999999d"])
def test_bad_retention_flags_are_usage_errors(value: str, capsys: Any) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["worker", "x:y", "--retention", value])
    assert exit_.value.code == 2
    assert "--retention" in capsys.readouterr().err


def test_flask_queue_schedules_and_retention_flags(engine: Engine, server: Server) -> None:
    pytest.importorskip("flask_sqlalchemy")
    from flask import Flask
    from flask_sqlalchemy import SQLAlchemy

    from sqla_queue.flask import FlaskQueue

    app = Flask("periodic_cli")
    app.config["SQLALCHEMY_DATABASE_URI"] = server.url.render_as_string(hide_password=False)
    db = SQLAlchemy(app)
    queue = FlaskQueue(app, db)
    tasks = Tasks()
    tasks.periodic("0 3 * * *", timezone="Europe/Paris")(lambda job: None)
    tasks.periodic(every=60, name="minutely", task="work")(lambda job: None)
    queue.add_worker(Task, tasks, name="tasks")
    _watermark(engine, "minutely", TICK)
    runner = app.test_cli_runner()
    try:
        listed = runner.invoke(args=["queue", "schedules"])
        assert listed.exit_code == 0, listed.output
        rows = {line.split()[0]: line.split() for line in listed.output.splitlines()[2:]}
        assert rows["<lambda>"][1:7] == ["0", "3", "*", "*", "*", "Europe/Paris"]
        assert rows["minutely"][1:6] == ["every", "60s", "UTC", "2026-06-01", "12:00:05"]
        bad = runner.invoke(args=["queue", "worker", "--retention", "pending=1d"])
        assert bad.exit_code == 2 and "not a finished status" in bad.output
        ran = runner.invoke(args=["queue", "worker", "--until-idle", "--no-periodic", "--retention", "7d"])
        assert ran.exit_code == 0, ran.output
    finally:
        with app.app_context():
            db.engine.dispose()
