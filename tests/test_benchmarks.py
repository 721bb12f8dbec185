"""The benchmark harnesses run end to end (``benchmarks/run.py --quick``, ``peers.py --quick``).

A smoke test of the harnesses only: every benchmark runs with tiny sizes against the test
server and prints its row. Speed is not asserted; the figures of a quick run mean nothing.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import Server

#: With the eight-process tests, in one test process (``--dist loadgroup``): together
#: they would pass the server's max_connections.
pytestmark = [pytest.mark.system, pytest.mark.xdist_group("many_connections")]

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"
PEERS_SCRIPT = SCRIPT.with_name("peers.py")
PEERS = ("pgqueuer", "procrastinate")

#: The first cell of every row the results table must have.
EXPECTED_ROWS = (
    "enqueue, 1 job per transaction |",
    "enqueue, 1 job per transaction, fast path (enqueue_values) in a Session |",
    "enqueue, 1 job per transaction, fast path (enqueue_values) on a Connection |",
    "enqueue, 1 job per transaction, fast path (enqueue_values) on one open Connection",
    "enqueue, 1 job per transaction: plain SQLAlchemy ORM",
    "enqueue, 1 job per transaction: session.enqueue() vs the plain ORM reference",
    "enqueue, 1 job per transaction + ORM business row |",
    "enqueue, 1 job per transaction + ORM business row, fast path (enqueue_values) in a Session |",
    "enqueue, 1 job per transaction + ORM business row, fast path (enqueue_values) on a Connection |",
    "async enqueue, 1 job per transaction |",
    "async enqueue, 1 job per transaction: plain SQLAlchemy AsyncSession",
    "async enqueue, 1 job per transaction: AsyncQueueSession.enqueue() vs the plain AsyncSession reference |",
    "async enqueue, 1 job per transaction vs pgqueuer's Queries.enqueue (autocommit) |",
    "async enqueue, 1 job per transaction, fast path (await enqueue_values) in an AsyncQueueSession |",
    "async enqueue, 1 job per transaction, fast path (await enqueue_values) in engine.begin() |",
    "async enqueue, 1 job per transaction, fast path (await enqueue_values) on an autocommit AsyncConnection vs",
    "bulk enqueue 2,000 jobs, COPY |",
    "bulk enqueue 2,000 jobs, INSERT executemany |",
    "processing, 1 process x 1 thread, batch default (baseline 32) |",
    "processing, 1 process x 4 threads, batch default (baseline 32) |",
    "processing, 1 process x 16 threads, batch default (baseline 32) |",
    "processing, 2 processes x 4 threads, batch default (baseline 32) |",
    "processing, 1 process x 16 threads, batch 128 |",
    "async processing, AsyncWorker, 1 process x 4 tasks, batch default (baseline 32) |",
    "async processing, AsyncWorker's best vs pgqueuer's best, 1 process |",
    "pickup latency p50",
    "pickup latency p95",
    "pickup latency p99",
    "claim latency, 1k finished rows",
    "claim latency, 3k finished rows",
    "claim latency, 10k finished rows",
    "claim latency growth, 10k vs 1k finished rows",
)


def quick_run(script: Path, server: Server, *, timeout: float) -> subprocess.CompletedProcess[str]:
    """``script --quick --url <the suite's server>``, which must exit 0 within ``timeout``."""
    admin = server.admin_url.render_as_string(hide_password=False)
    result = subprocess.run(
        [sys.executable, str(script), "--quick", "--url", admin],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.mark.timeout(300)
def test_quick_run_prints_every_benchmark(server: Server) -> None:
    result = quick_run(SCRIPT, server, timeout=280)
    table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert table, result.stdout
    assert table[0].startswith("| benchmark | sqla_queue | baseline")
    for expected in EXPECTED_ROWS:
        assert any(line.startswith(f"| {expected}") for line in table), (expected, result.stdout)
    assert len(table) == len(EXPECTED_ROWS) + 1, result.stdout
    assert "PostgreSQL" in result.stdout and "CPUs" in result.stdout


#: The first cell of every row of the peers' table.
PEER_ROWS = (
    "processing, 1 process, best setting |",
    "processing, 2 processes, best setting |",
    "enqueue, 1 job per transaction (sqla_queue: session.enqueue) |",
    "enqueue, 1 job per transaction (sqla_queue: enqueue_values, autocommit) |",
    "pickup latency p50",
    "pickup latency p99",
)


@pytest.mark.timeout(300)
def test_quick_peers_run_prints_every_peer(server: Server) -> None:
    missing = [name for name in PEERS if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (the bench extra: pip install -e '.[bench]')")
    result = quick_run(PEERS_SCRIPT, server, timeout=280)
    table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert table, result.stdout
    assert table[0] == (
        "| benchmark | sqla_queue | pgqueuer | procrastinate | sqla_queue / pgqueuer (target) |"
    ), result.stdout
    for expected in PEER_ROWS:
        assert any(line.startswith(f"| {expected}") for line in table), (expected, result.stdout)
    assert len(table) == len(PEER_ROWS) + 1, result.stdout
    for line in table[1:]:
        assert len(line.split(" | ")) == 5, line
    assert "skipped" not in result.stdout, result.stdout


@pytest.mark.timeout(300)
def test_quick_dashboard_page_run_prints_every_query(server: Server) -> None:
    """``benchmarks/dashboard_page.py --quick``: 10,000 jobs, each query of the job list
    timed; every page query returns its rows (a full page but for the text search)."""
    result = quick_run(SCRIPT.with_name("dashboard_page.py"), server, timeout=280)
    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0] == ["| query", "rows", "median ms |"], result.stdout
    names = [row[0].removeprefix("| ") for row in rows[1:]]
    assert names[0] == "newest page" and names[-1] == "overview (counts and last hour)" and len(names) == 8
    for row in rows[1:-2]:
        assert row[1] in ("49", "50"), row  # a page of 50 (49 half-way down the failed ones of 10,000)


@pytest.mark.timeout(300)
def test_quick_dashboard_charts_run_prints_every_row(server: Server) -> None:
    """``benchmarks/dashboard_charts.py --quick``: 20,000 finished jobs, the overview and
    each statement of its charts timed, from the queue table and from the activity table
    the workers' statement recorded."""
    result = quick_run(SCRIPT.with_name("dashboard_charts.py"), server, timeout=280)
    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0] == ["| read from", "what", "median ms |"], result.stdout
    sources = [row[0].removeprefix("| ") for row in rows[1:]]
    names = [row[1] for row in rows[1:]]
    assert set(sources) == {"queue table", "activity table"}, result.stdout
    for source in ("queue table", "activity table"):
        assert "page: overview, last 24 hours" in [n for s, n in zip(sources, names, strict=True) if s == source]
    assert "worker: record a quarter of an hour (record_activity)" in names
    assert "The first recording of the activity table" in result.stdout


