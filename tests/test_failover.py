"""What a worker sees while a standby is promoted, short of a real failover (that one is
in :mod:`tests.test_standby_failover`): a commit whose answer never came, and sessions on
a read-only server.

- A transactional job whose commit was cut (through :mod:`tests.proxy`) is settled by its
  row, not by its lease running out: not committed, it is handed back and runs again at
  once; committed, it counts as done and never runs again.
- A read-only transaction (SQLSTATE 25006) in the worker's own statements is a lost
  connection: the worker connects again instead of failing jobs; the same error raised
  by a handler is the handler's failure, with the backoff.

Both runtimes; every wait is a poll with a deadline.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, event, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from sqla_queue import Tasks
from sqla_queue.driver import Driver
from sqla_queue.model import DEFAULT_MAX_ATTEMPTS

from .helpers import Server, wait_for, wait_for_counts
from .models import Effect, Task
from .proxy import proxied
from .workers import FAST, add, engine_with, job

pytestmark = pytest.mark.system

#: Long enough that a job left to its lease would miss every deadline below.
LEASE = 30.0
#: A job settled by its row is running again (or done) well within this: a third of the
#: lease, so a job that waited for the sweeper fails the test.
SETTLED_WITHIN = LEASE / 3


def _app(what: str) -> str:
    return f"sqla_queue_failover_{what}_{uuid.uuid4().hex[:8]}"


def _options(**options: Any) -> dict[str, Any]:
    return {"lease": LEASE, "poll_interval": 0.5, "sweep_interval": 0.2, "backoff": FAST, "concurrency": 1,
            **options}


class Effects:
    """A transactional handler writing one ``Effect`` row per attempt, its runs counted."""

    def __init__(self) -> None:
        self.runs: Counter[tuple[int, int]] = Counter()

    def of(self, job_id: int) -> int:
        return sum(n for (i, _), n in self.runs.items() if i == job_id)

    def tasks(self) -> Tasks:
        tasks = Tasks()

        @tasks.task
        def effect(job: Any, session: Session) -> None:
            self.runs[(job.id, job.attempts)] += 1
            session.add(Effect(job_id=job.id, worker="test", note=f"attempt {job.attempts}"))

        @tasks.task
        def read_only_once(job: Any, session: Session) -> None:
            """Writes on attempt 1 in a read-only transaction: the handler's own 25006."""
            self.runs[(job.id, job.attempts)] += 1
            if job.attempts == 1:
                session.execute(text("SET LOCAL transaction_read_only = on"))
            session.add(Effect(job_id=job.id, worker="test", note=f"attempt {job.attempts}"))

        return tasks


def effects_of(engine: Engine, job_id: int) -> list[str]:
    with engine.connect() as conn:
        return list(conn.scalars(select(Effect.note).where(Effect.job_id == job_id)))


# -- a commit whose answer never came -------------------------------------------------------


def test_a_commit_cut_before_it_landed_runs_the_job_again_at_once(
    engine: Engine, Sessions: Any, server: Server, make_worker: Any
) -> None:
    """The COMMIT of the handler's transaction never reaches the server (it died, or the
    link did): nothing was recorded, so the job is handed back at once, its attempt not
    counted, and runs again under a new attempt number, its effect written once."""
    effects = Effects()
    with proxied(server, _app("cut_commit")) as (proxy, worker_engine):
        worker = make_worker(worker_engine, Task, effects.tasks(), **_options())
        worker.start()
        try:
            wait_for(worker.idle, what="the worker idle")
            trap = proxy.cut_before(b"COMMIT")
            (job_id,) = add(Sessions, "effect")
            assert trap.fired.wait(20), "the handler's transaction never committed"
            wait_for(lambda: job(engine, job_id).status == "done", timeout=SETTLED_WITHIN,
                     what="the job to run again and finish, before its lease ran out")
            row = job(engine, job_id)
            assert (row.attempts, row.max_attempts) == (2, DEFAULT_MAX_ATTEMPTS + 1), row.last_error
            assert effects.runs == Counter({(job_id, 1): 1, (job_id, 2): 1})
            assert effects_of(engine, job_id) == ["attempt 2"]
            wait_for_counts(worker, swept=0, released=1, done=1)  # the counts follow the rows, a moment later
        finally:
            worker.stop(grace=1)


