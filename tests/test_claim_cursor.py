"""Cursor claims: the worker's claims start their index scan after the last job claimed.

A claimed job leaves a dead entry at the head of the pending index until vacuum removes
it, and vacuum removes none while an older transaction is open. A claim from the head
reads all of them; a cursor claim reads only what follows the last key claimed. What the
cursor passes over (a higher priority, a job a long transaction made visible late) is
found by the claims from the head the worker still runs: periodically, while they keep
finding such jobs, and at the next rescan after a cursor claim found nothing.

The cursor's rules are tested on :class:`~sqla_queue.worker.cursor.ClaimCursor` alone
(``tests/unit/test_cursor.py``); here the statements through
:class:`~sqla_queue.ops.QueueOps`, given the cursor's starts as the worker's producer gives
them, on both drivers against PostgreSQL,
with all queues, one and several (a cursor each); the whole against a held
snapshot by the index pages each claim reads; and a worker of each runtime running a job
a long transaction committed after claims had moved past it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, func, text, update
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session

from sqla_queue import QueueSession, Tasks
from sqla_queue import sql as q
from sqla_queue.ops import ClaimRequest, QueueOps
from sqla_queue.worker import cursor as cursor_module
from sqla_queue.worker.cursor import ClaimCursor

from .helpers import wait_for, wait_for_counts
from .models import Task
from .test_ops import On, add, on_driver, tokens_of
from .unit.test_cursor import T0, Clock
from .workers import TASKS, job

# -- the statements -----------------------------------------------------------------------


@pytest.fixture(params=["thread", "asyncio"])
def on(request: pytest.FixtureRequest, engine: Engine) -> Iterator[On]:
    with on_driver(request.param, engine) as found:
        yield found


def _ops(on: On, queues: tuple[str, ...] | None) -> tuple[QueueOps, ClaimCursor, Clock]:
    ops = on.ops(queues=queues)
    clock = Clock()
    assert ops.claims_after
    assert ops.after_per_queue == (queues is not None and len(queues) > 1)
    return ops, ClaimCursor(60.0, clock, per_queue=ops.after_per_queue), clock


def claim(ops: QueueOps, cursor: ClaimCursor, limit: int) -> ClaimRequest:
    """An ordinary claim, as the worker's producer asks for it: after the cursor's start,
    telling the cursor where its rows lay."""
    return ops.claim_request("w", limit, after=cursor.start(), seen=cursor.claimed)


#: The queues a worker serves, as users set them: all, one, several.
SERVED = [None, ("a",), ("a", "b")]
SERVED_IDS = ["all queues", "one queue", "two queues"]


def _late(engine: Engine, **values: Any) -> int:
    """A job that sorts before every job claimed so far, as one a long transaction wrote."""
    (found,) = add(engine, 1, run_after=func.now() - text("interval '1 hour'"), **values)
    return found


@pytest.mark.parametrize("queues", SERVED, ids=SERVED_IDS)
def test_a_cursor_claim_takes_jobs_after_the_cursor_and_finds_the_rest_from_the_head(
    engine: Engine, on: On, queues: tuple[str, ...] | None
) -> None:
    first, second, third = add(engine, 3)
    ops, cursor, clock = _ops(on, queues)
    request = claim(ops, cursor, 1)
    assert not request.from_cursor
    assert tokens_of(on(lambda conn: ops.fetch_claimed(conn, request))) == [(first, 1)]
    late = _late(engine)
    urgent = _late(engine, priority=9)
    request = claim(ops, cursor, 1)
    assert request.from_cursor
    assert tokens_of(on(lambda conn: ops.fetch_claimed(conn, request))) == [(second, 1)]
    clock.now = 60.0  # the rescan: from the head, the urgent job first
    request = claim(ops, cursor, 1)
    assert not request.from_cursor
    assert tokens_of(on(lambda conn: ops.fetch_claimed(conn, request))) == [(urgent, 1)]
    # That claim found a job behind the cursor: the next looks from the head too.
    assert not claim(ops, cursor, 1).from_cursor
    assert tokens_of(on(lambda conn: ops.fetch_claimed(conn, claim(ops, cursor, 1)))) == [(late, 1)]
    assert tokens_of(on(lambda conn: ops.fetch_claimed(conn, claim(ops, cursor, 5)))) == [(third, 1)]


@pytest.mark.parametrize("queues", SERVED, ids=SERVED_IDS)
def test_a_cursor_claim_that_finds_nothing_owes_a_claim_from_the_head_at_the_rescan(
    engine: Engine, on: On, queues: tuple[str, ...] | None
) -> None:
    (first,) = add(engine, 1)
    ops, cursor, clock = _ops(on, queues)
    assert cursor.head_claim_at() is None
    on(lambda conn: ops.fetch_claimed(conn, claim(ops, cursor, 1)))
    late = _late(engine)
    request = claim(ops, cursor, 10)
    assert request.from_cursor
    assert on(lambda conn: ops.fetch_claimed(conn, request)) == []
    assert cursor.head_claim_at() == 60.0  # the worker wakes then, though nothing told it to
    clock.now = 60.0
    request = claim(ops, cursor, 10)
    assert not request.from_cursor
    assert tokens_of(on(lambda conn: ops.fetch_claimed(conn, request))) == [(late, 1)]
    assert cursor.head_claim_at() is None
    # The same behind a completion: the token done, nothing claimed, a head claim owed.
    on(lambda conn: ops.fetch_claimed(conn, claim(ops, cursor, 10)))  # none behind now
    later = _late(engine)
    request = claim(ops, cursor, 10)
    assert request.from_cursor
    done, claimed = on(lambda conn: ops.complete_then_claim(conn, [q.ClaimToken(first, 1)], request))
    assert (done, claimed) == ({(first, 1): "done"}, [])
    assert cursor.head_claim_at() == 120.0
    clock.now = 120.0
    assert tokens_of(on(lambda conn: ops.fetch_claimed(conn, claim(ops, cursor, 10)))) == [(later, 1)]


def test_a_cursor_claim_skips_the_other_queues_and_serves_lower_priorities_after_its_own(
    engine: Engine, on: On
) -> None:
    mine = add(engine, 2, queue="a", priority=3)
    add(engine, 2, queue="b", priority=3)
    low = add(engine, 2, queue="a")
    ops, cursor, _ = _ops(on, ("a",))
    assert tokens_of(on(lambda conn: ops.fetch_claimed(conn, claim(ops, cursor, 1)))) == [(mine[0], 1)]
    request = claim(ops, cursor, 3)
    assert request.from_cursor
    assert tokens_of(on(lambda conn: ops.fetch_claimed(conn, request))) == [(mine[1], 1), (low[0], 1), (low[1], 1)]


def test_a_cursor_claim_of_several_queues_starts_each_after_its_own_cursor(engine: Engine, on: On) -> None:
    """Two queues served, one not: each served queue's claim starts after the last job
    claimed from it (a queue none was claimed from yet, from its head), and the best of
    them are taken, in the claim's order; the queue not served is never read."""
    a1, a2 = add(engine, 2, queue="a")
    add(engine, 3, queue="c")
    (b1,) = add(engine, 1, queue="b", priority=2)
    ops, cursor, clock = _ops(on, ("a", "b"))
    assert tokens_of(on(lambda conn: ops.fetch_claimed(conn, claim(ops, cursor, 1)))) == [(b1, 1)]
    late_b = _late(engine, queue="b", priority=2)  # behind b's cursor
    (b2,) = add(engine, 1, queue="b", priority=2)
    request = claim(ops, cursor, 2)
    assert request.from_cursor  # b after its cursor; a, with no cursor yet, from its head
    assert tokens_of(on(lambda conn: ops.fetch_claimed(conn, request))) == sorted([(b2, 1), (a1, 1)])
    late_a = _late(engine, queue="a")  # behind a's cursor now
    request = claim(ops, cursor, 5)
    assert request.from_cursor
    assert tokens_of(on(lambda conn: ops.fetch_claimed(conn, request))) == [(a2, 1)]
    clock.now = 60.0  # the rescan: from the head of both, the late jobs
    request = claim(ops, cursor, 5)
    assert not request.from_cursor
    assert tokens_of(on(lambda conn: ops.fetch_claimed(conn, request))) == sorted([(late_b, 1), (late_a, 1)])


