"""Workers as real processes: killed, frozen, crashing, cut off from the database, stopped.

Each worker runs ``sqla-queue worker tests.worker_app:make_worker`` with test-sized
timings. Transactional ``record`` jobs write one ``Effect`` row per successful attempt,
so "completed twice" shows up as two rows for one job.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, func, select, text
from sqlalchemy.orm import sessionmaker

from sqla_queue import QueueSession

from .helpers import Server, WorkerProcess, table_of, wait_for
from .models import Effect, Task

pytestmark = pytest.mark.system

TASKS = table_of(Task)
Start = Callable[..., WorkerProcess]
FAST = ("--poll-interval", "0.5s", "--sweep-interval", "0.2s")


def add(engine: Engine, task: str, n: int = 1, max_attempts: int = 20, **payload: Any) -> list[int]:
    with sessionmaker(engine, class_=QueueSession)() as session:
        jobs = [
            session.enqueue(Task(task=task, payload=dict(payload)), max_attempts=max_attempts)
            for _ in range(n)
        ]
        session.commit()
        return [job.id for job in jobs]


def rows(engine: Engine, ids: list[int]) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(TASKS).where(TASKS.c.id.in_(ids)).order_by(TASKS.c.id)))


def effect_counts(engine: Engine) -> Counter[int]:
    with engine.connect() as conn:
        return Counter(conn.scalars(select(Effect.job_id)))


def effects_reach(engine: Engine, goal: int) -> Callable[[], bool]:
    return lambda: sum(effect_counts(engine).values()) >= goal


def all_done(engine: Engine, ids: list[int]) -> Callable[[], bool]:
    return lambda: all(r.status == "done" for r in rows(engine, ids))


def test_sigkill_mid_job_loses_nothing_and_runs_nothing_twice(engine: Engine, worker_processes: Start) -> None:
    ids = add(engine, "record", 300, sleep=0.02)
    first = worker_processes("--concurrency", "4", "--lease", "2s", *FAST)
    wait_for(lambda: sum(effect_counts(engine).values()) >= 40, what="the first worker to get going")
    first.signal(signal.SIGKILL)
    assert first.wait(10) == -signal.SIGKILL
    in_flight = [r.id for r in rows(engine, ids) if r.status == "running"]
    assert in_flight, "the kill should have caught jobs in flight"
    worker_processes("--concurrency", "4", "--lease", "2s", *FAST)
    wait_for(all_done(engine, ids), timeout=90, what="every job done")
    counts = effect_counts(engine)
    assert sorted(counts) == ids and set(counts.values()) == {1}
    recovered = {r.id: r.attempts for r in rows(engine, in_flight)}
    assert all(attempts == 2 for attempts in recovered.values()), recovered


def test_frozen_zombie_cannot_complete_a_job_it_lost(
    engine: Engine, worker_processes: Start, tmp_path: Any
) -> None:
    started = tmp_path / "started"
    (job_id,) = add(engine, "record", sleep=2.0, started=str(started))
    zombie = worker_processes("--lease", "1s", "--heartbeat", "0.3s", *FAST)
    wait_for(started.exists, what="the job to start")
    zombie.signal(signal.SIGSTOP)
    try:
        rescuer = worker_processes("--lease", "1s", "--heartbeat", "0.3s", *FAST)
        wait_for(lambda: rows(engine, [job_id])[0].status == "done", timeout=30)
    finally:
        zombie.signal(signal.SIGCONT)
    zombie.wait_for_log(f"job {job_id} attempt 1: lease lost")
    (row,) = rows(engine, [job_id])
    assert row.attempts == 2 and f":{rescuer.pid}:" in row.lease_owner
    with engine.connect() as conn:
        writers = conn.execute(select(Effect.worker)).scalars().all()
    assert writers == [str(rescuer.pid)]  # the zombie's writes were rolled back
    zombie.signal(signal.SIGTERM)
    assert zombie.wait(15) == 0


def test_crash_loop_burns_only_the_poison_jobs_attempts(engine: Engine, worker_processes: Start) -> None:
    (poison,) = add(engine, "crash", max_attempts=3, sleep=0.2)
    innocents = add(engine, "record", 5, max_attempts=3, sleep=0.6)
    args = ("--concurrency", "6", "--batch-size", "6", "--lease", "1s", "--heartbeat", "0.3s", *FAST)

    def settled() -> bool:
        states = {r.id: r.status for r in rows(engine, [poison, *innocents])}
        return states[poison] == "failed" and all(states[i] == "done" for i in innocents)

    crashes = 0
    for _ in range(10):  # a supervisor restarting the worker it keeps losing
        worker = worker_processes(*args)

        def settled_or_exited(worker: WorkerProcess = worker) -> bool:
            return settled() or worker.proc.poll() is not None

        wait_for(settled_or_exited, timeout=60)
        if worker.proc.poll() == -signal.SIGKILL:  # died by its own job's hand
            crashes += 1
        if settled():
            break
    assert settled()
    (dead,) = rows(engine, [poison])
    assert dead.attempts == 3 and dead.last_error.startswith("lease expired")
    assert crashes == 3
    # An innocent loses at most two attempts to it: beside it as an ordinary job, then
    # beside it while both were isolated; after that the poison job runs alone.
    assert all(r.attempts <= 3 for r in rows(engine, innocents))
    assert set(effect_counts(engine).values()) == {1}


def test_worker_survives_terminated_backends(engine: Engine, worker_processes: Start) -> None:
    ids = add(engine, "record", 200, sleep=0.01)
    worker = worker_processes("--concurrency", "4", "--lease", "5s", *FAST, app_name="sqla_queue_victim")
    for goal in (30, 80, 130):
        wait_for(effects_reach(engine, goal), timeout=60)
        with engine.begin() as conn:
            killed = conn.scalar(
                text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND application_name = 'sqla_queue_victim'"
                )
            )
        assert killed >= 1
    wait_for(all_done(engine, ids), timeout=90)
    assert worker.proc.poll() is None  # still running
    counts = effect_counts(engine)
    assert sorted(counts) == ids and set(counts.values()) == {1}


def test_worker_survives_a_server_restart(
    private_engine: Engine, worker_processes: Start, private_server: Server
) -> None:
    engine = private_engine  # a server of the suite's own: it is the one restarted
    ids = add(engine, "record", 150, sleep=0.01)
    url = private_server.url.render_as_string(hide_password=False)
    worker = worker_processes("--concurrency", "4", "--lease", "5s", *FAST, url=url)
    wait_for(lambda: sum(effect_counts(engine).values()) >= 30, timeout=60)
    private_server.restart()
    engine.dispose()  # the test's own pooled connections died with the server
    wait_for(all_done(engine, ids), timeout=120)
    assert worker.proc.poll() is None
    worker.wait_for_log("recovered after")
    counts = effect_counts(engine)
    assert sorted(counts) == ids and set(counts.values()) == {1}


def test_sigterm_lets_the_running_job_finish(engine: Engine, worker_processes: Start, tmp_path: Any) -> None:
    started = tmp_path / "started"
    (job_id,) = add(engine, "record", sleep=1.5, started=str(started))
    worker = worker_processes("--shutdown-grace", "20s", *FAST)
    wait_for(started.exists)
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    (row,) = rows(engine, [job_id])
    assert row.status == "done" and effect_counts(engine) == Counter({job_id: 1})


def test_sigterm_hands_back_a_job_that_outlives_the_grace(
    engine: Engine, worker_processes: Start, tmp_path: Any
) -> None:
    started = tmp_path / "started"
    (job_id,) = add(engine, "record", sleep=60, started=str(started))
    worker = worker_processes("--shutdown-grace", "0.5s", *FAST)
    wait_for(started.exists)
    worker.signal(signal.SIGTERM)
    assert worker.wait(15) == 0
    (row,) = rows(engine, [job_id])
    assert (row.status, row.lease_owner, row.attempts) == ("pending", None, 1)
    assert not effect_counts(engine)


def test_sigterm_tells_a_handler_that_checks_and_hands_its_job_back_at_once(
    engine: Engine, worker_processes: Start, tmp_path: Any
) -> None:
    """The handler checks ``current_job()`` between steps: on SIGTERM it is told that the
    worker stops, gives up, and its job is handed back at once; the process exits long
    before the grace (a minute) is out."""
    started, told = tmp_path / "started", tmp_path / "told"
    (job_id,) = add(engine, "careful", started=str(started), told=str(told))
    worker = worker_processes("--shutdown-grace", "60s", *FAST, target="tests.stopping_app:make_worker")
    wait_for(started.exists)
    worker.signal(signal.SIGTERM)
    assert worker.wait(20) == 0
    assert told.read_text() == "stopping"
    (row,) = rows(engine, [job_id])
    assert (row.status, row.lease_owner, row.attempts) == ("pending", None, 1)


def test_second_signal_stops_at_once(engine: Engine, worker_processes: Start, tmp_path: Any) -> None:
    started = tmp_path / "started"
    (job_id,) = add(engine, "record", sleep=60, started=str(started))
    worker = worker_processes("--shutdown-grace", "60s", *FAST)
    wait_for(started.exists)
    worker.signal(signal.SIGTERM)
    worker.wait_for_log("finishing running jobs")
    worker.signal(signal.SIGINT)
    assert worker.wait(15) == 0  # long before the 60 s grace
    (row,) = rows(engine, [job_id])
    assert (row.status, row.lease_owner) == ("pending", None)
    with engine.connect() as conn:
        assert conn.scalar(select(func.count()).select_from(Effect)) == 0


def test_sigterm_exits_after_the_grace_while_a_plain_handler_is_stuck(
    engine: Engine, worker_processes: Start, tmp_path: Any
) -> None:
    """A plain handler that never returns (on the asyncio runtime: in its thread pool)
    cannot be stopped, but it must not keep the process alive: the worker hands the job
    back after the grace, names the handler still running, and the process exits."""
    started = tmp_path / "started"
    (job_id,) = add(engine, "stuck", started=str(started))
    worker = worker_processes("--shutdown-grace", "0.5s", *FAST)
    wait_for(started.exists, what="the job to start")
    worker.signal(signal.SIGTERM)
    try:
        code = worker.wait(15)  # the grace, the hand-back and the joins take about 3 s
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the worker did not exit after SIGTERM:\n{worker.log()}") from None
    assert code == 0, worker.log()
    (row,) = rows(engine, [job_id])
    assert (row.status, row.lease_owner, row.attempts) == ("pending", None, 1)
    assert f"job {job_id}" in worker.log() and "tests.worker_app.stuck" in worker.log()


def test_asyncio_run_of_a_worker_returns_and_exits_while_a_plain_handler_is_stuck(
    engine: Engine, tmp_path: Any
) -> None:
    """The user's own ``asyncio.run(worker.run())``, no command line: it returns after the
    grace, and the interpreter then exits, the stuck thread pool thread notwithstanding."""
    started = tmp_path / "started"
    (job_id,) = add(engine, "stuck", started=str(started))
    script = (
        "import asyncio, logging\n"
        "from tests.worker_app import make_worker\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "worker = make_worker().with_options(shutdown_grace=0.5)\n"
        "async def main():\n"
        "    await worker.run()\n"
        "    await worker.engine.dispose()\n"
        "asyncio.run(main())\n"
        "print('asyncio.run returned', flush=True)\n"
    )
    env = {**os.environ, "SQLA_QUEUE_TEST_RUNTIME": "asyncio"}
    repo = Path(__file__).resolve().parent.parent
    with subprocess.Popen(
        [sys.executable, "-X", "faulthandler", "-c", script],
        cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    ) as proc:
        try:
            wait_for(lambda: started.exists() or proc.poll() is not None, what="the job to start")
            assert proc.poll() is None, proc.communicate()[0]
            proc.send_signal(signal.SIGTERM)
            try:
                out, _ = proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGABRT)  # faulthandler: the threads' stacks
                out, _ = proc.communicate(timeout=15)
                raise AssertionError(f"asyncio.run(worker.run()) did not exit after SIGTERM:\n{out}") from None
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, out
    assert "asyncio.run returned" in out and "tests.worker_app.stuck (job" in out
    (row,) = rows(engine, [job_id])
    assert (row.status, row.lease_owner, row.attempts) == ("pending", None, 1)
