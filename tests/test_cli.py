"""The ``sqla-queue`` administrative commands, run as a user runs them."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, func, insert, select, text, update
from sqlalchemy.orm import sessionmaker

import sqla_queue
from sqla_queue import QueueSession, WorkerStartError, admin
from sqla_queue.cli import build_parser, main, parse_duration, worker_overrides

from .helpers import Server, table_of, wait_for
from .models import Effect, EmailJob, Task

JOBS = table_of(EmailJob)
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def url(server: Server) -> str:
    return server.url.render_as_string(hide_password=False)


def statuses(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return dict(conn.execute(select(JOBS.c.status, func.count()).group_by(JOBS.c.status)).all())


def test_stats(engine: Engine, url: str, capsys: Any) -> None:
    with engine.begin() as conn:
        rows = [{"queue": "mail", "status": "pending"}] * 3 + [{"queue": "mail", "status": "failed"}]
        conn.execute(insert(JOBS), rows)
    assert main(["stats", "tests.models:EmailJob", "--url", url]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["queue", "status", "jobs", "oldest", "runnable"]
    assert out[2].split()[:3] == ["mail", "failed", "1"]
    assert out[3].split()[:3] == ["mail", "pending", "3"]


def test_stats_as_json(engine: Engine, url: str, capsys: Any) -> None:
    with engine.begin() as conn:
        rows = [{"queue": "mail", "status": "pending"}] * 3 + [{"queue": "mail", "status": "failed"}]
        conn.execute(insert(JOBS), rows)
        conn.execute(insert(JOBS), [{"queue": "sms", "status": "done"}])
    assert main(["stats", "tests.models:EmailJob", "--url", url, "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["table"] == "email_jobs" and isinstance(found["dead_tuples"], int)
    counts = {(q["queue"], q["status"]): q["jobs"] for q in found["queues"]}
    assert counts == {("mail", "pending"): 3, ("mail", "failed"): 1, ("sms", "done"): 1}
    [pending] = [q for q in found["queues"] if q["status"] == "pending"]
    assert pending["oldest_runnable_seconds"] >= 0
    assert all(q["oldest_runnable_seconds"] is None for q in found["queues"] if q["status"] != "pending")


def test_stats_of_two_tables(engine: Engine, url: str, capsys: Any) -> None:
    with engine.begin() as conn:
        conn.execute(insert(JOBS), [{"queue": "mail", "status": "pending"}] * 2)
        conn.execute(insert(table_of(Task)), [{"task": "t", "queue": "reports", "status": "failed"}])
    models = ["tests.models:EmailJob", "tests.models:Task"]
    assert main(["stats", *models, "--url", url]) == 0
    email, tasks = capsys.readouterr().out.split("\n\n")
    assert email.splitlines()[0] == "== email_jobs ==" and email.splitlines()[3].split()[:3] == ["mail", "pending", "2"]
    assert tasks.splitlines()[0] == "== tasks ==" and tasks.splitlines()[3].split()[:3] == ["reports", "failed", "1"]
    assert main(["stats", *models, "--url", url, "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert [(one["table"], [(q["queue"], q["jobs"]) for q in one["queues"] if q["jobs"]]) for one in found] == [
        ("email_jobs", [("mail", 2)]), ("tasks", [("reports", 1)])
    ]


def test_sweep_requeue_prune(engine: Engine, url: str, capsys: Any) -> None:
    with engine.begin() as conn:
        conn.execute(insert(JOBS).values(status="running", lease_owner="gone", attempts=1), [{"queue": "q"}] * 2)
        conn.execute(insert(JOBS).values(status="failed", attempts=5), [{"queue": "q"}])
        conn.execute(insert(JOBS).values(status="done"), [{"queue": "q"}] * 4)
        conn.execute(update(JOBS).values(lease_expires_at=func.now() - timedelta(seconds=5)))
        conn.execute(
            update(JOBS).where(JOBS.c.status == "done").values(finished_at=func.now() - timedelta(days=9))
        )
    assert main(["sweep", "tests.models:EmailJob", "--url", url]) == 0
    assert "swept 2 expired lease(s): 2 back to pending" in capsys.readouterr().out
    assert main(["requeue", "tests.models:EmailJob", "--url", url, "--queue", "q"]) == 0
    assert "requeued 1" in capsys.readouterr().out
    assert main(["prune", "tests.models:EmailJob", "--url", url, "--older-than", "7d", "--limit", "3"]) == 0
    assert "pruned 4 finished job(s)" in capsys.readouterr().out
    assert statuses(engine) == {"pending": 3}


def test_worker_target_gives_engine_and_model(engine: Engine, capsys: Any) -> None:
    assert main(["stats", "tests.worker_app:make_worker"]) == 0
    assert "(no jobs)" in capsys.readouterr().out


def test_bad_targets_get_one_clear_line(url: str, capsys: Any) -> None:
    assert main(["stats", "tests.models", "--url", url]) == 2
    assert "module:attribute" in capsys.readouterr().err
    assert main(["stats", "tests.nowhere:X", "--url", url]) == 2
    assert "cannot import 'tests.nowhere'" in capsys.readouterr().err
    assert main(["worker", "tests.models:EmailJob"]) == 2
    err = capsys.readouterr().err
    assert "is not a sqla_queue.Worker or" in err and "AsyncWorker" in err
    assert main(["worker", "tests.models:all_tables"]) == 2
    err = capsys.readouterr().err
    assert "returned list, not a sqla_queue.Worker or" in err and "AsyncWorker" in err
    assert main(["stats", "tests.models:Order", "--url", url]) == 2
    assert "'orders' is not a queue table" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "seconds"), [("90", 90), ("90s", 90), ("15m", 900), ("12h", 43200), ("7d", 604800), ("1.5h", 5400)]
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text).total_seconds() == seconds


@pytest.mark.system
def test_console_script_help_lists_the_commands() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sqla_queue.cli", "--help"], capture_output=True, text=True, cwd=REPO, check=True
    )
    commands = (
        "worker", "sweep", "stats", "requeue", "cancel", "pause", "resume", "prune", "jobs", "show", "delete",
        "dashboard", "schedules", "alembic", "enqueue", "limit", "workers",
    )
    for command in commands:
        assert command in result.stdout


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """``python -m sqla_queue ARGS`` in a process of its own, as a user types it."""
    return subprocess.run(
        [sys.executable, "-m", "sqla_queue", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        timeout=60,
        check=False,
    )


@pytest.mark.system
def test_python_dash_m_is_the_console_script(url: str) -> None:
    script = Path(sys.executable).parent / "sqla-queue"
    assert script.exists(), f"the package is not installed: no {script}"
    for args in (["--help"], ["stats", "tests.models:EmailJob", "--url", url], ["worker", "x:y", "--concurrency", "0"]):
        by_module = run_cli(*args)
        by_script = subprocess.run(
            [str(script), *args], capture_output=True, text=True, cwd=REPO, timeout=60, check=False
        )
        # The ages stats prints move on between the two runs: compare all but them.
        ages = re.compile(r"\b\d+(?:\.\d+)?(?:s|m|h|d)\b")
        assert (by_module.returncode, ages.sub("<age>", by_module.stdout), by_module.stderr) == (
            by_script.returncode,
            ages.sub("<age>", by_script.stdout),
            by_script.stderr,
        )
    assert by_module.returncode == 2  # the last one is a usage error: both really ran the CLI


WORKER = "tests.worker_app:make_worker"
MODEL = "tests.models:EmailJob"


@pytest.mark.system
@pytest.mark.parametrize(
    ("args", "env", "problem"),
    [
        (["worker", WORKER, "--lease", "1s", "--heartbeat", "2s"], {}, "must be shorter than the lease"),
        (["worker", WORKER, "--heartbeat", "90s"], {}, "must be shorter than the lease (60.0s)"),  # the worker's
        (["worker", WORKER, "--concurrency", "0"], {}, "argument --concurrency: must be at least 1"),
        (["worker", WORKER, "--batch-size", "-3"], {}, "argument --batch-size"),
        (["worker", WORKER, "--metrics-port", "0"], {}, "argument --metrics-port: must be at least 1"),
        (["worker", WORKER, "--metrics-port", "70000"], {}, "metrics_port must be a TCP port (1-65535)"),
        (["worker", WORKER, "--lease", "0s"], {}, "argument --lease: must be longer than 0"),
        (["worker", WORKER, "--queue", ""], {}, "argument --queue: a queue name must be a non-empty string"),
        (["worker", WORKER, "--queue", "a", "--queue", "sqla_queue.swept:a"], {}, "which sqla_queue reserves"),
        (["sweep", MODEL, "--url", "{url}", "--limit", "0"], {}, "argument --limit: must be at least 1"),
        (["prune", MODEL, "--url", "{url}", "--older-than", "99999999999d"], {}, "duration too long"),
        (["prune", MODEL, "--url", "{url}", "--older-than", "-1d"], {}, "argument --older-than"),
        (["prune", MODEL, "--url", "{url}", "--older-than=-1d"], {}, "must not be negative"),
        (["prune", MODEL, "--url", "{url}", "--older-than", "soon"], {}, "not a duration: 'soon'"),
        (["stats", MODEL, "--url", "not a url"], {}, "argument --url: not a usable database URL"),
        (["stats", MODEL, "--url", "mysql://h/db"], {}, "needs PostgreSQL, not 'mysql'"),
        (["stats", MODEL, "--url", "postgresql+nodriver://h/db"], {}, "argument --url: not a usable database URL"),
        (["stats", MODEL], {"DATABASE_URL": "not a url"}, "DATABASE_URL: not a usable database URL"),
        (["--log-level", "LOUD", "stats", MODEL, "--url", "{url}"], {}, "argument --log-level: unknown level 'LOUD'"),
        (["stats", MODEL, "--url", "{url}", "--log-level", "LOUD"], {}, "argument --log-level: unknown level 'LOUD'"),
        (["requeue", MODEL, "--url", "{url}", "--queue", ""], {}, "argument --queue"),
    ],
)
def test_mistakes_are_one_line_usage_errors(url: str, args: list[str], env: dict[str, str], problem: str) -> None:
    _check_one_line_usage_error(run_cli(*(a.replace("{url}", url) for a in args), env=env), problem)


BEYOND_BIGINT = "99999999999999999999"


@pytest.mark.system
@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["show", MODEL, "--url", "{url}", BEYOND_BIGINT], "argument ID: not a job id (out of range"),
        (["show", MODEL, "--url", "{url}", "-9223372036854775809"], "argument ID: not a job id (out of range"),
        (["cancel", MODEL, "--url", "{url}", "--id", BEYOND_BIGINT], "argument --id: not a job id (out of range"),
        (["requeue", MODEL, "--url", "{url}", "--id", BEYOND_BIGINT], "argument --id: not a job id (out of range"),
        (["delete", MODEL, "--url", "{url}", "--id", BEYOND_BIGINT], "argument --id: not a job id (out of range"),
        (["jobs", MODEL, "--url", "{url}", "--before", BEYOND_BIGINT], "argument --before: not a job id (out of"),
        (["prune", MODEL, "--url", "{url}", "--older-than", "99999999d"], "argument --older-than: age too long"),
        (["prune", MODEL, "--url", "{url}", "--older-than", "7"], "argument --older-than: give the unit of '7'"),
        (["worker", WORKER, "--retention", "99999999d"], "argument --retention: age too long"),
        (["worker", WORKER, "--retention", "failed=30"], "argument --retention: give the unit of '30'"),
        (["requeue", MODEL, "--url", "{url}"], "name the jobs to requeue"),
    ],
)
def test_values_the_server_would_refuse_are_one_line_usage_errors(
    engine: Engine, url: str, args: list[str], problem: str
) -> None:
    """Refused before any statement: the server's DataError would be a traceback."""
    with engine.begin() as conn:
        conn.execute(insert(JOBS).values(queue="q", status="failed"))
        conn.execute(insert(JOBS).values(queue="q", status="done", finished_at=func.now() - timedelta(days=9)))
    _check_one_line_usage_error(run_cli(*(a.replace("{url}", url) for a in args)), problem)
    with engine.connect() as conn:  # nothing changed
        assert sorted(conn.execute(select(JOBS.c.status)).scalars()) == ["done", "failed"]