def test_a_commit_that_landed_unseen_counts_as_done_and_never_runs_again(
    engine: Engine, Sessions: Any, server: Server, make_worker: Any
) -> None:
    """The COMMIT reaches the server, which commits; its answer is lost with the
    connection. The worker reads the row (done, by its owner and attempt): done, not lost,
    and the job does not run again."""
    effects = Effects()
    with proxied(server, _app("lost_commit")) as (proxy, worker_engine):
        worker = make_worker(worker_engine, Task, effects.tasks(), **_options())
        worker.start()
        try:
            wait_for(worker.idle, what="the worker idle")
            trap = proxy.lose_answer(b"COMMIT", with_rows=False)
            (job_id,) = add(Sessions, "effect")
            assert trap.fired.wait(20), "the handler's transaction never committed"
            wait_for(lambda: worker.stats.done == 1, timeout=SETTLED_WITHIN, what="the job counted done")
            (second,) = add(Sessions, "effect")  # the worker goes on, on a new connection
            wait_for(lambda: job(engine, second).status == "done", what="the next job done")
            row = job(engine, job_id)
            assert (row.status, row.attempts, effects.of(job_id)) == ("done", 1, 1)
            assert effects_of(engine, job_id) == ["attempt 1"]
            assert (worker.stats.lost, worker.stats.released, worker.stats.swept) == (0, 0, 0)
        finally:
            worker.stop(grace=1)


# -- read-only sessions ----------------------------------------------------------------------


def _read_only_error(engine: Engine) -> DBAPIError:
    with engine.connect() as conn:
        conn.execute(text("SET TRANSACTION READ ONLY"))
        with pytest.raises(DBAPIError) as caught:
            conn.execute(text("CREATE TEMPORARY TABLE t_read_only_probe (x int)"))
        conn.rollback()
    return caught.value


def test_a_read_only_transaction_is_a_connection_condition(engine: Engine, server: Server) -> None:
    error = _read_only_error(engine)
    assert isinstance(error.orig, psycopg.errors.ReadOnlySqlTransaction)
    assert "read-only transaction" in str(error.orig)
    assert Driver.is_connection_error(error) and Driver.is_connection_error(error.orig)
    with psycopg.connect(server.conninfo) as conn, pytest.raises(psycopg.errors.UniqueViolation) as unique:
        conn.execute("CREATE TEMPORARY TABLE t_probe (x int PRIMARY KEY); INSERT INTO t_probe VALUES (1), (1)")
    assert not Driver.is_connection_error(unique.value)
    assert not Driver.is_connection_error(ValueError("a handler's own"))


