"""The driver seam, one set of tests run on each driver: psycopg on threads and psycopg's
asyncio connections in the runtime's greenlets. Real PostgreSQL throughout."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, select, text
from sqlalchemy.ext.asyncio import create_async_engine

from sqla_queue import sql as q
from sqla_queue.driver import AsyncDriver, DbConnection, Driver
from sqla_queue.ops import token_values
from sqla_queue.runtime import run_in_greenlet

from .helpers import wait_for
from .models import Task
from .workers import TASKS, EventLoopThread

Body = Callable[[Driver, DbConnection], Any]
#: Where the key and the attempt are in a claimed row (every column, in table order).
PK, ATTEMPT = list(TASKS.c).index(TASKS.c.id), list(TASKS.c).index(TASKS.c.attempts)


@pytest.fixture(params=["thread", "asyncio"])
def on_driver(request: pytest.FixtureRequest, engine: Engine) -> Iterator[Callable[[Body], Any]]:
    """``on_driver(body)`` runs ``body(driver, conn)`` on a fresh connection of that driver."""
    if request.param == "thread":
        driver = Driver(engine)

        def run(body: Body) -> Any:
            conn = driver.connect("sqla_queue test driver")
            try:
                return body(driver, conn)
            finally:
                conn.close()

        yield run
        return
    loop = EventLoopThread()
    async_engine = create_async_engine(engine.url)
    async_driver = AsyncDriver(async_engine)

    def in_greenlet(body: Body) -> Any:
        conn = async_driver.connect("sqla_queue test driver")
        try:
            return body(async_driver, conn)
        finally:
            conn.close()

    try:
        yield lambda body: loop.run(run_in_greenlet(in_greenlet, body))
    finally:
        loop.run(async_engine.dispose())
        loop.close()


def _jobs(engine: Engine, n: int) -> list[int]:
    with engine.begin() as conn:
        return list(conn.scalars(TASKS.insert().values([{"task": "t"}] * n).returning(TASKS.c.id)))


def _statuses(engine: Engine) -> dict[int, str]:
    with engine.connect() as conn:
        return {row.id: row.status for row in conn.execute(select(TASKS.c.id, TASKS.c.status))}


def _complete_then_claim(limit: int) -> Body:
    """Claim one job, then record it done and claim ``limit`` more in one call."""

    def body(driver: Driver, conn: DbConnection) -> Any:
        claim = driver.compile(q.claim_template(Task))
        values = {q.OWNER_PARAM: "w", q.LIMIT_PARAM: 1, q.LEASE_PARAM: 60.0}
        (first,) = conn.execute(claim, values)
        job_id, attempt = first[PK], first[ATTEMPT]
        both = driver.compile(q.complete_many_if_owner_then_claim(Task))
        params = {**token_values("w", [(job_id, attempt)]), **values, q.LIMIT_PARAM: limit}
        try:
            rows: list[Any] = conn.fetch_claimed(both, params, PK, ATTEMPT)
        except psycopg.Error as exc:
            return job_id, exc
        # The last column tells a completed token's row from a claimed one.
        return job_id, ([(r[PK], r[ATTEMPT]) for r in rows if r[-1]], [r for r in rows if not r[-1]])

    return body


def test_a_completion_and_the_next_claim_commit_together(engine: Engine, on_driver: Any) -> None:
    ids = _jobs(engine, 3)
    first, (done, claimed) = on_driver(_complete_then_claim(2))
    assert done == [(first, 1)]
    statuses = _statuses(engine)
    assert statuses[first] == "done"
    assert sorted(row[PK] for row in claimed) == sorted(set(ids) - {first})
    assert {statuses[i] for i in set(ids) - {first}} == {"running"}


def test_a_failing_claim_rolls_its_completion_back(engine: Engine, on_driver: Any) -> None:
    """The completion and the claim are one transaction: when the claim fails, the
    completion does not stand alone (the caller records it again), and the connection
    stays usable."""
    ids = _jobs(engine, 2)

    def body(driver: Driver, conn: DbConnection) -> Any:
        first, outcome = _complete_then_claim(-1)(driver, conn)  # LIMIT -1: the claim fails
        assert isinstance(outcome, psycopg.Error), outcome
        assert "LIMIT must not be negative" in str(outcome)
        assert conn.query("SELECT 1") == [(1,)]
        return first

    first = on_driver(body)
    statuses = _statuses(engine)
    assert statuses[first] == "running", "the completion committed without its claim"
    assert {statuses[i] for i in ids if i != first} == {"pending"}


def test_a_call_past_its_deadline_is_cancelled_on_the_server(engine: Engine, on_driver: Any) -> None:
    """A cut connection's backend runs on until it next writes to its client: a statement
    waiting for a lock would keep the row locks it took. The driver asks the server to
    cancel it, so the locks go at once, not when the blocker lets go."""
    first, second = _jobs(engine, 2)
    blocker = engine.connect()
    try:
        blocker.begin()
        blocker.execute(TASKS.update().where(TASKS.c.id == second).values(task="held"))

        def body(driver: Driver, conn: DbConnection) -> Any:
            statement = driver.compile(TASKS.update().values(task="cut"))  # first, then second
            pid = conn.raw.info.backend_pid
            with pytest.raises(psycopg.OperationalError), driver.deadline(conn, 0.3):
                conn.execute(statement, {})
            assert conn.broken
            return pid

        pid = on_driver(body)

        def gone() -> bool:
            with engine.connect() as probe:
                waiting = probe.scalar(
                    text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid AND state = 'active'"),
                    {"pid": pid},
                )
            return bool(waiting == 0)

        wait_for(gone, timeout=10, what="the cut statement to end on the server")
        with engine.connect() as probe:  # the first row's lock went with it
            probe.execute(text("SET lock_timeout = '2s'"))
            probe.execute(TASKS.update().where(TASKS.c.id == first).values(task="free"))
            probe.rollback()
    finally:
        blocker.rollback()
        blocker.close()
