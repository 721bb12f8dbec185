"""Claims, leases and recovery under faults: a connection that stops answering, a claim
whose answer is lost, a row no claim can update, slow jobs at a cold start.

Network faults go through :mod:`tests.proxy`, a real TCP proxy in front of the test
server. Both runtimes throughout; every wait is a poll with a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, select, text

from sqla_queue import Tasks
from sqla_queue.driver import DbConnection
from sqla_queue.model import DEFAULT_MAX_ATTEMPTS
from sqla_queue.runtime import Event, sleep
from sqla_queue.worker.config import check_options
from sqla_queue.worker.context import WorkerContext
from sqla_queue.worker.cursor import ClaimCursor
from sqla_queue.worker.hooks import Hooks
from sqla_queue.worker.ledger import Ledger
from sqla_queue.worker.producer import NEXT_DUE_PAUSE, Producer
from sqla_queue.worker.stats import WorkerStats
from sqla_queue.worker.work_signal import WorkSignal

from .helpers import Server, wait_for, wait_for_counts
from .models import Task
from .proxy import CLAIM_MARKER, Link, proxied
from .test_ops import On, on_driver
from .workers import TASKS, Runtimes, add, all_status, job

LEASE = 2.0


def _app(what: str) -> str:
    return f"sqla_queue_faults_{what}_{uuid.uuid4().hex[:8]}"


class Runs:
    """The handlers' runs, counted by (job id, attempt), and a gate ``hold`` jobs wait on."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[int, int]] = Counter()
        self.release = Event()

    def of(self, job_id: int) -> int:
        return sum(n for (i, _), n in self.counts.items() if i == job_id)

    def tasks(self) -> Tasks:
        tasks = Tasks()

        @tasks.task
        def stamp(job: Any) -> None:
            self.counts[(job.id, job.attempts)] += 1

        @tasks.task
        def hold(job: Any) -> None:
            self.counts[(job.id, job.attempts)] += 1
            self.release.wait(60)

        return tasks


@pytest.fixture
def runs() -> Iterator[Runs]:
    found = Runs()
    yield found
    found.release.set()


def _options(**options: Any) -> dict[str, Any]:
    return {"lease": LEASE, "heartbeat_interval": 0.3, "poll_interval": 0.5, "sweep_interval": 0.2, **options}


# -- 3. a connection that stops answering ------------------------------------------------


def _claimed(link: Link) -> bool:
    return "claim" in link.tags


def test_an_executor_whose_connection_stops_answering_is_cut_and_its_job_recorded(
    engine: Engine, Sessions: Any, server: Server, make_worker: Any, runs: Runs
) -> None:
    """The executors' connections freeze behind a proxy that still acknowledges packets
    (TCP keepalive never fires) while a handler runs. Its completion must be cut by the
    statement deadline and made again on a new connection, within that deadline and a
    margin, while the frozen connections stay frozen; new jobs are picked up meanwhile.
    Without a deadline the job stays ``running`` for good, its lease renewed by the
    healthy heartbeat."""
    with proxied(server, _app("frozen")) as (proxy, worker_engine):
        worker = make_worker(worker_engine, Task, runs.tasks(), **_options(concurrency=2))
        deadline = LEASE / 2  # the executors' statement deadline: half the lease
        worker.start()
        try:
            (held,) = add(Sessions, "hold")
            wait_for(lambda: runs.of(held) == 1, what="the held job to start")
            # On a busy machine the idle executor's first claim (its connection's first
            # statement) can come after the held job started: wait for both.
            wait_for(lambda: sum(_claimed(link) for link in proxy.links) == 2, what="both executors' claims")
            frozen = proxy.freeze(_claimed)
            assert len(frozen) == 2, [sorted(link.tags) for link in proxy.links]  # the two executors'
            runs.release.set()
            frozen_at = time.monotonic()
            wait_for(lambda: job(engine, held).status == "done", timeout=deadline + 15,
                     what="the job recorded done on a new connection")
            took = time.monotonic() - frozen_at
            (fresh,) = add(Sessions, "stamp")
            wait_for(lambda: job(engine, fresh).status == "done", timeout=deadline + 15, what="a new job done")
            assert not any(link.thawed for link in frozen), "the frozen connections thawed"
            print(f"\nfrozen executor connections: the finished job was recorded {took:.2f}s later "
                  f"(statement deadline {deadline:.1f}s)")
            assert took <= deadline + 3.0, f"recorded {took:.2f}s after the freeze (deadline {deadline}s)"
            assert (job(engine, held).attempts, runs.of(held)) == (1, 1)
            assert (worker.stats.lost, worker.stats.swept) == (0, 0)
            assert worker.config.statement_deadline == deadline
        finally:
            runs.release.set()
            proxy.thaw()
            worker.stop(grace=1)