@pytest.mark.timeout(120)
def test_quick_unique_enqueue_run_prints_both_rates(server: Server) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT.with_name("unique_enqueue.py")), "--quick"],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
        env={**os.environ, "DATABASE_URL": server.admin_url.render_as_string(hide_password=False)},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "200 keyed rows, 100 inserted, 100 skipped" in result.stdout, result.stdout
    assert "rows/s" in result.stdout and "ratio:" in result.stdout


@pytest.mark.timeout(180)
def test_quick_flow_run_prints_both_tables(server: Server) -> None:
    """``benchmarks/flow.py --quick``: the drains with and without a concurrency rule,
    and the achieved rate of both rate limit modes; a strict limit is never exceeded."""
    result = quick_run(SCRIPT.with_name("flow.py"), server, timeout=170)
    assert "ratio with the rule to without:" in result.stdout, result.stdout
    strict = next(line for line in result.stdout.splitlines() if line.startswith("| strict rate |"))
    assert int(strict.split(" | ")[-1].rstrip(" |")) <= 500, strict


@pytest.mark.timeout(180)
def test_quick_workflows_run_prints_every_load_and_the_release_latency(server: Server) -> None:
    """``benchmarks/workflows.py --quick``: each load drained to done (the script checks
    every job is), its row printed, and the release latency of a chain."""
    result = quick_run(SCRIPT.with_name("workflows.py"), server, timeout=170)
    rows = ("| plain table |", "| workflow table, no dependencies |", "| fan-out 1 -> 399 |", "| fan-in 399 -> 1 |",
            "| fan-in 300 -> 100 (parent i into child i mod 100) |")
    for row in rows:
        assert row in result.stdout, result.stdout
    assert "release latency, a parent's completion to its child's start (a chain of 30): p50" in result.stdout


