"""The ``sqla-queue`` administrative commands, run as a user runs them."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, func, insert, select, update

from sqla_queue.cli import main, parse_duration

from .helpers import Server, table_of
from .models import EmailJob

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
    assert "not a sqla_queue.Worker" in capsys.readouterr().err
    assert main(["stats", "tests.models:Order", "--url", url]) == 2
    assert "'orders' is not a queue table" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "seconds"), [("90", 90), ("90s", 90), ("15m", 900), ("12h", 43200), ("7d", 604800), ("1.5h", 5400)]
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text).total_seconds() == seconds


def test_console_script_help_lists_the_commands() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sqla_queue.cli", "--help"], capture_output=True, text=True, cwd=REPO, check=True
    )
    for command in ("worker", "sweep", "stats", "requeue", "prune", "alembic"):
        assert command in result.stdout
