"""``sqla-queue jobs|show|requeue|delete|dashboard`` through the real parser (``main``),
each filter with one and several values, against real PostgreSQL."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, func, insert, select

from sqla_queue.cli import main

from .helpers import Server, table_of
from .models import EmailJob, Order, ResultTask, Task, UuidJob

JOBS = table_of(EmailJob)
TASKS = table_of(Task)
REPO = Path(__file__).resolve().parent.parent
MODEL = "tests.models:EmailJob"
TASK_MODEL = "tests.models:Task"


@pytest.fixture
def url(server: Server) -> str:
    return server.url.render_as_string(hide_password=False)


def add(engine: Engine, table: Any = JOBS, **values: Any) -> int:
    with engine.begin() as conn:
        return int(conn.execute(insert(table).values(**values).returning(table.c.id)).scalar_one())


def listed(capsys: Any, url: str, *args: str, model: str = MODEL) -> list[int]:
    assert main(["jobs", model, "--url", url, *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    if lines == ["(no jobs)"]:
        return []
    return [int(line.split()[0]) for line in lines[2:] if not line.startswith("(more")]


def statuses(engine: Engine, table: Any = JOBS) -> dict[int, str]:
    with engine.connect() as conn:
        return dict(conn.execute(select(table.c.id, table.c.status)).all())


@pytest.fixture
def jobs(engine: Engine) -> dict[str, int]:
    return {
        "a": add(engine, queue="a"),
        "b_failed": add(engine, queue="b", status="failed", last_error="SMTP timeout after 30s"),
        "c_done": add(engine, queue="c", status="done", last_error="smtp refused: 100% full"),
        "c_failed": add(engine, queue="c", status="failed", last_error="DNS error"),
        "running": add(engine, queue="a", status="running", lease_owner="w:1:ab/0", attempts=1),
    }


def test_jobs_filters_by_queue_status_and_error(engine: Engine, url: str, capsys: Any, jobs: dict[str, int]) -> None:
    j = jobs
    assert listed(capsys, url) == sorted(j.values(), reverse=True)
    assert listed(capsys, url, "--queue", "a") == [j["running"], j["a"]]
    assert listed(capsys, url, "--queue", "a", "--queue", "b") == [j["running"], j["b_failed"], j["a"]]
    assert listed(capsys, url, "--status", "failed") == [j["c_failed"], j["b_failed"]]
    assert listed(capsys, url, "--status", "failed", "--status", "done") == [j["c_failed"], j["c_done"], j["b_failed"]]
    assert listed(capsys, url, "--error", "SMTP") == [j["c_done"], j["b_failed"]]  # case-insensitive
    assert listed(capsys, url, "--error", "100%") == [j["c_done"]]
    assert listed(capsys, url, "--error", "1_0") == []  # _ is literal, not a wildcard
    assert listed(capsys, url, "--queue", "c", "--status", "failed", "--error", "dns") == [j["c_failed"]]
    assert listed(capsys, url, "--queue", "nowhere") == []


def test_jobs_of_two_tables(engine: Engine, url: str, capsys: Any, jobs: dict[str, int]) -> None:
    failed_task = add(engine, TASKS, task="report", status="failed", last_error="boom")
    add(engine, TASKS, task="report")
    assert main(["jobs", MODEL, TASK_MODEL, "--url", url, "--status", "failed"]) == 0
    email, tasks = capsys.readouterr().out.split("\n\n")
    assert email.splitlines()[0] == "== email_jobs =="
    assert sorted(int(line.split()[0]) for line in email.splitlines()[3:]) == [jobs["b_failed"], jobs["c_failed"]]
    assert tasks.splitlines()[0] == "== tasks ==" and [line.split()[0] for line in tasks.splitlines()[3:]] == [
        str(failed_task)
    ]
    assert main(["jobs", MODEL, TASK_MODEL, "--url", url, "--before", "5"]) == 2
    assert "give its TARGET alone" in capsys.readouterr().err


def test_jobs_filters_by_task(engine: Engine, url: str, capsys: Any) -> None:
    resize = add(engine, TASKS, task="resize")
    crop = add(engine, TASKS, task="crop", payload={"w": 10})
    add(engine, TASKS, task="send")
    assert listed(capsys, url, "--task", "crop", model=TASK_MODEL) == [crop]
    assert listed(capsys, url, "--task", "crop", "--task", "resize", model=TASK_MODEL) == [crop, resize]
    assert main(["jobs", TASK_MODEL, "--url", url, "--task", "crop"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["id", "queue", "status", "task", "attempts", "run_after", "last_error"]
    assert "crop" in out


def test_jobs_reads_the_listed_columns_only(engine: Engine, url: str, capsys: Any,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A listing never reads the payloads it does not show (megabytes each, maybe)."""
    from sqla_queue import admin

    add(engine, TASKS, task="crop", payload={"blob": "x" * 100_000})
    read: list[list[str]] = []
    list_jobs = admin.list_jobs

    def spy(*args: Any, **kwargs: Any) -> Any:
        page = list_jobs(*args, **kwargs)
        read.append(page.columns)
        return page

    monkeypatch.setattr(admin, "list_jobs", spy)
    assert main(["jobs", TASK_MODEL, "--url", url]) == 0
    assert "crop" in capsys.readouterr().out
    assert read == [["id", "queue", "status", "task", "attempts", "max_attempts", "run_after", "last_error"]]