def test_largest_bigint_id_is_a_job_id_not_found(engine: Engine, url: str, capsys: Any) -> None:
    assert main(["show", MODEL, "--url", url, "9223372036854775807"]) == 1
    assert "no job 9223372036854775807" in capsys.readouterr().err


def test_version(capsys: Any) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"sqla-queue {sqla_queue.__version__}\n"


def test_heartbeat_interval_is_the_worker_options_name() -> None:
    assert build_parser().parse_args(["worker", WORKER, "--heartbeat-interval", "5s"]).heartbeat == 5.0
    assert build_parser().parse_args(["worker", WORKER, "--heartbeat", "5s"]).heartbeat == 5.0  # the short alias
    assert worker_overrides(heartbeat=5.0) == {"heartbeat_interval": 5.0}


def _check_one_line_usage_error(result: subprocess.CompletedProcess[str], problem: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("sqla-queue") and ": error: " in lines[0]
    assert problem in lines[0]
    assert result.stdout == ""


@pytest.mark.parametrize(
    "argv",
    [
        ["--log-level", "debug", "stats", MODEL],
        ["stats", MODEL, "--log-level", "debug"],
        ["--log-level", "error", "worker", WORKER, "--log-level", "DEBUG"],
        ["alembic", "init", "migrations", "--log-level", "DEBUG"],
    ],
)
def test_log_level_is_taken_before_and_after_the_subcommand(argv: list[str]) -> None:
    assert build_parser().parse_args(argv).log_level == logging.DEBUG


def test_log_level_defaults_to_info() -> None:
    assert build_parser().parse_args(["stats", MODEL]).log_level == logging.INFO


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _parsers(sub)
    return found


def test_help_is_plain_text() -> None:
    parsers = _parsers(build_parser())
    assert len(parsers) == 19  # the main parser, its seventeen commands, alembic init
    for parser in parsers:
        text = parser.format_help()
        for markup in ("``", ":class:", ":func:", ":mod:", ":meth:"):
            assert markup not in text, f"{parser.prog} --help shows {markup!r}"


def _one_line_start_failure(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("sqla-queue: error: ")
    return lines[0]


@pytest.mark.system
def test_worker_on_a_missing_database_fails_at_start_in_one_line(server: Server) -> None:
    missing = f"sqla_queue_absent_{uuid.uuid4().hex[:10]}"
    bad_url = server.url.set(database=missing).render_as_string(hide_password=False)
    result = run_cli("worker", WORKER, "--until-idle", env={"SQLA_QUEUE_TEST_URL": bad_url})
    line = _one_line_start_failure(result)
    assert f'database "{missing}" does not exist' in line


@pytest.mark.system
def test_worker_on_a_missing_table_fails_at_start_in_one_line(engine: Engine, url: str, tmp_path: Path) -> None:
    (tmp_path / "unmigrated_app.py").write_text(
        "import os\n"
        "from sqlalchemy import create_engine\n"
        "from sqlalchemy.orm import DeclarativeBase\n"
        "from sqla_queue import JobMixin, Worker\n"
        "class Base(DeclarativeBase):\n"
        "    pass\n"
        "class NeverCreated(Base, JobMixin):\n"
        "    __tablename__ = 'never_created_jobs'\n"
        "def handle(job):\n"
        "    pass\n"
        "def make_worker():\n"
        "    return Worker(create_engine(os.environ['SQLA_QUEUE_TEST_URL']), NeverCreated, handle)\n"
    )
    result = run_cli(
        "worker",
        "unmigrated_app:make_worker",
        "--until-idle",
        cwd=tmp_path,
        env={"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
    )
    line = _one_line_start_failure(result)
    assert "table 'never_created_jobs' does not exist in that database: create it" in line


UNMIGRATED_APP = """\
import os
from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import DeclarativeBase
from sqla_queue import AsyncWorker, JobMixin, Worker
class Base(DeclarativeBase):
    pass
class NeverCreated(Base, JobMixin):
    __tablename__ = 'never_created_jobs'
class Unmigrated(Base, JobMixin):
    __tablename__ = 'cli_unmigrated_jobs'  # the table predates JobMixin: no queue columns yet
def handle(job):
    pass
async def handle_async(job):
    pass
def worker(model):
    return Worker(create_engine(os.environ['SQLA_QUEUE_TEST_URL']), model, handle)
def async_worker(model):
    return AsyncWorker(create_async_engine(os.environ['SQLA_QUEUE_TEST_URL']), model, handle_async)
missing_worker = lambda: worker(NeverCreated)
missing_async_worker = lambda: async_worker(NeverCreated)
unmigrated_worker = lambda: worker(Unmigrated)
unmigrated_async_worker = lambda: async_worker(Unmigrated)
"""

ADMIN_COMMANDS = [["stats"], ["sweep"], ["requeue", "--status", "failed"], ["prune", "--older-than", "7d"]]
PROBLEMS = {
    "missing": "table 'never_created_jobs' does not exist in that database: create it (metadata.create_all",
    "unmigrated": "table 'cli_unmigrated_jobs' lacks the queue columns attempts, created_at, finished_at, "
    "isolated, last_error, lease_expires_at, lease_owner, max_attempts, priority, queue, run_after, "
    "status: migrate it",
}


@pytest.fixture
def unmigrated_app(engine: Engine, tmp_path: Path) -> Iterator[Callable[..., subprocess.CompletedProcess[str]]]:
    """``run(*args)``: the command line in a project whose models' tables are missing
    (``NeverCreated``) or predate JobMixin (``Unmigrated``, a table with an id alone)."""
    (tmp_path / "unmigrated_app.py").write_text(UNMIGRATED_APP)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE cli_unmigrated_jobs (id bigint PRIMARY KEY, note text)"))
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    try:
        yield lambda *args: run_cli(*args, cwd=tmp_path, env=env)
    finally:
        with engine.begin() as conn:
            conn.execute(text("DROP TABLE cli_unmigrated_jobs"))


@pytest.mark.system
@pytest.mark.parametrize("problem", sorted(PROBLEMS))
@pytest.mark.parametrize("command", ADMIN_COMMANDS, ids=lambda c: c[0])
def test_admin_commands_on_an_unusable_table_say_what_to_do(
    unmigrated_app: Callable[..., subprocess.CompletedProcess[str]], url: str, command: list[str], problem: str
) -> None:
    model = "unmigrated_app:NeverCreated" if problem == "missing" else "unmigrated_app:Unmigrated"
    line = _one_line_start_failure(unmigrated_app(command[0], model, "--url", url, *command[1:]))
    assert line.startswith("sqla-queue: error: " + PROBLEMS[problem]), line


@pytest.mark.system
@pytest.mark.parametrize("problem", sorted(PROBLEMS))
@pytest.mark.parametrize("kind", ["worker", "async_worker"])
def test_admin_commands_and_the_worker_say_the_same(
    unmigrated_app: Callable[..., subprocess.CompletedProcess[str]], kind: str, problem: str
) -> None:
    target = f"unmigrated_app:{problem}_{kind}"
    by_worker = _one_line_start_failure(unmigrated_app("worker", target, "--until-idle"))
    assert by_worker.startswith("sqla-queue: error: " + PROBLEMS[problem]), by_worker
    assert _one_line_start_failure(unmigrated_app("stats", target)) == by_worker


def test_table_check_follows_the_schema_translate_map(engine: Engine) -> None:
    """The admin commands' statements honour the engine's ``schema_translate_map``; so does
    the check before them, or it would send them to look for the table elsewhere."""
    schema = f"sqlaq_cli_{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    try:
        translated = engine.execution_options(schema_translate_map={None: schema})
        with pytest.raises(WorkerStartError, match=f"table '{schema}.email_jobs' does not exist"):
            admin.check_table(translated, EmailJob)
        with engine.begin() as conn:
            conn.execute(text(f"CREATE TABLE {schema}.email_jobs (LIKE {JOBS.name} INCLUDING ALL)"))
            conn.execute(text(f"INSERT INTO {schema}.email_jobs (queue, recipient) VALUES ('in-the-schema', 'a@b.c')"))
        admin.check_table(translated, EmailJob)
        assert "in-the-schema" in admin.format_stats(translated, EmailJob)
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))


@pytest.mark.system
def test_admin_command_on_a_missing_database_is_one_line(server: Server) -> None:
    missing = f"sqla_queue_absent_{uuid.uuid4().hex[:10]}"
    bad_url = server.url.set(database=missing).render_as_string(hide_password=False)
    line = _one_line_start_failure(run_cli("stats", MODEL, "--url", bad_url))
    assert "does not exist" in line


@pytest.mark.parametrize("scheme", ["postgresql", "postgres"])
def test_bare_postgres_urls_use_psycopg(engine: Engine, server: Server, scheme: str, capsys: Any) -> None:
    bare = server.url.set(drivername=scheme).render_as_string(hide_password=False)
    assert bare.startswith(f"{scheme}://")
    assert main(["stats", MODEL, "--url", bare]) == 0
    assert "(no jobs)" in capsys.readouterr().out


# -- an AsyncWorker target: run with asyncio.run(worker.run()), the same options apply -------

ASYNC_WORKER = "tests.async_worker_app:make_worker"
TASKS = table_of(Task)


def add_tasks(engine: Engine, n: int, **payload: Any) -> list[int]:
    with sessionmaker(engine, class_=QueueSession)() as session:
        jobs = [session.enqueue(Task(task="record", payload=dict(payload))) for _ in range(n)]
        session.commit()
        return [job.id for job in jobs]


def task_rows(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(TASKS.c.id, TASKS.c.status, TASKS.c.attempts, TASKS.c.lease_owner)))


