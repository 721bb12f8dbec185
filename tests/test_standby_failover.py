"""Failover to a streaming standby, with synchronous replication, while jobs flow.

The test makes a primary and a ``pg_basebackup -R`` standby of its own (:mod:`tests.standby`),
both named in one engine URL (``host=…&host=…&target_session_attrs=read-write``). A
producer enqueues jobs one per transaction at a modest rate; a worker (both runtimes) runs
them with a transactional handler that writes one ``Effect`` row per job. The primary is
then stopped as if it crashed (``-m immediate``) and the standby promoted. Asserted:

Just before the crash, replication stalls (the standby streams through a proxy the test
freezes): the primary's commits wait for the standby, a job's transactional completion
among them, as when the primary dies in the middle of the commits it is replicating.

- no acknowledged job is lost (every job whose commit returned is on the new primary);
- a job whose completion was waiting for the standby is settled by its row on the new
  primary (still ``running`` under the worker: handed back, run again), not by its lease;
- after a drain nothing is stuck: every job is ``done``, and none waited for its lease to
  run out (the sweeper gave none back);
- one effect row per done job, never two;
- processing resumes on the new primary within :data:`RESUMED_WITHIN` of the promotion
  (a correctness bound, half the lease: a job left to its lease would miss it).

Skipped only where the PostgreSQL server binaries (``pg_basebackup``) are not installed.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session, sessionmaker

from sqla_queue import QueueSession, Tasks
from sqla_queue.model import DEFAULT_MAX_ATTEMPTS
from sqla_queue.runtime import Event

from . import models
from .helpers import wait_for
from .models import Effect, Task
from .standby import Pair, find_bin_dir
from .workers import FAST, engine_with

BIN_DIR = find_bin_dir()
pytestmark = [
    pytest.mark.system,
    pytest.mark.skipif(
        BIN_DIR is None,
        reason="pg_basebackup is not installed (the PostgreSQL server binaries, e.g. Debian's postgresql-15; "
        "or set PG_BIN_DIR)",
    ),
]

#: Short, so a job left to its lease would show; long enough for a loaded machine's beats.
LEASE = 8.0
#: Processing is running again on the new primary within this long after the promotion.
RESUMED_WITHIN = LEASE / 2
#: Jobs the producer enqueues per second, each in a transaction of its own.
RATE = 50.0


@pytest.fixture
def pair() -> Iterator[Pair]:
    assert BIN_DIR is not None
    made = Pair(BIN_DIR)
    try:
        yield made.start()
    finally:
        made.close()


class Producer(threading.Thread):
    """Enqueues a job every ``1 / RATE`` s; ``acked``: the numbers of those whose commit
    returned. Errors (the outage) are counted, and the next job is tried on."""

    def __init__(self, url: str) -> None:
        super().__init__(name="test-producer", daemon=True)
        self.engine = create_engine(url, pool_pre_ping=True)
        self.acked: list[int] = []
        self.errors = 0
        self.tried = 0
        self.halt = threading.Event()

    def run(self) -> None:
        Sessions = sessionmaker(self.engine, class_=QueueSession)
        due = time.monotonic()
        while not self.halt.is_set():
            self.tried += 1
            n = self.tried
            try:
                with Sessions() as session:
                    session.enqueue(Task(task="effect", payload={"n": n}))
                    session.commit()
                self.acked.append(n)
            except Exception:  # noqa: BLE001 - the outage: this job is not acknowledged
                self.errors += 1
            due += 1 / RATE
            self.halt.wait(max(0.0, due - time.monotonic()))

    def stop(self) -> None:
        self.halt.set()
        if self.ident is not None:  # started
            self.join(30)
        self.engine.dispose()


#: The worker's connections, told apart from the producer's on the primary.
WORKER_APP = "sqla_queue_failover_worker"
#: Transactional completions (the worker's COMMITs) waiting for the standby, on the primary.
IN_FLIGHT_COMPLETIONS = (
    f"SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep' AND application_name = '{WORKER_APP}'"
)
#: What the primary says of its standby and its waiting commits, for a failure's message.
REPLICATION_STATE = (
    "SELECT 'replication', application_name || ' ' || state || ' ' || sync_state || ' sent ' || sent_lsn "
    "|| ' flushed ' || coalesce(flush_lsn::text, '-') FROM pg_stat_replication "
    "UNION ALL SELECT 'waiting', application_name || ': ' || left(query, 60) FROM pg_stat_activity "
    "WHERE wait_event = 'SyncRep'"
)


class Effects:
    """The transactional handler: one ``Effect`` row per job. A job with ``hold`` in its
    payload says it started (``entered``), then waits for ``gate``."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.gate = Event()

    def tasks(self) -> Tasks:
        tasks = Tasks()

        @tasks.task
        def effect(job: Any, session: Session) -> None:
            if job.payload.get("hold"):
                self.entered.set()
                self.gate.wait(30)
            session.add(Effect(job_id=job.id, worker="failover", note=str(job.payload["n"])))

        return tasks


