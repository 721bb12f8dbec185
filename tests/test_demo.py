"""The main demo: the whole system on one command, and a clean exit on Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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


def test_demo_runs_the_whole_tour(server: Server) -> None:
    env = {**os.environ, "DATABASE_URL": server.url.render_as_string(hide_password=False)}
    result = subprocess.run(
        [sys.executable, "-m", "sqla_queue.demo", "--jobs", "400"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
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
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
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
    assert "interrupted; cleaned up" in log.read_text()
    wait_for(lambda: not (postmasters() - before), timeout=30, what="the embedded server to stop")