def effect_notes(engine: Engine) -> dict[int, list[str]]:
    notes: dict[int, list[str]] = {}
    with engine.connect() as conn:
        for job_id, note in conn.execute(select(Effect.job_id, Effect.note)):
            notes.setdefault(job_id, []).append(note)
    return notes


@pytest.mark.system
@pytest.mark.parametrize("target", [ASYNC_WORKER, "tests.async_worker_app:worker"])
def test_worker_runs_an_async_worker_with_the_command_line_options(engine: Engine, target: str) -> None:
    ids = add_tasks(engine, 9, sleep=0.3)
    result = run_cli("worker", target, "--until-idle", "--concurrency", "3", "--batch-size", "1",
                     "--poll-interval", "0.5s")
    assert result.returncode == 0, result.stderr
    assert {(r.id, r.status, r.attempts) for r in task_rows(engine)} == {(i, "done", 1) for i in ids}
    notes = effect_notes(engine)
    assert sorted(notes) == ids and all(len(n) == 1 for n in notes.values())
    # Three handlers ran at once, never more: --concurrency 3, not the default 4.
    assert max(int(n[0].removeprefix("running ")) for n in notes.values()) == 3


def test_admin_commands_take_an_async_worker_target(engine: Engine, capsys: Any) -> None:
    add_tasks(engine, 2)
    assert main(["stats", ASYNC_WORKER]) == 0
    assert "pending" in capsys.readouterr().out