def query(conninfo: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(conninfo) as conn:
        return list(conn.execute(sql).fetchall())


def test_failover_to_a_synchronous_standby_loses_no_acknowledged_job(pair: Pair, make_worker: Any) -> None:
    url = pair.url()
    engine = engine_with(url, application_name=WORKER_APP)
    models.Base.metadata.create_all(engine)
    producer = Producer(url)
    effects = Effects()
    worker = make_worker(
        engine, Task, effects.tasks(), lease=LEASE, poll_interval=0.5, sweep_interval=0.5, backoff=FAST,
        reconnect_backoff=0.5, concurrency=2, shutdown_grace=5,
    )
    new_primary = pair.standby.conninfo
    try:
        worker.start()
        producer.start()
        wait_for(lambda: worker.stats.done >= 50, what="jobs flowing through the primary")

        # The worst moment: replication stalls, so commits wait for the standby; among
        # them a transactional job's completion. Then the primary dies.
        with sessionmaker(engine, class_=QueueSession)() as session:
            held = session.enqueue(Task(task="effect", payload={"n": 0, "hold": True}))
            session.commit()
            held_id = held.id
        assert effects.entered.wait(20), "the held job never started"
        pair.freeze_replication()
        effects.gate.set()
        try:
            wait_for(lambda: query(pair.primary.conninfo, IN_FLIGHT_COMPLETIONS) != [(0,)],
                     what="a job's completion waiting for the standby")
        except AssertionError as exc:
            state = query(pair.primary.conninfo, REPLICATION_STATE)
            raise AssertionError(f"{exc}; the primary: {state}; proxy links: {pair.replication_links()}") from None
        pair.crash_primary()
        pair.cut_replication()
        wait_for(lambda: producer.errors > 0, what="the producer to meet the outage")
        pair.promote_standby()
        promoted_at, last_before = time.monotonic(), producer.tried

        def resumed() -> bool:
            rows = query(new_primary, "SELECT max((payload->>'n')::int) FROM tasks WHERE status = 'done'")
            return rows[0][0] is not None and rows[0][0] > last_before

        wait_for(resumed, timeout=RESUMED_WITHIN, interval=0.05,
                 what=f"a job enqueued after the promotion done within {RESUMED_WITHIN}s")
        resumed_after = time.monotonic() - promoted_at
        acked_then = len(producer.acked)
        wait_for(lambda: len(producer.acked) >= acked_then + 50, what="the producer going on")
        producer.stop()

        wait_for(lambda: query(new_primary, "SELECT count(*) FROM tasks WHERE status <> 'done'") == [(0,)],
                 timeout=LEASE, what="every job done (none left to its lease)")
        stored = dict(query(new_primary, "SELECT (payload->>'n')::int, id FROM tasks"))
        lost = sorted(set(producer.acked) - set(stored))
        assert not lost, f"{len(lost)} acknowledged job(s) lost in the failover: {lost[:20]}"
        written = Counter(job_id for (job_id,) in query(new_primary, "SELECT job_id FROM effects"))
        assert set(written) == set(stored.values()), "a done job without its effect, or an effect without a job"
        twice = {job_id: n for job_id, n in written.items() if n > 1}
        assert not twice, f"effects written twice: {twice}"
        assert worker.stats.swept == 0, "a job waited for its lease to run out"
        # The completions that waited for the standby did not commit there: their jobs
        # were handed back (their rows said so) and ran again, their effects once.
        assert worker.stats.released >= 1
        # And no job spent an attempt on the failover (nothing was its handler's fault):
        # a run given back let max_attempts grow with attempts, which never goes back.
        left = DEFAULT_MAX_ATTEMPTS - 1  # what one counted run leaves
        assert query(new_primary, f"SELECT count(*) FROM tasks WHERE max_attempts - attempts <> {left}") == [(0,)]
        assert query(new_primary, f"SELECT status, max_attempts - attempts FROM tasks WHERE id = {held_id}") == [
            ("done", left)]
        assert producer.errors > 0 and resumed_after <= RESUMED_WITHIN
    finally:
        effects.gate.set()
        producer.stop()
        worker.stop(grace=2)
        engine.dispose()