def test_isolated_and_skipping_claims_always_claim_from_the_head(engine: Engine, on: On) -> None:
    add(engine, 2, queue="a")
    ops, cursor, _ = _ops(on, None)
    on(lambda conn: ops.fetch_claimed(conn, claim(ops, cursor, 1)))
    assert claim(ops, cursor, 1).from_cursor
    start = cursor.start()
    assert start is not None
    assert not ops.claim_request("w", 1, isolated=True, after=start).from_cursor
    assert not ops.claim_request("w", 1, skip=[1, 2], after=start).from_cursor


# -- under a held snapshot --------------------------------------------------------------------


def _pages_read(
    engine: Engine, after: tuple[int, datetime, int] | None, queues: tuple[str, ...] | None = None
) -> int:
    """Shared buffers the claim of one job reads (EXPLAIN ANALYZE, rolled back): from the
    cursor ``after``, or from the head. Several ``queues``: ``after`` is the first one's
    cursor, the others are read from their head."""
    stmt = q.claim_template(Task, queues=queues, fresh=True, after=after is not None)
    compiled: Any = stmt.compile(dialect=postgresql.dialect())  # type: ignore[no-untyped-call]
    values = {**compiled.params, q.OWNER_PARAM: "w", q.LIMIT_PARAM: 1, q.LEASE_PARAM: 60.0,
              q.FRESH_PARAM: 30.0, q.TIMEOUT_PARAM: None, q.TASK_NAMES_PARAM: [], q.TASK_TIMEOUTS_PARAM: []}
    if after is not None and queues is not None and len(queues) > 1:
        rest = len(queues) - 1
        values[q.AFTER_PRIORITIES_PARAM] = [after[0], *[q.HEAD_PRIORITY] * rest]
        values[q.AFTER_RUN_AFTERS_PARAM] = [after[1], *[T0] * rest]
        values[q.AFTER_KEYS_PARAM] = [after[2], *[0] * rest]
    elif after is not None:
        values[q.AFTER_PRIORITY_PARAM], values[q.AFTER_RUN_AFTER_PARAM], values[q.AFTER_KEY_PARAM] = after
    with engine.connect() as conn:
        (plan,) = conn.exec_driver_sql(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {compiled}", values).scalar_one()
        conn.rollback()
    top = plan["Plan"] if isinstance(plan, dict) else json.loads(plan)[0]["Plan"]
    assert top["Actual Rows"] == 1, top
    return int(top["Shared Hit Blocks"]) + int(top["Shared Read Blocks"])


#: The most pages a cursor claim of one job reads on a fresh table through the index
#: (a handful: the index's path and the row's page, a few dozen at most).
FRESH_PAGES_AT_MOST = 100


@pytest.mark.parametrize("queues", SERVED, ids=SERVED_IDS)
def test_under_a_held_snapshot_a_cursor_claim_reads_no_dead_entries(
    engine: Engine, queues: tuple[str, ...] | None
) -> None:
    """40,000 jobs finished while a REPEATABLE READ transaction holds the xmin horizon:
    their dead entries stay at the head of the pending index. The claim from the head
    reads pages of them all; the cursor claim a handful, as on a fresh table."""
    ids = add(engine, 40_010)
    add(engine, 10, queue="b")
    with engine.begin() as conn:
        # Statistics of the table as it is: without them (autovacuum's ANALYZE may not
        # have come yet) the planner can take 40,000 rows for a few, and scan them all.
        conn.exec_driver_sql("ANALYZE tasks")
    with engine.connect() as conn:
        row = conn.execute(text("SELECT priority, run_after, id FROM tasks WHERE id = :id"), {"id": ids[-11]}).one()
    last = (int(row[0]), row[1], int(row[2]))
    fresh_pages = _pages_read(engine, last, queues)
    if fresh_pages > FRESH_PAGES_AT_MOST:
        # Seen once on PostgreSQL 18 (the compatibility run), two queues: a plan that read
        # the whole table although it had just been analyzed. There is then no head to
        # compare with: the case this test is about did not come up.
        pytest.xfail(f"the cursor claim read {fresh_pages} pages of a fresh table: a plan that reads it all")
    url = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM tasks").fetchone()  # the snapshot is taken
        with engine.begin() as conn:
            conn.execute(update(TASKS).where(TASKS.c.id <= ids[-11]).values(status="done", finished_at=func.now()))
        from_head = _pages_read(engine, None, queues)
        from_cursor = _pages_read(engine, last, queues)
        holder.rollback()
    # The finished rows' new versions move the live ones a page or two, no more.
    assert from_cursor <= 2 * fresh_pages, (from_cursor, fresh_pages)
    # And the head's claim does read them all: over 800 pages here, against a few dozen.
    assert from_head > 10 * from_cursor, (from_head, from_cursor)


# -- a worker ---------------------------------------------------------------------------


@pytest.mark.parametrize("queues", [None, ("default", "other")], ids=["all queues", "two queues"])
def test_a_job_a_long_transaction_commits_behind_the_cursor_runs_at_the_next_rescan(
    engine: Engine, start_worker: Any, monkeypatch: pytest.MonkeyPatch, queues: tuple[str, ...] | None
) -> None:
    """A transaction enqueues a job (due 30 s ago) and stays open while the worker runs
    twenty jobs enqueued after it, so its cursor moves past the job. Once the
    transaction commits, its wake-up's cursor claim finds nothing, and the worker claims
    from the head at the rescan (a second here), not at the poll a minute away."""
    monkeypatch.setattr(cursor_module, "RESCAN_INTERVAL", 1.0)
    tasks = Tasks()
    ran: list[int] = []
    lock = threading.Lock()

    @tasks.task
    def noop(job: Any) -> None:
        with lock:
            ran.append(job.id)

    worker = start_worker(tasks, poll_interval=60.0, queues=queues)
    with QueueSession(engine) as long_transaction:
        # Due since well before the jobs after it (by more than the cursor's slack).
        since = datetime.now(UTC) - timedelta(seconds=30)
        late = long_transaction.enqueue(Task(task="noop", payload={}, run_after=since))
        long_transaction.flush()
        others: list[int] = []
        for n in range(20):
            with QueueSession(engine) as session:
                other = session.enqueue(Task(task="noop", payload={"n": n}))
                session.commit()
                others.append(other.id)
        wait_for(lambda: len(ran) == 20, what="the jobs enqueued after it done")
        assert job(engine, others[-1]).run_after > job_run_after(long_transaction, late.id)
        late_id = late.id
        long_transaction.commit()
    wait_for(lambda: late_id in ran, timeout=30, what="the late job run at the rescan, not at the poll")
    # Every job ran once and is counted done: a count follows its completion's commit, so
    # it is waited for, not read once.
    assert sorted(ran) == sorted([*others, late_id])
    wait_for_counts(worker, done=21)


def job_run_after(session: Session, job_id: int) -> Any:
    return session.execute(text("SELECT run_after FROM tasks WHERE id = :id"), {"id": job_id}).scalar_one()


# -- plans made on an empty table ---------------------------------------------------------


@contextmanager
def no_autovacuum(engine: Engine) -> Iterator[None]:
    """No automatic VACUUM or ANALYZE of ``tasks`` inside the block: a server with
    autovacuum on (the embedded one) would make the plans anew at a moment of its own."""
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE tasks SET (autovacuum_enabled = false)"))
    try:
        yield
    finally:
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE tasks RESET (autovacuum_enabled)"))


# Its premise (PostgreSQL keeps a generic plan made on an empty table) held on the
# embedded PostgreSQL 18 of the compatibility run only now and then, in two test processes;
# what it tests, the runtime's re-planning, is the same Python on both series.
@pytest.mark.not_compat
def test_a_plan_made_while_the_table_was_empty_is_not_kept_as_it_grows(engine: Engine, on: On) -> None:
    """psycopg prepares a statement run five times; after five more, PostgreSQL settles
    on its generic plan and keeps it until something invalidates it. Made on an empty
    table, that plan reads the whole table (a sequential scan), and would for every claim
    as the table grows. The runtime's connections discard their plans every
    ``REPLAN_INTERVAL``: the next claim is planned for the table as it is, and takes the
    index. (Scans are counted in the claim's own transaction: no other backend's.)"""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        # A table with no pages (the suite empties tables by DELETE) and the statistics of
        # an empty table, as after a deploy.
        conn.execute(text("TRUNCATE tasks CASCADE"))
        conn.execute(text("VACUUM ANALYZE tasks"))
    ops = on.ops()  # claims from the head (no start given): one statement throughout

    def scans_of_one_claim(conn: Any) -> int:
        conn.query("BEGIN")
        try:
            claimed = ops.fetch_claimed(conn, ops.claim_request("w", 1))
            ((found,),) = conn.query("SELECT seq_scan FROM pg_stat_xact_user_tables WHERE relname = 'tasks'")
        finally:
            conn.query("COMMIT")
        assert len(claimed) == 1
        return int(found)

    def scenario(conn: Any) -> tuple[int, int, int]:
        conn._replan_at = float("inf")  # the interval does not pass by itself, however slow the machine
        for _ in range(12):  # planned on the empty table, then settled on that plan
            assert ops.fetch_claimed(conn, ops.claim_request("w", 1)) == []
        ((generic,),) = conn.query(
            "SELECT generic_plans FROM pg_prepared_statements WHERE statement LIKE 'UPDATE tasks%'"
        )
        add(engine, 20_000, status="done")
        add(engine, 10)
        kept = scans_of_one_claim(conn)
        conn._replan_at = 0.0  # the interval has passed
        return int(generic), kept, scans_of_one_claim(conn)

    with no_autovacuum(engine):
        generic, kept, replanned = on(scenario)
    assert generic >= 1 and kept >= 1, "the empty table's plan was not kept: the premise of this test is gone"
    assert replanned == 0, "the claim after the interval scanned the whole table"


@pytest.mark.parametrize("limit", [1, 3])
def test_under_a_plan_made_on_an_empty_table_a_claim_and_a_sweep_take_at_most_their_limit(
    engine: Engine, on: On, limit: int
) -> None:
    """That plan joins the table to the claim's ``LIMIT n FOR UPDATE SKIP LOCKED`` as a
    nested loop's inner side, run again for every outer row: each run locked rows the
    last did not, and a claim of one took every pending job. The keys are picked once."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("TRUNCATE tasks CASCADE"))  # no pages: the plan of an empty table
        conn.execute(text("VACUUM ANALYZE tasks"))
    ops = on.ops()

    def scenario(conn: Any) -> tuple[list[Any], list[Any]]:
        for _ in range(12):
            assert ops.fetch_claimed(conn, ops.claim_request("w", limit)) == []
            assert list(ops.sweep(conn, limit=limit).jobs) == []
        add(engine, 20)
        add(engine, 20, status="running", lease_owner="gone", lease_expires_at=func.now() - text("interval '1 minute'"))
        return ops.fetch_claimed(conn, ops.claim_request("w", limit)), list(ops.sweep(conn, limit=limit).jobs)

    claimed, swept = on(scenario)
    assert (len(claimed), len(swept)) == (limit, limit)
