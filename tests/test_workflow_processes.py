"""Workflows under fire: eight worker processes (both runtimes) run random graphs while
one of them is SIGKILLed every half second and started again (for six seconds once
they are at work). Every job's transactional
handler checks that each of its parents ended done and that their effect rows committed,
then writes its own effect row in the transaction that completes it, so a job run twice,
or released before its parents' effects committed, shows in the effects table.
"""

from __future__ import annotations

import random
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from sqla_queue import Workflow, enqueue_workflow

from .helpers import WorkerProcess, table_of
from .models import Effect, StepTask

pytestmark = pytest.mark.system

STEPS = table_of(StepTask)
EFFECTS = table_of(Effect)


def random_graph(rng: random.Random, size: int) -> Workflow:
    """A graph of ``size`` jobs: each waits for up to four earlier ones (a fan-out where
    many pick the same parent, a fan-in where one picks many, diamonds where both meet)."""
    flow = Workflow()
    added: list[StepTask] = []
    for _ in range(size):
        job = StepTask(task="step", payload={"sleep": rng.choice((0.02, 0.05, 0.1, 0.2))}, max_attempts=50)
        parents = rng.sample(added, k=min(len(added), rng.choice((0, 1, 1, 2, 4)))) if added else []
        added.append(flow.add(job, after=parents))
    return flow


def test_random_graphs_run_each_job_once_after_its_parents_while_workers_are_killed(
    engine: Engine, tmp_path: Path
) -> None:
    rng = random.Random(20261207)
    with Session(engine, expire_on_commit=False) as session:
        flows = [random_graph(rng, 20) for _ in range(8)]
        for flow in flows:
            enqueue_workflow(session, flow)
        session.commit()
    ids = [job.id for flow in flows for job in flow.jobs]

    def start(n: int) -> WorkerProcess:
        return WorkerProcess(
            log_dir=tmp_path, target="tests.workflow_app:make_worker",
            runtime="asyncio" if n % 2 else "thread",
        )

    processes = [start(n) for n in range(8)]
    born = [time.monotonic()] * 8
    kills = 0
    try:
        began = time.monotonic()
        firing: float | None = None  # when the kills began: once the workers are at work
        while True:
            with engine.connect() as conn:
                done = conn.scalar(select(func.count()).where(STEPS.c.id.in_(ids), STEPS.c.status == "done")) or 0
            if done == len(ids):
                break
            now = time.monotonic()
            assert now - began < 150, f"{done} of {len(ids)} done after {now - began:.0f} s"
            if firing is None and done:
                firing = now
            if firing is not None and now - firing < 6:
                # A process that has had the time to start and claim, at random.
                grown = [n for n in range(len(processes)) if now - born[n] > 2]
                if grown:
                    victim = rng.choice(grown)
                    processes[victim].signal(signal.SIGKILL)
                    processes[victim].proc.wait(10)
                    processes[victim].stop()
                    processes[victim], born[victim] = start(victim), now
                    kills += 1
            time.sleep(0.5)  # the pace of the kills and of the supervisor, not a wait for anything
    finally:
        for process in processes:
            process.stop()
    with engine.connect() as conn:
        found: list[Any] = list(conn.execute(select(EFFECTS.c.job_id, EFFECTS.c.note).where(EFFECTS.c.job_id.in_(ids))))
        retried = conn.scalar(select(func.count()).where(STEPS.c.id.in_(ids), STEPS.c.attempts > 1)) or 0
    per_job = Counter(job_id for job_id, _ in found)
    assert kills >= 5
    assert retried > 0, "no kill caught a job in flight: the test proved nothing"
    assert sorted(per_job) == sorted(ids), "every job wrote its effect"
    assert set(per_job.values()) == {1}, "no job's effect committed twice"
    early = [note for _, note in found if note != "ok"]
    assert not early, f"children released before their parents' effects committed: {early[:3]}"