@pytest.mark.system
def test_admin_commands_connect_as_the_async_worker_does(engine: Engine, url: str, tmp_path: Path) -> None:
    """The worker's engine finds its table only through its ``connect_args`` (a
    search_path): an admin command must connect with them too, not from the URL alone."""
    schema = f"sqlaq_cli_{uuid.uuid4().hex[:8]}"
    (tmp_path / "schema_async_app.py").write_text(
        "import os\n"
        "from sqlalchemy.ext.asyncio import create_async_engine\n"
        "from sqlalchemy.orm import DeclarativeBase\n"
        "from sqla_queue import AsyncWorker, JobMixin\n"
        "class Base(DeclarativeBase):\n"
        "    pass\n"
        "class SchemaJob(Base, JobMixin):\n"
        "    __tablename__ = 'cli_schema_jobs'\n"
        "async def handle(job):\n"
        "    pass\n"
        "def make_worker():\n"
        "    engine = create_async_engine(os.environ['SQLA_QUEUE_TEST_URL'],\n"
        f"                                 connect_args={{'options': '-c search_path={schema}'}})\n"
        "    return AsyncWorker(engine, SchemaJob, handle)\n"
    )
    with engine.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
        conn.execute(text(f"CREATE TABLE {schema}.cli_schema_jobs (LIKE {TASKS.name} INCLUDING ALL)"))
        conn.execute(text(f"INSERT INTO {schema}.cli_schema_jobs (task, queue) VALUES ('t', 'in-the-schema')"))
    try:
        result = run_cli(
            "stats",
            "schema_async_app:make_worker",
            cwd=tmp_path,
            env={"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
        )
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
    assert result.returncode == 0, result.stderr
    assert "in-the-schema" in result.stdout


@pytest.mark.system
def test_async_worker_on_a_missing_table_fails_at_start_in_one_line(url: str, tmp_path: Path) -> None:
    (tmp_path / "unmigrated_async_app.py").write_text(
        "import os\n"
        "from sqlalchemy.ext.asyncio import create_async_engine\n"
        "from sqlalchemy.orm import DeclarativeBase\n"
        "from sqla_queue import AsyncWorker, JobMixin\n"
        "class Base(DeclarativeBase):\n"
        "    pass\n"
        "class NeverCreated(Base, JobMixin):\n"
        "    __tablename__ = 'never_created_async_jobs'\n"
        "async def handle(job):\n"
        "    pass\n"
        "def make_worker():\n"
        "    return AsyncWorker(create_async_engine(os.environ['SQLA_QUEUE_TEST_URL']), NeverCreated, handle)\n"
    )
    result = run_cli(
        "worker",
        "unmigrated_async_app:make_worker",
        "--until-idle",
        cwd=tmp_path,
        env={"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
    )
    line = _one_line_start_failure(result)
    assert "never_created_async_jobs" in line and "does not exist" in line


def test_sigterm_lets_a_running_async_job_finish(engine: Engine, worker_processes: Any, tmp_path: Path) -> None:
    started = tmp_path / "started"
    (job_id,) = add_tasks(engine, 1, sleep=1.5, started=str(started))
    worker = worker_processes("--shutdown-grace", "20s", "--poll-interval", "0.5s", target=ASYNC_WORKER)
    wait_for(started.exists, what="the job to start")
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0, worker.log()
    assert [(r.id, r.status) for r in task_rows(engine)] == [(job_id, "done")]
    assert list(effect_notes(engine)) == [job_id]


def test_sigterm_hands_back_an_async_job_that_outlives_the_grace(
    engine: Engine, worker_processes: Any, tmp_path: Path
) -> None:
    started = tmp_path / "started"
    (job_id,) = add_tasks(engine, 1, sleep=60, started=str(started))
    worker = worker_processes("--shutdown-grace", "0.5s", "--poll-interval", "0.5s", target=ASYNC_WORKER)
    wait_for(started.exists, what="the job to start")
    worker.signal(signal.SIGTERM)
    assert worker.wait(15) == 0, worker.log()
    (row,) = task_rows(engine)
    assert (row.id, row.status, row.lease_owner, row.attempts) == (job_id, "pending", None, 1)
    assert not effect_notes(engine)  # the cancelled handler's flushed write rolled back


def test_second_signal_stops_an_async_worker_at_once(
    engine: Engine, worker_processes: Any, tmp_path: Path
) -> None:
    started = tmp_path / "started"
    add_tasks(engine, 1, sleep=60, started=str(started))
    worker = worker_processes("--shutdown-grace", "60s", "--poll-interval", "0.5s", target=ASYNC_WORKER)
    wait_for(started.exists, what="the job to start")
    worker.signal(signal.SIGTERM)
    worker.wait_for_log("finishing running jobs")
    worker.signal(signal.SIGINT)
    assert worker.wait(15) == 0, worker.log()  # long before the 60 s grace
    (row,) = task_rows(engine)
    assert (row.status, row.lease_owner) == ("pending", None)
    assert not effect_notes(engine)


@pytest.mark.system
@pytest.mark.parametrize(
    ("args", "existing_ini", "created"),
    [
        (["migrations"], False, "Created migrations/ (README, env.py, script.py.mako, versions/) and alembic.ini."),
        (
            ["db/migrations/", "--package", "-c", "db.ini"],
            False,
            "Created db/migrations/ (README, __init__.py, env.py, script.py.mako, versions/) and db.ini.",
        ),
        (["migrations"], True, "Created migrations/ (README, env.py, script.py.mako, versions/)."),
    ],
    ids=["new", "package-and-config", "existing-ini"],
)
def test_alembic_init_prints_what_it_created_and_the_next_step(
    tmp_path: Path, args: list[str], existing_ini: bool, created: str
) -> None:
    config = args[args.index("-c") + 1] if "-c" in args else "alembic.ini"
    if existing_ini:
        (tmp_path / config).write_text("[alembic]\nscript_location = %(here)s/migrations\n")
    result = run_cli("alembic", "init", *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # no INFO lines of Alembic's plugin set-up
    folder = args[0].rstrip("/")
    expected = [created]
    if existing_ini:
        expected.append(f"Kept the existing {config}: its script_location must name {folder}.")
    expected += [
        f"Next: set target_metadata in {folder}/env.py and sqlalchemy.url in {config}, then run",
        '  alembic revision --autogenerate -m "queue table"',
        "  alembic upgrade head",
    ]
    assert result.stdout.splitlines() == expected
    assert (tmp_path / folder / "env.py").is_file() and (tmp_path / config).is_file()
    if existing_ini:
        assert (tmp_path / config).read_text().startswith("[alembic]\nscript_location")  # left alone


#: Runs the command after it with SIGINT ignored, as a shell starts a background job.
SIGINT_IGNORED = [
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); os.execv(sys.argv[1], sys.argv[1:])",
]


@pytest.mark.system
def test_sigint_stops_a_worker_started_with_sigint_ignored(tmp_path: Path) -> None:
    """A background job of a non-interactive shell inherits SIGINT ignored: the worker
    restores it at once, so SIGINT stops it even while it still imports its target."""
    started = tmp_path / "importing"
    (tmp_path / "slow_app.py").write_text(
        "import pathlib, time\n"
        f"pathlib.Path({str(started)!r}).write_text('')\n"
        "time.sleep(60)  # a slow import: the worker has not installed its handlers yet\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with subprocess.Popen(
        [*SIGINT_IGNORED, sys.executable, "-m", "sqla_queue", "worker", "slow_app:make_worker"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    ) as proc:
        try:
            wait_for(lambda: started.exists() or proc.poll() is not None, what="the target's import")
            proc.send_signal(signal.SIGINT)
            try:
                out, err = proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                raise AssertionError("SIGINT did not stop the worker") from None
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 130, err
    assert err == "sqla-queue: interrupted\n" and out == ""
