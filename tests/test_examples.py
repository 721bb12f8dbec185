"""Every example runs, as a user would run it, against the test database."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from . import console
from .helpers import Server

pytestmark = pytest.mark.system

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, server: Server, *args: str, tmp: Path | None = None, fresh: bool = False) -> str:
    """The example's output; with ``tmp``, its TMPDIR, to see what it leaves there.

    ``fresh``: in a new interpreter, as typed; else in a process forked from one that
    imported the third-party packages already (``tests/console.py``)."""
    env = {**os.environ, "DATABASE_URL": server.url.render_as_string(hide_password=False)}
    if tmp is not None:
        env.update(TMPDIR=str(tmp))
    command = [sys.executable, str(EXAMPLES / name), *args]
    result: subprocess.CompletedProcess[str] | console.Result
    if fresh:
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    else:
        result = console.run(command, Path.cwd(), env, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_plain_sqlalchemy_example(server: Server) -> None:
    out = run_example("plain_sqlalchemy.py", server, fresh=True)  # one example as typed, in a new interpreter
    assert "FOR UPDATE SKIP LOCKED" in out
    assert "3 invoices rendered, highest priority first: invoice ids [2, 1, 3]" in out


def test_flask_shop_example(server: Server, tmp_path: Path) -> None:
    out = run_example("flask_shop.py", server, tmp=tmp_path)
    assert "order by cy@example.com               x3: HTTP 409" in out  # out of stock: nothing kept
    assert "e-mail to ada@example.com              done    after 1 attempt(s)" in out
    assert "e-mail to eve@undeliverable.example    failed  after 3 attempt(s)" in out
    assert "outbox: ['order-1.eml', 'order-2.eml']" in out
    assert list(tmp_path.iterdir()) == []  # the outbox folder is gone with the tour


def test_fastapi_shop_example(server: Server) -> None:
    out = run_example("fastapi_shop.py", server)
    assert "order by cy@example.com   x3: HTTP 409" in out  # out of stock: nothing kept
    assert "order 1: confirmed=True job=done" in out
    assert "order 2: confirmed=True job=done" in out
    assert "confirmations per order: {1: 1, 2: 1}" in out


def test_alembic_project_example(server: Server) -> None:
    out = run_example("alembic_project/run.py", server)
    assert "$ " in out and "alembic init migrations" in out
    assert "op.create_index(op.f('welcome_emails_claim_idx')" in out
    assert "index welcome_emails_lease_idx ['lease_expires_at'] WHERE ((status)::text = 'running'::text)" in out
    assert "check welcome_emails_status_check" in out
    assert "-- downgraded" in out


def test_fastapi_sqlmodel_example(server: Server) -> None:
    out = run_example("fastapi_sqlmodel.py", server)
    assert "order by cy@example.com   x3: HTTP 409" in out  # out of stock: nothing kept
    assert "reminders: {'enqueued': 2}" in out
    assert "order 1: confirmed=True job=done" in out
    assert "order 2: confirmed=True job=done" in out
    expected = "{(1, 'confirmation'): 1, (1, 'reminder'): 1, (2, 'confirmation'): 1, (2, 'reminder'): 1}"
    assert f"per order: {expected}" in out  # each job's effect exactly once