def test_an_idle_executor_whose_connection_stops_answering_claims_again(
    engine: Engine, Sessions: Any, server: Server, make_worker: Any, runs: Runs
) -> None:
    """The executor's connection freezes while it waits for work: its next claim (or
    the look for due jobs before it waits) is cut by the deadline, and the job that
    woke it is claimed on a new connection."""
    with proxied(server, _app("frozen_idle")) as (proxy, worker_engine):
        worker = make_worker(worker_engine, Task, runs.tasks(), **_options(concurrency=1))
        deadline = LEASE / 2
        worker.start()
        try:
            wait_for(lambda: worker.idle() and any(_claimed(link) for link in proxy.links), what="the worker idle")
            frozen = proxy.freeze(_claimed)
            assert len(frozen) == 1
            (fresh,) = add(Sessions, "stamp")
            began = time.monotonic()
            wait_for(lambda: job(engine, fresh).status == "done", timeout=deadline + 15, what="the job done")
            took = time.monotonic() - began
            assert not frozen[0].thawed
            assert took <= deadline + 3.0, f"picked up {took:.2f}s after it was enqueued (deadline {deadline}s)"
            assert (job(engine, fresh).attempts, runs.of(fresh)) == (1, 1)
        finally:
            proxy.thaw()
            worker.stop(grace=1)


# -- 9. a claim whose answer is lost ------------------------------------------------------


def test_a_claim_whose_answer_is_lost_gives_its_jobs_back_unspent(
    engine: Engine, Sessions: Any, server: Server, make_worker: Any, runs: Runs
) -> None:
    """The claim commits, then the connection drops before its rows reach the worker.
    With ``max_attempts=1`` the job must still run, once, and end ``done``: the lost
    claim is not counted (``max_attempts`` grows by one; its attempt number is never
    handed out again). (Before: it waited a whole lease, was swept, and, its only
    attempt spent, dead-lettered without ever running.)"""
    with proxied(server, _app("lost_claim")) as (proxy, worker_engine):
        worker = make_worker(worker_engine, Task, runs.tasks(), **_options(concurrency=1))
        worker.start()
        try:
            wait_for(worker.idle, what="the worker idle")
            trap = proxy.lose_answer(CLAIM_MARKER)
            (job_id,) = add(Sessions, "stamp", max_attempts=1)
            assert trap.fired.wait(20), "no claim took the job"
            wait_for(lambda: job(engine, job_id).status in ("done", "failed"), timeout=LEASE * 3 + 10,
                     what="the job to finish")
            row = job(engine, job_id)
            assert (row.status, row.attempts, row.max_attempts, runs.of(job_id)) == ("done", 2, 2, 1), (
                row.status, row.last_error)
            assert worker.stats.swept == 0
        finally:
            worker.stop(grace=1)


