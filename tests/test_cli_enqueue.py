"""``sqla-queue enqueue``: one job from the command line, checked as ``enqueue_values()``
checks it, on a task table and a typed one; refused arguments write nothing."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine, func, select

from sqla_queue.cli import main

from .helpers import Server, table_of
from .models import EmailJob, Task

TASKS = table_of(Task)
JOBS = table_of(EmailJob)


@pytest.fixture
def url(server: Server) -> str:
    return server.url.render_as_string(hide_password=False)


def rows(engine: Engine, table: Any) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(table).order_by(table.c.id)))


def test_a_task_with_its_payload_and_every_option(engine: Engine, url: str, capsys: Any) -> None:
    assert main([
        "enqueue", "tests.models:Task", "send_receipt", "--url", url, "--json", '{"to": "ada", "n": [1, 2]}',
        "--queue", "emails", "--priority", "-5", "--max-attempts", "3", "--delay", "1h", "--timeout", "30s",
    ]) == 0
    (job,) = rows(engine, TASKS)
    assert capsys.readouterr().out == f"enqueued job {job.id}\n"
    assert (job.task, job.payload, job.queue, job.priority, job.max_attempts, job.timeout) == (
        "send_receipt", {"to": "ada", "n": [1, 2]}, "emails", -5, 3, 30.0)
    with engine.connect() as conn:
        delay = conn.scalar(select(func.extract("epoch", TASKS.c.run_after - func.now())))
    assert delay is not None and 3500 < float(delay) <= 3600


def test_a_typed_job_s_columns_and_a_unique_key(engine: Engine, url: str, capsys: Any) -> None:
    args = ["enqueue", "tests.models:EmailJob", "--url", url, "--json", '{"recipient": "bo@example.com"}',
            "--unique-key", "welcome:bo"]
    assert main(args) == 0
    (job,) = rows(engine, JOBS)
    assert (job.recipient, job.unique_key) == ("bo@example.com", "welcome:bo")
    assert main(args) == 0
    assert capsys.readouterr().out.splitlines() == [f"enqueued job {job.id}",
                                                    f"skipped: job {job.id} holds the key 'welcome:bo'"]
    assert len(rows(engine, JOBS)) == 1


@pytest.mark.parametrize(("args", "error"), [
    (["tests.models:Task", "t", "--json", "{oops"], "argument --json: not JSON"),
    (["tests.models:Task", "t", "--json", "[1, 2]"], "a JSON object is needed, got list"),
    (["tests.models:Task"], "is a task table: name the TASK"),
    (["tests.models:EmailJob", "t"], "has no task column"),
    (["tests.models:EmailJob", "--json", '{"recipent": "x"}'], "recipent"),
    (["tests.models:Task", "t", "--json", '{"bad": "\\u0000"}'], "\\u0000"),
])
def test_refused_arguments_exit_2_and_write_nothing(
    engine: Engine, url: str, capsys: Any, args: list[str], error: str
) -> None:
    assert main(["enqueue", *args, "--url", url]) == 2
    assert error in capsys.readouterr().err
    assert rows(engine, TASKS) == [] and rows(engine, JOBS) == []


@pytest.mark.parametrize("flag", [["--priority", "x"], ["--max-attempts", "0"], ["--delay", "-1s"], ["--queue", ""]])
def test_bad_option_values_are_usage_errors(url: str, capsys: Any, flag: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["enqueue", "tests.models:Task", "t", "--url", url, *flag])
    assert exit_.value.code == 2


def test_a_worker_target_checks_the_task_and_its_payload_against_its_function(
    engine: Engine, capsys: Any
) -> None:
    target = "tests.worker_app:make_worker"  # its Tasks registry runs greet(job, *, name, times=1)
    assert main(["enqueue", target, "greet", "--json", '{"name": "ada"}']) == 0
    for task, payload, error in [
        ("greet", '{"name": "ada", "nom": "ada"}', "unexpected keyword argument 'nom'"),
        ("greet", "{}", "missing a required argument: 'name'"),
        ("nope", "{}", "unknown task 'nope'"),
    ]:
        assert main(["enqueue", target, task, "--json", payload]) == 2
        assert error in capsys.readouterr().err
    assert [(job.task, job.payload) for job in rows(engine, TASKS)] == [("greet", {"name": "ada"})]
    # A task that reads job.payload itself takes any payload, as a model TARGET does.
    assert main(["enqueue", target, "work", "--json", '{"sleep": 0}']) == 0
