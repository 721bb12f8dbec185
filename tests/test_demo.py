"""The main demo: the whole system on one command, and a clean exit on Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psutil

from .helpers import Server, wait_for

REPO = Path(__file__).resolve().parent.parent


def postmasters() -> set[int]:
    """PostgreSQL servers on this machine started from a temporary embedded data dir."""
    found = set()
    for proc in psutil.process_iter(["name", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if proc.info["name"] == "postgres" and "sqla_queue_pg_" in cmdline and " -D " in f" {cmdline} ":
            found.add(proc.pid)
    return found


def marked(marker: str) -> list[str]:
    """Live processes whose environment carries ``marker``: the demo's and its children's."""
    found = []
    for proc in psutil.process_iter(["status"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if proc.environ().get("SQLA_QUEUE_TEST_MARKER") == marker:
                found.append(f"{proc.pid} {' '.join(proc.cmdline())}")
        except psutil.Error:  # gone meanwhile, or not ours to read
            pass
    return found


def demo_env(tmp_path: Path, **extra: str) -> tuple[dict[str, str], str, Path]:
    """The demo's environment: a marker its processes inherit, and a temp dir of its own."""
    marker = uuid.uuid4().hex
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env.update(SQLA_QUEUE_TEST_MARKER=marker, TMPDIR=str(tmp), **extra)
    return env, marker, tmp


def test_demo_runs_the_whole_tour(server: Server, tmp_path: Path) -> None:
    env, marker, tmp = demo_env(tmp_path, DATABASE_URL=server.url.render_as_string(hide_password=False))
    result = subprocess.run(
        [sys.executable, "-m", "sqla_queue.demo", "--jobs", "400"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr == ""  # no warnings either
    assert marked(marker) == []  # its worker process is gone with it
    assert list(tmp.iterdir()) == []  # and so is the workers' log
    out = result.stdout
    assert "400 image jobs bulk-loaded with COPY" in out
    assert "killed the worker process" in out
    lines = {
        line.split("  ")[1].strip(): line for line in out.splitlines() if line.startswith("  ") and "  " in line[2:]
    }
    assert lines["done"].split()[1] == f"{200 + 400 + 20 + 150:,}"
    assert lines["dead-lettered"].split()[1] == "5"
    assert lines["retried, then done"].split()[3] == "10"
    assert lines["orders confirmed twice"].split()[3] == "0"
    assert "0 unconfirmed" in lines["orders confirmed twice"]
    assert "pickup latency" in out and "jobs/s" in out


def test_ctrl_c_stops_the_embedded_server(tmp_path: Path) -> None:
    before = postmasters()
    env, marker, tmp = demo_env(tmp_path)
    log = tmp_path / "demo.out"
    with open(log, "w") as out:
        demo = subprocess.Popen(
            [sys.executable, "-m", "sqla_queue.demo", "--jobs", "200000"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
        try:
            wait_for(lambda: "== enqueue" in log.read_text(), timeout=60, what="the demo to start")
            assert postmasters() - before, "the demo should have started an embedded server"
            demo.send_signal(signal.SIGINT)
            assert demo.wait(60) == 130
        finally:
            if demo.poll() is None:
                demo.kill()
    output = log.read_text()
    assert "interrupted; cleaned up" in output
    assert output.startswith("== starting an embedded PostgreSQL"), output  # no warning first
    wait_for(lambda: not (postmasters() - before), timeout=30, what="the embedded server to stop")
    assert marked(marker) == []  # nothing the demo started is left running
    assert list(tmp.iterdir()) == []  # the server's data dir and the workers' log are gone