def test_a_completion_and_claim_whose_answer_is_lost_give_the_claimed_jobs_back_unspent(
    engine: Engine, Sessions: Any, server: Server, make_worker: Any, runs: Runs
) -> None:
    """The statement that records a job done and claims the next is lost the same way:
    the finished job stays done, and the claimed one runs once and ends done."""
    with proxied(server, _app("lost_combined")) as (proxy, worker_engine):
        worker = make_worker(worker_engine, Task, runs.tasks(), **_options(concurrency=1))
        worker.start()
        try:
            (first,) = add(Sessions, "hold", max_attempts=1)
            wait_for(lambda: runs.of(first) == 1, what="the first job to start")
            (second,) = add(Sessions, "stamp", max_attempts=1)  # claimed with first's completion
            trap = proxy.lose_answer(CLAIM_MARKER)
            runs.release.set()
            assert trap.fired.wait(20), "the completion and claim did not run"
            wait_for(all_status(engine, [first, second], "done", "failed"), timeout=LEASE * 3 + 10,
                     what="both jobs to finish")
            rows = {i: job(engine, i) for i in (first, second)}
            # second's lost claim is not counted: max_attempts grew by one.
            assert {i: (r.status, r.attempts - r.max_attempts) for i, r in rows.items()} == {
                first: ("done", 0), second: ("done", 0)}
            assert (rows[first].attempts, rows[second].attempts) == (1, 2)
            assert (runs.of(first), runs.of(second)) == (1, 1)
        finally:
            runs.release.set()
            worker.stop(grace=1)


def test_claims_cut_short_behind_a_lock_claim_nothing_when_it_goes(
    engine: Engine, Sessions: Any, server: Server, make_worker: Any, runs: Runs
) -> None:
    """The table is locked for longer than the lease while a job runs and another falls
    due: the idle executor's claims wait on the lock and are cut by the deadline, but the
    server runs them when the lock goes, and no one would see their rows (the running
    job's lease lapsed meanwhile, so they could not be told from it). They must claim
    nothing: the due job (``max_attempts=1``) is claimed afresh, runs once, ends done."""
    from .workers import engine_with

    app = _app("locked")
    worker_engine = engine_with(server.url, application_name=app)
    options = _options(concurrency=2, lease=1.0, heartbeat_interval=0.2, poll_interval=0.2)
    worker = make_worker(worker_engine, Task, runs.tasks(), **options)
    worker.start()
    try:
        (held,) = add(Sessions, "hold")
        wait_for(lambda: runs.of(held) == 1, what="the held job to start")
        with engine.connect() as locker:
            locker.execute(text("LOCK TABLE tasks IN ACCESS EXCLUSIVE MODE"))
            # Committed with the lock's release: every claim waiting on it will see it.
            (job_id,) = locker.execute(text(
                "INSERT INTO tasks (task, max_attempts, run_after) "
                "VALUES ('stamp', 1, now() - interval '1 second') RETURNING id")).scalars()
            wait_for(lambda: worker.stats.lost == 1, timeout=10, what="the held job's lease given up")
            locked_at = time.monotonic()
            wait_for(lambda: time.monotonic() - locked_at > 1.0, what="more claims cut behind the lock")
            locker.commit()
        runs.release.set()
        wait_for(lambda: job(engine, job_id).status in ("done", "failed"), timeout=20, what="the job to finish")
        row = job(engine, job_id)
        assert (row.status, row.attempts, runs.of(job_id)) == ("done", 1, 1), (row.status, row.last_error)
    finally:
        runs.release.set()
        worker.stop(grace=1)
        worker_engine.dispose()


def test_a_worker_name_too_long_for_its_executors_owner_names_is_refused(engine: Engine, make_worker: Any) -> None:
    """Each executor claims under ``{name}:{suffix}/{executor}.{n}`` in the
    200-character ``lease_owner``: a name that leaves no room fails when the worker is
    built, not at every claim."""
    from sqla_queue.worker import WorkerConfig

    assert WorkerConfig(name="n" * 150).name == "n" * 150
    with pytest.raises(ValueError, match="name must be at most 150 characters"):
        make_worker(engine, Task, Tasks(), name="n" * 151)


# -- 12. a row the claim cannot update -------------------------------------------------------

FAULT_FUNCTION = "sqla_queue_test_refuse_one"
FAULT_TRIGGER = "sqla_queue_test_refuse_one"
FAULT_CHECK = "sqla_queue_test_no_bad_payload"