#: The first cells of the rows of ``pressure.py --quick``.
PRESSURE_ROWS = (
    "2 producers, one job per transaction, session.enqueue(): wake-up with_commit / none |",
    "2 producers, one job per transaction, session.enqueue(): wake-up after_commit / none |",
    "2 producers, one job per transaction, enqueue_values(): wake-up with_commit / none |",
    "2 producers, one job per transaction, enqueue_values(): wake-up after_commit / none |",
    "held snapshot: throughput during the hold / clean run |",
    "held snapshot: pickup p99 during the hold / clean run |",
    "held snapshot: claim's mean time, the hold's last minute / its first |",
    "held snapshot: claim's mean time during the hold / clean |",
    "claim latency at 20,000 finished rows / empty table (p50) |",
    "enqueue at 20,000 finished rows / empty table |",
    "prune in batches of 10,000 beside claims |",
    "processing on the production cluster, 1 process x 4 threads, batch default (baseline 32) |",
    "processing on the production cluster, 2 processes x 4 threads, batch default (baseline 32) |",
    "churn at 200 jobs/s for 0.02 min beside 20,000 finished rows: server defaults |",
    "churn at 200 jobs/s for 0.02 min beside 20,000 finished rows: recommended autovacuum |",
    "churn at 200 jobs/s for 0.02 min beside 20,000 finished rows: recommended autovacuum, fillfactor 80 |",
)


@pytest.mark.timeout(300)
def test_quick_pressure_run_prints_every_row() -> None:
    """``benchmarks/pressure.py --quick``: a cluster of its own (initdb, autovacuum on),
    every scenario with tiny sizes, every row printed, the cluster gone afterwards."""
    from .standby import find_bin_dir

    if find_bin_dir() is None:
        pytest.fail("pressure.py needs PostgreSQL's initdb and pg_ctl (Debian: postgresql)")
    result = subprocess.run(
        [sys.executable, str(SCRIPT.with_name("pressure.py")), "--quick"],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:] + result.stdout[-2000:]
    table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| benchmark | sqla_queue | baseline")
    for expected in PRESSURE_ROWS:
        assert any(line.startswith(f"| {expected}") for line in table), (expected, result.stdout)
    assert len(table) == len(PRESSURE_ROWS) + 1, result.stdout
    assert "autovacuum on" in result.stderr  # the progress lines
    cluster = [line for line in result.stderr.splitlines() if line.startswith("cluster: data in ")]
    assert cluster, result.stderr
    leftover = Path(cluster[0].split("data in ", 1)[1].strip())
    assert not leftover.exists(), f"the benchmark left its cluster at {leftover}"


#: The first cells of the rows of ``cost.py --quick``.
COST_ROWS = (
    "processing, raw best, batch 100, 1p |",
    "processing, raw best, batch 500, 1p |",
    "processing, matched raw, 1p |",
    "processing, Worker, 1p |",
    "processing, raw best, batch 100, 2p |",
    "processing, raw best, batch 500, 2p |",
    "processing, matched raw, 2p |",
    "processing, Worker, 2p |",
    "processing, AsyncWorker, 1p |",
    "raw INSERT + NOTIFY |",
    "enqueue_values, one open Connection |",
    "enqueue_values, engine.begin() |",
    "raw COPY |",
    "enqueue_many(method='copy') |",
)


@pytest.mark.timeout(300)
def test_quick_cost_run_prints_every_row(server: Server) -> None:
    """``benchmarks/cost.py --quick``: every processing side drains its jobs (run.py's
    harness checks each is done once), every row printed with its CPU per job."""
    result = quick_run(SCRIPT.with_name("cost.py"), server, timeout=280)
    table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert table[0] == "| measure | rate | CPU µs/job | / raw best | / matched raw |", result.stdout
    for expected in COST_ROWS:
        assert any(line.startswith(f"| {expected}") for line in table), (expected, result.stdout)
    assert len(table) == len(COST_ROWS) + 1, result.stdout
    for line in table[1:]:
        assert float(line.split(" | ")[2].replace(",", "")) > 0, line  # a CPU time was measured