def test_a_worker_on_a_read_only_server_connects_again_and_spends_no_attempt(
    server: Server, engine: Engine, Sessions: Any, make_worker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Every connection reaches a read-only server (a pooler or an address still pointing
    at the old primary, now a standby) until "the primary is back": the worker's claims
    fail with 25006 meanwhile, and it connects again rather than going on with a
    connection that can never write. The job then runs once, on its first attempt."""
    caplog.set_level(logging.WARNING, logger="sqla_queue.worker")
    promoted = threading.Event()
    worker_engine = engine_with(server.url)
    effects = Effects()
    worker = make_worker(worker_engine, Task, effects.tasks(), **_options(reconnect_backoff=0.2))
    made = worker.engine  # the asyncio runtime's engine is one of its own
    connecting = getattr(made, "sync_engine", made)

    @event.listens_for(connecting, "connect")
    def read_only_until_promoted(dbapi_connection: Any, record: Any) -> None:
        if not promoted.is_set():
            cur = dbapi_connection.cursor()
            cur.execute("SET SESSION default_transaction_read_only = on")
            cur.close()
            dbapi_connection.commit()

    try:
        (job_id,) = add(Sessions, "effect", max_attempts=1)
        worker.start()
        wait_for(lambda: "ReadOnlySqlTransaction" in caplog.text, what="a claim refused by the read-only server")
        assert effects.of(job_id) == 0 and job(engine, job_id).status == "pending"
        promoted.set()
        wait_for(lambda: job(engine, job_id).status == "done", timeout=SETTLED_WITHIN,
                 what="the job done on a new connection")
        row = job(engine, job_id)
        assert (row.attempts, effects.of(job_id), row.last_error) == (1, 1, None)
    finally:
        worker.stop(grace=1)
        worker_engine.dispose()


def test_a_handlers_own_read_only_error_is_its_failure_with_the_backoff(
    engine: Engine, Sessions: Any, start_worker: Callable[..., Any]
) -> None:
    """25006 raised by the handler, on the worker's healthy connection, is the job's
    failure: the attempt is spent and retried after the backoff (not handed back with it
    not counted, as a lost connection is)."""
    effects = Effects()
    start_worker(effects.tasks(), lease=LEASE)
    (job_id,) = add(Sessions, "read_only_once")
    wait_for(lambda: job(engine, job_id).status == "done", what="the job done on its second attempt")
    row = job(engine, job_id)
    assert (row.attempts, effects.of(job_id)) == (2, 2)
    assert "read-only transaction" in (row.last_error or "")
    assert effects_of(engine, job_id) == ["attempt 2"]


def test_a_job_whose_connection_cannot_be_had_goes_back_unspent(
    server: Server, engine: Engine, Sessions: Any, make_worker: Any
) -> None:
    """A batch whose first transactional job loses the worker's connection, while the
    server refuses new ones for a moment (a failover): the next job of the batch, whose
    handler never ran, goes back with its attempt not counted, not failed with one spent."""
    worker_engine = engine_with(server.url)
    runs: Counter[int] = Counter()
    refusals = {"left": 0}
    tasks = Tasks()

    @tasks.task
    def effect(job: Any, session: Session) -> None:
        runs[job.id] += 1
        if job.payload.get("kill") and runs[job.id] == 1:
            refusals["left"] = 3  # the next connections are refused, as during a promotion
            session.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))
        session.add(Effect(job_id=job.id, worker="test", note=f"attempt {job.attempts}"))

    worker = make_worker(worker_engine, Task, tasks, **_options(reconnect_backoff=0.2, batch_size=8))
    made = worker.engine
    connecting = getattr(made, "sync_engine", made)

    @event.listens_for(connecting, "connect")
    def refuse(dbapi_connection: Any, record: Any) -> None:
        if refusals["left"] > 0:
            refusals["left"] -= 1
            raise psycopg.OperationalError("the database system is in recovery mode (from the test)")

    try:
        worker.start()
        warm = add(Sessions, "effect", 30)  # measured fast: the executor claims batches
        wait_for(lambda: all(job(engine, i).status == "done" for i in warm), what="the warm-up jobs done")
        wait_for(worker.idle, what="the worker idle")
        with Sessions() as session:
            jobs = [session.enqueue(Task(task="effect", payload={"kill": n == 0})) for n in range(4)]
            session.commit()
            ids = [j.id for j in jobs]
        wait_for(lambda: all(job(engine, i).status == "done" for i in ids), timeout=SETTLED_WITHIN,
                 what="the batch done")
        assert refusals["left"] == 0
        rows = {i: job(engine, i) for i in ids}
        # No attempt counted but the run that committed (max_attempts grew with the others).
        assert {i: r.max_attempts - r.attempts for i, r in rows.items()} == dict.fromkeys(ids, DEFAULT_MAX_ATTEMPTS - 1)
        assert all(effects_of(engine, i) == [f"attempt {r.attempts}"] for i, r in rows.items())
        assert worker.stats.retried == 0
    finally:
        worker.stop(grace=1)
        worker_engine.dispose()