def test_task_filter_on_a_typed_table_is_a_usage_error(engine: Engine, url: str, capsys: Any) -> None:
    assert main(["jobs", MODEL, "--url", url, "--task", "x"]) == 2
    assert "has no task column" in capsys.readouterr().err


def test_jobs_pages_by_key(engine: Engine, url: str, capsys: Any) -> None:
    keys = [add(engine, queue="q") for _ in range(5)]
    assert main(["jobs", MODEL, "--url", url, "--limit", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"(more: --before {keys[3]})"
    seen = [int(line.split()[0]) for line in out[2:-1]]
    before = out[-1].split()[-1].rstrip(")")
    while True:
        assert main(["jobs", MODEL, "--url", url, "--limit", "2", "--before", before]) == 0
        page = capsys.readouterr().out.splitlines()
        more = page[-1].startswith("(more")
        seen += [int(line.split()[0]) for line in (page[2:-1] if more else page[2:])]
        if not more:
            break
        before = page[-1].split()[-1].rstrip(")")
    assert seen == sorted(keys, reverse=True)
    assert main(["jobs", MODEL, "--url", url, "--before", "x"]) == 2
    assert "argument --before: not a job id" in capsys.readouterr().err


def test_show_prints_every_column_and_the_full_error(engine: Engine, url: str, capsys: Any) -> None:
    with engine.begin() as conn:
        conn.execute(insert(table_of(Order)).values(id=3, customer="bo"))
    error = "Traceback (most recent call last):\n  File \"x.py\", line 1\n" + "deep\n" * 200 + "ValueError: nope"
    key = add(engine, queue="q", status="failed", order_id=3, recipient="bo@example.com", last_error=error)
    assert main(["show", MODEL, "--url", url, str(key)]) == 0
    out = capsys.readouterr().out
    for column in JOBS.c:
        assert any(line.startswith(column.name) for line in out.splitlines()), column.name
    assert "bo@example.com" in out and out.rstrip().endswith(error)
    assert main(["show", MODEL, "--url", url, "999999"]) == 1
    assert "no job 999999" in capsys.readouterr().err
    assert main(["show", MODEL, "--url", url, "abc"]) == 2
    assert "not a job id" in capsys.readouterr().err


def test_show_takes_a_uuid_key_and_a_payload(engine: Engine, url: str, capsys: Any) -> None:
    key = uuid.uuid4()
    with engine.begin() as conn:
        conn.execute(insert(table_of(UuidJob)).values(id=key))
    assert main(["show", "tests.models:UuidJob", "--url", url, str(key)]) == 0
    assert str(key) in capsys.readouterr().out
    task = add(engine, TASKS, task="t", payload={"to": "ann", "n": [1, 2]})
    assert main(["show", TASK_MODEL, "--url", url, str(task)]) == 0
    assert '"to": "ann"' in capsys.readouterr().out


def test_requeue_by_id_and_filter(engine: Engine, url: str, capsys: Any, jobs: dict[str, int]) -> None:
    extra = [add(engine, queue="d", status="failed", last_error=f"e{i}") for i in range(3)]
    assert main(["requeue", MODEL, "--url", url, "--id", str(extra[0])]) == 0
    assert "requeued 1" in capsys.readouterr().out
    assert main(["requeue", MODEL, "--url", url, "--id", str(extra[1]), "--id", str(extra[2]),
                 "--id", str(jobs["a"])]) == 0
    assert "requeued 2" in capsys.readouterr().out  # the pending one is not a dead letter
    assert main(["requeue", MODEL, "--url", url, "--error", "timeout"]) == 0
    assert "requeued 1" in capsys.readouterr().out
    assert statuses(engine)[jobs["b_failed"]] == "pending" and statuses(engine)[jobs["c_failed"]] == "failed"
    assert main(["requeue", MODEL, "--url", url, "--queue", "c", "--queue", "x"]) == 0
    assert "requeued 1" in capsys.readouterr().out
    assert main(["requeue", MODEL, "--url", url, "--id", "one"]) == 2
    assert "argument --id: not a job id" in capsys.readouterr().err


def test_requeue_by_task(engine: Engine, url: str, capsys: Any) -> None:
    crop = add(engine, TASKS, task="crop", status="failed")
    resize = add(engine, TASKS, task="resize", status="failed")
    send = add(engine, TASKS, task="send", status="failed")
    assert main(["requeue", TASK_MODEL, "--url", url, "--task", "crop"]) == 0
    assert main(["requeue", TASK_MODEL, "--url", url, "--task", "resize", "--task", "nope"]) == 0
    assert "requeued 1" in capsys.readouterr().out.splitlines()[-1]
    assert statuses(engine, TASKS) == {crop: "pending", resize: "pending", send: "failed"}


def test_delete_by_id_and_filter_never_a_running_job(
    engine: Engine, url: str, capsys: Any, jobs: dict[str, int]
) -> None:
    j = jobs
    assert main(["delete", MODEL, "--url", url, "--id", str(j["a"])]) == 0
    assert "deleted 1 job(s)" in capsys.readouterr().out
    assert main(["delete", MODEL, "--url", url, "--id", str(j["running"]), "--id", str(j["c_done"])]) == 0
    assert "deleted 1 job(s)" in capsys.readouterr().out  # the running job stays
    assert main(["delete", MODEL, "--url", url, "--queue", "a", "--queue", "b"]) == 0
    assert "deleted 1 job(s)" in capsys.readouterr().out
    assert set(statuses(engine)) == {j["running"], j["c_failed"]}
    assert main(["delete", MODEL, "--url", url, "--status", "failed", "--status", "pending", "--error", "dns",
                 "--limit", "1"]) == 0
    assert set(statuses(engine)) == {j["running"]}


def test_delete_by_task_and_status(engine: Engine, url: str, capsys: Any) -> None:
    keep = add(engine, TASKS, task="crop")
    add(engine, TASKS, task="crop", status="done")
    add(engine, TASKS, task="send", status="cancelled")
    assert main(["delete", TASK_MODEL, "--url", url, "--task", "crop", "--task", "send",
                 "--status", "done", "--status", "cancelled"]) == 0
    assert "deleted 2" in capsys.readouterr().out
    assert main(["delete", TASK_MODEL, "--url", url, "--task", "crop", "--status", "failed"]) == 0
    assert "deleted 0" in capsys.readouterr().out
    assert list(statuses(engine, TASKS)) == [keep]


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["delete", MODEL], "name the jobs to delete"),
        (["delete", MODEL, "--status", "running"], "invalid choice: 'running'"),
        (["jobs", MODEL, "--status", "lost"], "invalid choice: 'lost'"),
        (["jobs", MODEL, "--error", ""], "argument --error: must not be empty"),
        (["jobs", MODEL, "--limit", "0"], "argument --limit: must be at least 1"),
        (["dashboard", MODEL, "--port", "70000"], "argument --port: a port is between 0 and 65535"),
        (["dashboard", MODEL, "--lease", "0"], "argument --lease: must be longer than 0"),
    ],
)
def test_mistakes_are_one_line_usage_errors(engine: Engine, url: str, capsys: Any, args: list[str],
                                            problem: str) -> None:
    try:
        code = main([*args, "--url", url])
    except SystemExit as exit_:  # argparse's own usage errors
        code = int(exit_.code or 0)
    assert code == 2
    err = capsys.readouterr().err
    assert problem in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.system