def _install(engine: Engine, fault: str, bad: int) -> None:
    with engine.begin() as conn:
        if fault == "not_valid_check":
            conn.execute(text("UPDATE tasks SET payload = '{\"bad\": true}' WHERE id = :id"), {"id": bad})
            conn.execute(text(f"ALTER TABLE tasks ADD CONSTRAINT {FAULT_CHECK} CHECK (NOT payload ? 'bad') NOT VALID"))
            return
        when = "NEW.status = 'running'" if fault == "trigger_on_claim" else "true"
        conn.execute(text(
            f"CREATE FUNCTION {FAULT_FUNCTION}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            f"IF OLD.id = {int(bad)} AND {when} THEN RAISE EXCEPTION 'job % is frozen by policy', OLD.id; END IF; "
            f"RETURN NEW; END $$"
        ))
        conn.execute(text(
            f"CREATE TRIGGER {FAULT_TRIGGER} BEFORE UPDATE ON tasks FOR EACH ROW EXECUTE FUNCTION {FAULT_FUNCTION}()"
        ))


def _remove(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE tasks DROP CONSTRAINT IF EXISTS {FAULT_CHECK}"))
        conn.execute(text(f"DROP TRIGGER IF EXISTS {FAULT_TRIGGER} ON tasks"))
        conn.execute(text(f"DROP FUNCTION IF EXISTS {FAULT_FUNCTION}()"))


@pytest.mark.parametrize("fault", ["trigger", "not_valid_check", "trigger_on_claim"])
def test_a_row_the_claim_cannot_update_fails_alone(
    engine: Engine, Sessions: Any, start_worker: Any, runs: Runs, fault: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The oldest job cannot be claimed: a BEFORE UPDATE trigger raises for it (for any
    update, or only for the claim's), or it violates a CHECK added ``NOT VALID`` after it
    was written. Every other job is done, before and after more arrive; the bad row is
    named in the log with the database's message and never claimed. Where it can still
    be updated (the trigger refuses only the claim), it is dead-lettered with that message."""
    caplog.set_level(logging.WARNING, logger="sqla_queue.worker")
    (bad,) = add(Sessions, "stamp")
    good = add(Sessions, "stamp", 6)
    _install(engine, fault, bad)
    worker = None
    try:
        worker = start_worker(runs.tasks(), concurrency=2)
        wait_for(all_status(engine, good, "done"), timeout=30, what="the other jobs done")
        later = add(Sessions, "stamp", 3)
        wait_for(all_status(engine, later, "done"), timeout=30, what="the jobs enqueued later done")
        if fault == "trigger_on_claim":
            wait_for(all_status(engine, [bad], "failed"), timeout=30, what="the unclaimable job dead-lettered")
        worker.stop(grace=1)
    finally:
        if worker is not None:
            worker.stop(grace=0)
        _remove(engine)
    row = job(engine, bad)
    assert runs.of(bad) == 0
    if fault == "trigger_on_claim":
        assert (row.status, row.attempts) == ("failed", 0)
        assert "frozen by policy" in row.last_error
    else:
        assert (row.status, row.attempts, row.last_error) == ("pending", 0, None)
    database_says = "frozen by policy" if fault.startswith("trigger") else FAULT_CHECK
    assert any(f"job {bad} cannot be claimed" in r.getMessage() and database_says in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert all(job(engine, i).attempts == 1 for i in good + later)


# -- 11. slow jobs at a cold start ----------------------------------------------------------------


RUN = 1.0
#: "Well under twice their run time": they must run side by side, not two after another.
SPREAD_BOUND = 1.6 * RUN


def _meeting(runtime: Runtimes, n: int, within: float = 20.0) -> Tasks:
    """``meet``: a job that waits until ``n`` of them run at once. One that waits
    ``within`` seconds in vain raises, so its attempt fails: the jobs ran side by side or
    not, whatever the machine's load makes of their timing."""
    tasks = Tasks()
    if runtime.name == "asyncio":
        gathering = asyncio.Barrier(n)

        @tasks.task(name="meet")
        async def meet_async(job: Any) -> None:
            async with asyncio.timeout(within):
                await gathering.wait()

    else:
        meeting = threading.Barrier(n, timeout=within)

        @tasks.task(name="meet")
        def meet(job: Any) -> None:
            meeting.wait()

    return tasks


def test_slow_jobs_at_a_cold_start_run_side_by_side(
    engine: Engine, Sessions: Any, start_worker: Any, runtime: Runtimes
) -> None:
    """Eight jobs that each wait for all eight to run, and eight idle executors that have
    not measured their handlers yet: each job starts at once on its own executor (a first
    claim of a batch of four would run four of them one after another, and the first of
    those would wait for the others in vain)."""
    worker = start_worker(_meeting(runtime, 8), concurrency=8)
    wait_for(worker.idle, what="the worker idle")
    ids = add(Sessions, "meet", 8)
    wait_for(all_status(engine, ids, "done"), timeout=60, what="the eight jobs done")
    with engine.connect() as conn:
        attempts = list(conn.scalars(select(TASKS.c.attempts).where(TASKS.c.id.in_(ids))))
    assert attempts == [1] * 8, "a job waited for the others in vain and ran again"
    wait_for_counts(worker, done=8)


def test_slow_jobs_after_many_fast_ones_run_side_by_side(
    engine: Engine, Sessions: Any, start_worker: Any, runtime: Runtimes
) -> None:
    """The same on a worker whose executors have just run 1,000 fast jobs, so each has
    measured its handlers as fast and claims large batches: the first executor woken
    must not take the eight slow jobs as one batch and run them one after another (the
    first would wait for the others in vain). Each meets the others within 5 s."""
    tasks = _meeting(runtime, 8, within=5.0)

    @tasks.task
    def fast(job: Any) -> None:
        pass

    worker = start_worker(tasks, concurrency=8)
    fast_ids = add(Sessions, "fast", 1000)
    wait_for(all_status(engine, fast_ids, "done"), timeout=60, what="the fast jobs done")
    wait_for(worker.idle, what="the worker idle")
    ids = add(Sessions, "meet", 8, max_attempts=1)
    wait_for(all_status(engine, ids, "done", "failed"), timeout=60, what="the eight jobs over")
    with engine.connect() as conn:
        rows = conn.execute(select(TASKS.c.status, TASKS.c.lease_owner).where(TASKS.c.id.in_(ids))).all()
    assert [r.status for r in rows] == ["done"] * 8, f"the slow jobs did not run side by side: {rows}"


def test_slow_jobs_at_a_cold_start_spread_over_worker_processes(
    engine: Engine, Sessions: Any, worker_processes: Callable[..., Any]
) -> None:
    """The same across two worker processes of four executors each."""
    app = _app("spread")
    for _ in range(2):
        worker_processes("--concurrency", "4", "--poll-interval", "5s", app_name=app)

    def listening() -> int:
        with engine.connect() as conn:
            return int(conn.scalar(text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND application_name = :app AND query LIKE 'LISTEN %'"), {"app": app}) or 0)

    wait_for(lambda: listening() == 2, timeout=30, what="both workers listening")
    began = time.monotonic()
    ids = add(Sessions, "work", 8, sleep=RUN)
    wait_for(all_status(engine, ids, "done"), timeout=30, what="the eight jobs done")
    took = time.monotonic() - began
    with engine.connect() as conn:
        owners = Counter(o.rsplit("/", 1)[0] for o in conn.scalars(select(TASKS.c.lease_owner)))
    print(f"\n8 jobs of {RUN}s, 2 processes x 4: done in {took:.2f}s, by worker {sorted(owners.values())}")
    assert took < SPREAD_BOUND, f"8 jobs of {RUN}s took {took:.2f}s on 2 x 4 idle executors"


# -- 10. a job whose lease expired twice in a row -------------------------------------------------


def isolate(engine: Engine, job_id: int) -> None:
    """Leave job ``job_id`` as a sweep leaves one whose lease expired twice in a row: its
    next attempt runs alone in its worker."""
    with engine.begin() as conn:
        conn.execute(text(
            "UPDATE tasks SET (isolated, attempts, last_error) = "
            "(true, 2, 'lease expired again: worker w/0.0 did not finish attempt 2 of 20') WHERE id = :id"
        ).bindparams(id=job_id))


def test_a_job_whose_lease_expired_twice_in_a_row_runs_alone_in_its_worker(
    engine: Engine, Sessions: Any, start_worker: Any, runtime: Runtimes
) -> None:
    """A job as the sweeper leaves it after its second expiry in a row, and ordinary jobs:
    while it runs, no other job of the worker runs or is even held (a poison job would
    take those down with it); the ordinary jobs handed back to make room run afterwards,
    side by side, their attempts not counted."""
    spans: dict[int, tuple[float, float]] = {}
    tasks = Tasks()

    def note(job: Any, began: float) -> None:
        spans[job.id] = (began, time.monotonic())

    if runtime.name == "asyncio":

        @tasks.task(name="probe")
        async def probe_async(job: Any) -> None:
            began = time.monotonic()
            await asyncio.sleep(0.3)
            note(job, began)

    else:

        @tasks.task(name="probe")
        def probe(job: Any) -> None:
            began = time.monotonic()
            sleep(0.3)
            note(job, began)

    (alone,) = add(Sessions, "probe")
    isolate(engine, alone)
    others = add(Sessions, "probe", 8)
    worker = start_worker(tasks, concurrency=4)
    wait_for(all_status(engine, [alone, *others], "done"), timeout=30, what="every job done")
    begin, end = spans[alone]
    overlapping = [i for i in others if spans[i][0] < end and spans[i][1] > begin]
    assert not overlapping, f"jobs {overlapping} ran while the solitary job did"
    side_by_side = [i for i in others if any(spans[i][0] < spans[j][1] and spans[j][0] < spans[i][1]
                                             for j in others if j != i)]
    assert side_by_side, "the ordinary jobs ran one after another"
    assert job(engine, alone).attempts == 3
    # Handed back unstarted: not counted (max_attempts grew with attempts), one run each.
    assert all(job(engine, i).max_attempts - job(engine, i).attempts == DEFAULT_MAX_ATTEMPTS - 1 for i in others)
    wait_for_counts(worker, done=9)


#: The idle wait of the tests below: each round without a wake-up lasts at least this.
BLOCKED_POLL = 0.5
#: Seconds the idle rounds are counted over.
WINDOW = 1.0


def _producer(on: On, lag: list[float]) -> Producer:
    """The worker's producer on ``on``'s driver, with a cursor whose clock runs ``lag[0]``
    seconds behind ``time.monotonic()`` and whose interval is a minute: with a lag of a
    minute, its claims after a claim from the head are cursor claims however slow the
    machine, and once the lag is 0 the claim from the head they owe is due at once
    (instead of after the interval)."""
    config = check_options(concurrency=2, poll_interval=BLOCKED_POLL)
    stats = WorkerStats()
    producer = Producer(WorkerContext(
        config, Ledger(), on.driver, on.ops(), WorkSignal(config.concurrency), stats, "w", Hooks(stats)
    ))
    assert producer.cursor is not None
    producer.cursor = ClaimCursor(60.0, lambda: time.monotonic() - lag[0])
    return producer


def _owe_a_claim_from_the_head(producer: Producer, conn: DbConnection, quick: list[int]) -> None:
    """Claim ``quick`` (from the head), then nothing by the cursor: a claim from the head is owed."""
    assert [h.token.job_id for h in producer.claim(conn, 1, "w/0.0")] == quick
    assert producer.claim(conn, 1, "w/0.0") == []


def _idle_rounds(producer: Producer, conn: DbConnection, owner: str, n: int = 3) -> list[float]:
    """``n`` rounds of an idle executor: its claim (which finds nothing), then its wait."""
    rounds = []
    for _ in range(n):
        began = time.monotonic()
        assert producer.claim(conn, 1, owner) == []
        producer.wait_for_work(conn)
        rounds.append(time.monotonic() - began)
    return rounds


@pytest.mark.parametrize("kind", ["thread", "asyncio"])
def test_while_a_solitary_job_is_held_an_idle_executor_waits_for_a_wake_up_even_with_a_claim_owed(
    engine: Engine, Sessions: Any, kind: str
) -> None:
    """While the worker holds a solitary job, no claim may begin: an idle executor's
    round (its claim, then its wait for work) must wait for a wake-up or the poll,
    though a claim from the head is owed (a cursor claim found nothing since the last
    one, and its time has come) and only a claim can pay it. Otherwise every round
    would wake at once for it, claim nothing and go round again: on the event loop
    without ever yielding, stalling the loop, the other jobs' ends the solitary job
    waits for, and its own run (seconds, in a crash scenario, for a 0.3 s job).

    The real producer and statements on each driver (see :func:`_producer` for its
    cursor's clock). Then, once the solitary job is gone and the executors woken (as
    its executor does), the next claim runs again and pays what is owed."""
    quick = add(Sessions, "stamp")
    lag = [60.0]
    rounds: list[float] = []
    with on_driver(kind, engine) as on:
        producer = _producer(on, lag)
        ledger, signal, cursor = producer.ledger, producer.signal, producer.cursor
        assert cursor is not None

        def scenario(conn: DbConnection) -> None:
            _owe_a_claim_from_the_head(producer, conn, quick)  # the first looks for isolated jobs too
            lag[0] = 0.0
            owed = cursor.head_claim_at()
            assert owed is not None and owed <= time.monotonic(), "no claim from the head owed"
            # A job as a sweep leaves it after its lease expired twice in a row, announced.
            (alone,) = add(Sessions, "stamp")
            isolate(engine, alone)
            producer.look_for_isolated()
            (solitary,) = producer.claim(conn, 1, "w/1.0")
            assert solitary.token.job_id == alone and solitary.solitary and not ledger.claims_open
            rounds.extend(_idle_rounds(producer, conn, "w/2.0"))
            ledger.remove([solitary])
            signal.wake(2)  # what the solitary job's executor does
            producer.wait_for_work(conn)  # woken: returns at once
            assert producer.claim(conn, 1, "w/2.0") == []  # from the head: the owed claim is paid
            assert cursor.head_claim_at() is None

        on(scenario)
    # Each round waited for the poll: nothing woke it (a round that claims nothing and
    # returns at once would go round thousands of times while the solitary job runs).
    assert min(rounds) >= BLOCKED_POLL * 0.9, f"idle rounds under a solitary job took {rounds} s"


@pytest.mark.parametrize("kind", ["thread", "asyncio"])
def test_while_a_row_is_passed_over_an_idle_executor_waits_for_a_wake_up_even_with_a_claim_owed(
    engine: Engine, Sessions: Any, kind: str
) -> None:
    """While a row no claim can update is passed over, every claim starts at the head
    and tells the cursor nothing, so a claim from the head owed before stays owed: an
    idle executor must not wake at once for it after each claim that found nothing (a
    claim on the database thousands of times a second, for as long as the row is
    passed over), but wait for a wake-up, a due time or the poll."""
    quick = add(Sessions, "stamp")
    lag = [60.0]
    rounds: list[float] = []
    with on_driver(kind, engine) as on:
        producer = _producer(on, lag)

        def scenario(conn: DbConnection) -> None:
            _owe_a_claim_from_the_head(producer, conn, quick)
            (bad,) = add(Sessions, "stamp")
            _install(engine, "trigger", bad)
            try:
                assert producer.claim(conn, 1, "w/0.0") == []  # a cursor claim fails on it: passed over
                assert producer._skipped() == [bad]
                lag[0] = 0.0
                assert producer.cursor is not None
                owed = producer.cursor.head_claim_at()
                assert owed is not None and owed <= time.monotonic(), "no claim from the head owed"
                began = time.monotonic()
                while time.monotonic() - began < WINDOW:
                    rounds.extend(_idle_rounds(producer, conn, "w/1.0", 1))
            finally:
                _remove(engine)

        on(scenario)
    # The row is due, so each lookup of the next due time finds it due already and the
    # executor looks again shortly (NEXT_DUE_PAUSE): a few rounds per lookup, no more.
    assert len(rounds) <= 3 * WINDOW / NEXT_DUE_PAUSE, (
        f"{len(rounds)} idle rounds in {WINDOW} s while a row is passed over")