def test_dashboard_command_serves_on_localhost(engine: Engine, url: str) -> None:
    failed = add(engine, queue="q", status="failed", last_error="boom")
    process = subprocess.Popen(
        [sys.executable, "-m", "sqla_queue", "dashboard", MODEL, TASK_MODEL, "--url", url, "--port", "0",
         "--read-only"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("sqla_queue dashboard on http://127.0.0.1:"), line
        address = line.split()[3]
        with urllib.request.urlopen(address + "email_jobs/dead", timeout=30) as response:
            page = response.read().decode()
        assert f'data-id="{failed}"' in page and "read-only" in page and 'value="requeue"' not in page
        with urllib.request.urlopen(address + "tasks/jobs", timeout=30) as response:
            assert response.status == 200
    finally:
        process.terminate()
        process.wait(timeout=30)
        if process.stdout is not None:
            process.stdout.close()
    with engine.connect() as conn:
        assert conn.scalar(select(func.count()).select_from(JOBS)) == 1


def test_dashboard_command_on_a_missing_table_is_one_line(server: Server, url: str, capsys: Any) -> None:
    assert main(["dashboard", "tests.models:Order", "--url", url]) == 2
    assert "'orders' is not a queue table" in capsys.readouterr().err


@pytest.mark.system
def test_dashboard_command_takes_an_async_worker_and_shows_its_heartbeats(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(insert(TASKS).values(task="record", status="running", lease_owner="w:1:ab/0",
                                          lease_expires_at=func.now() + timedelta(seconds=50)))
        expiry = conn.scalar(select(TASKS.c.lease_expires_at))
    assert expiry is not None
    heartbeat = expiry - timedelta(seconds=60)  # the worker's lease
    process = subprocess.Popen(
        [sys.executable, "-m", "sqla_queue", "dashboard", "tests.async_worker_app:make_worker", "--port", "0"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("sqla_queue dashboard on http://127.0.0.1:"), line
        with urllib.request.urlopen(line.split()[3] + "tasks/workers", timeout=30) as response:
            page = response.read().decode()
        assert "w:1:ab" in page and heartbeat.isoformat(sep=" ", timespec="seconds") in page
    finally:
        process.terminate()
        process.wait(timeout=30)
        if process.stdout is not None:
            process.stdout.close()


def _request(address: str, path: str, host: str, method: str = "GET", body: str = "",
             origin: str | None = None, cookie: str | None = None) -> tuple[int, str, str]:
    """A request to the served dashboard naming ``host`` in its Host header."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(address)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30)
    try:
        headers = {"Host": host, "Content-Type": "application/x-www-form-urlencoded"}
        if origin is not None:
            headers["Origin"] = origin
        if cookie is not None:
            headers["Cookie"] = cookie
        conn.request(method, path, body=body or None, headers=headers)
        response = conn.getresponse()
        return response.status, response.read().decode(), (response.getheader("Set-Cookie") or "").split(";")[0]
    finally:
        conn.close()


@pytest.mark.system
def test_dashboard_command_answers_only_its_trusted_host_names(engine: Engine, url: str) -> None:
    keys = [add(engine, queue="q", status="failed") for _ in range(3)]
    for flags, good, bad in (
        ([], "127.0.0.1", "attacker.example"),
        (["--trusted-host", "queue.internal"], "queue.internal", "127.0.0.1"),
    ):
        process = subprocess.Popen(
            [sys.executable, "-m", "sqla_queue", "dashboard", MODEL, "--url", url, "--port", "0", *flags],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        try:
            assert process.stdout is not None
            address = process.stdout.readline().split()[3]
            port = address.rstrip("/").rsplit(":", 1)[1]
            status, page, _ = _request(address, "/email_jobs/dead", f"{bad}:{port}")
            assert status == 400 and "csrf_token" not in page
            status, page, cookie = _request(address, "/email_jobs/dead", f"{good}:{port}")
            assert status == 200 and f'data-id="{keys[0]}"' in page
            token = re.search(r'name="csrf_token" value="([^"]+)"', page)
            assert token and cookie
            body = f"csrf_token={token.group(1)}&action=delete&" + "&".join(f"id={k}" for k in keys)
            for host, origin in ((bad, f"http://{bad}:{port}"), (good, "http://evil.example")):
                status, _, _ = _request(address, "/email_jobs/action", f"{host}:{port}", "POST", body, origin, cookie)
                assert status == 400
        finally:
            process.terminate()
            process.wait(timeout=30)
            if process.stdout is not None:
                process.stdout.close()
        with engine.connect() as conn:
            assert conn.scalar(select(func.count()).select_from(JOBS)) == 3


def test_dashboard_command_on_every_address_needs_its_host_names(server: Server, url: str, capsys: Any) -> None:
    assert main(["dashboard", MODEL, "--url", url, "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "name the hosts it is reached by" in err and len(err.strip().splitlines()) == 1, err


def test_show_prints_a_job_s_result_and_progress(engine: Engine, url: str, capsys: Any) -> None:
    key = add(engine, table_of(ResultTask), task="t", status="done", result={"total": 42}, progress={"step": 3})
    assert main(["show", "tests.models:ResultTask", "--url", url, str(key)]) == 0
    out = capsys.readouterr().out
    result_at, progress_at = out.index("\nresult "), out.index("\nprogress ")
    assert '"total": 42' in out[result_at:] and '"step": 3' in out[progress_at:]
