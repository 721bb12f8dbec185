"""The worker in this process (threads), against real PostgreSQL."""

from __future__ import annotations

import signal
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, insert, select, text, update
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session

from sqla_queue import AsyncWorker, Tasks, Worker
from sqla_queue import sql as q
from sqla_queue.model import DEFAULT_MAX_ATTEMPTS
from sqla_queue.runtime import Event

from .helpers import wait_for, wait_for_counts
from .models import Effect, EmailJob, Task
from .worker_app import tasks as app_tasks
from .workers import FAST, TASKS, add, all_status, claimed_by, effects, engine_with, job, status_is

# -- outcomes ------------------------------------------------------------------------------


@pytest.mark.compat  # the worker smoke test of the compatibility run
def test_transactional_handler_commits_its_writes_with_completion(
    engine: Engine, Sessions: Any, start_worker: Any
) -> None:
    ids = add(Sessions, "record", 5)
    start_worker()
    for job_id in ids:
        wait_for(status_is(engine, job_id, "done"), what=f"job {job_id} done")
    assert sorted(e.job_id for e in effects(engine)) == ids


@pytest.mark.compat  # the worker smoke test of the compatibility run
def test_failed_transactional_handler_leaves_no_writes(
    engine: Engine, Sessions: Any, start_worker: Any
) -> None:
    tasks = Tasks()

    @tasks.task
    def half_done(job: Any, session: Session) -> None:
        session.add(Effect(job_id=job.id, worker="w", note="must not survive"))
        session.flush()
        if job.attempts == 1:
            raise ValueError("second thoughts")

    (job_id,) = add(Sessions, "half_done")
    start_worker(tasks)
    wait_for(status_is(engine, job_id, "done"))
    assert [(e.job_id, e.note) for e in effects(engine)] == [(job_id, "must not survive")]
    assert job(engine, job_id).attempts == 2  # the first attempt's row was rolled back


@pytest.mark.compat  # the worker smoke test of the compatibility run
def test_retry_with_backoff_then_success(engine: Engine, Sessions: Any, start_worker: Any) -> None:
    (job_id,) = add(Sessions, "flaky", succeed_on=3)
    worker = start_worker()
    wait_for(status_is(engine, job_id, "done"))
    row = job(engine, job_id)
    assert row.attempts == 3 and "flaky failure on attempt 2" in row.last_error
    wait_for_counts(worker, retried=2, done=1)


def test_exhausted_retries_end_in_failed_with_the_traceback(
    engine: Engine, Sessions: Any, start_worker: Any
) -> None:
    (job_id,) = add(Sessions, "flaky", succeed_on=99, max_attempts=3)
    start_worker()
    wait_for(status_is(engine, job_id, "failed"))
    row = job(engine, job_id)
    assert row.attempts == 3 and row.finished_at is not None
    assert row.last_error.startswith("builtins.RuntimeError: flaky failure on attempt 3")
    assert "Traceback (most recent call last)" in row.last_error and "in flaky" in row.last_error


def test_last_error_is_bounded(engine: Engine, Sessions: Any, start_worker: Any) -> None:
    tasks = Tasks()

    @tasks.task
    def deep(job: Any) -> None:
        def recurse(n: int) -> None:
            if n == 0:
                raise RuntimeError("x" * 300)
            recurse(n - 1)

        recurse(200)

    (job_id,) = add(Sessions, "deep", max_attempts=1)
    start_worker(tasks, max_error_length=1000)
    wait_for(status_is(engine, job_id, "failed"))
    error = job(engine, job_id).last_error
    assert len(error) <= 1000 and error.startswith("builtins.RuntimeError: xxx")
    assert "truncated" in error and error.rstrip().endswith("x" * 20)


def test_unknown_task_is_dead_lettered_without_running_anything(
    engine: Engine, Sessions: Any, start_worker: Any
) -> None:
    (job_id,) = add(Sessions, "os.system", max_attempts=5)
    start_worker()
    wait_for(status_is(engine, job_id, "failed"))
    row = job(engine, job_id)
    assert row.attempts == 1 and row.last_error.startswith("unknown task 'os.system'")


def test_dead_letter_exception_fails_at_once(engine: Engine, Sessions: Any, start_worker: Any) -> None:
    (job_id,) = add(Sessions, "poison", max_attempts=10)
    start_worker()
    wait_for(status_is(engine, job_id, "failed"))
    row = job(engine, job_id)
    assert (row.attempts, row.last_error) == (1, "DeadLetter: this input can never work")


def test_retry_later_uses_the_requested_delay(engine: Engine, Sessions: Any, start_worker: Any) -> None:
    (job_id,) = add(Sessions, "later", delay=30)
    start_worker()
    wait_for(lambda: job(engine, job_id).attempts == 1 and job(engine, job_id).status == "pending")
    with engine.connect() as conn:
        wait = conn.scalars(select(TASKS.c.run_after - func.now()).where(TASKS.c.id == job_id)).one()
    assert timedelta(seconds=25) < wait <= timedelta(seconds=30)  # not the 0.05 s backoff
    assert job(engine, job_id).last_error == "RetryLater: not yet"


def test_typed_queue_table_with_a_plain_handler(engine: Engine, Sessions: Any, start_worker: Any) -> None:
    seen: list[tuple[int, str]] = []

    def send(job: EmailJob) -> None:
        seen.append((job.id, job.recipient))

    with Sessions() as session:
        jobs = [session.enqueue(EmailJob(recipient=f"u{i}@example.com"), queue="mail") for i in range(3)]
        session.enqueue(EmailJob(recipient="other@example.com"), queue="other")
        session.commit()
        wanted = sorted((j.id, j.recipient) for j in jobs)
    start_worker(send, EmailJob, queues=("mail",))
    wait_for(lambda: len(seen) == 3)
    assert sorted(seen) == wanted  # the "other" queue is not this worker's


def test_handler_signature_is_checked_at_registration() -> None:
    tasks = Tasks()
    with pytest.raises(TypeError, match=r"\(job\) or \(job, session\)"):
        tasks.register("bad", lambda: None)
    tasks.register("ok", lambda job: None)
    with pytest.raises(ValueError, match="already registered"):
        tasks.register("ok", lambda job: None)


def test_worker_refuses_a_registry_for_a_typed_table(engine: Engine, make_worker: Any) -> None:
    with pytest.raises(TypeError, match="TaskMixin"):
        make_worker(engine, EmailJob, Tasks())
    with pytest.raises(ValueError, match="heartbeat_interval"):
        make_worker(engine, Task, Tasks(), lease=1, heartbeat_interval=2)


@pytest.mark.parametrize("queues", [("sqla_queue.swept:a",), ("a", "sqla_queue.x")], ids=["one", "several"])
def test_worker_refuses_a_queue_name_sqla_queue_reserves(engine: Engine, make_worker: Any, queues: Any) -> None:
    """The workers' own NOTIFY messages start with ``sqla_queue.``: no queue may."""
    with pytest.raises(ValueError, match="which sqla_queue reserves"):
        make_worker(engine, EmailJob, lambda job: None, queues=queues)


# -- the public lifecycle ------------------------------------------------------------------


def _driven(worker: Any) -> Worker:
    """The thread Worker behind a test's worker: itself, or the one an AsyncWorker drives."""
    while not isinstance(worker, Worker):
        worker = worker.worker
    return worker


def test_the_first_signal_waits_for_running_jobs_the_second_hands_them_back(
    engine: Engine, Sessions: Any, start_worker: Any
) -> None:
    """``on_signal`` (what SIGTERM does) and ``abort``, called by code that installs its own
    signal handlers: after the second, ``stop`` returns with the running job handed back,
    its handler still blocked, instead of waiting the 60 s grace for it."""
    entered, release, returned = threading.Event(), threading.Event(), threading.Event()
    tasks = Tasks()

    @tasks.task
    def hold(job: Task) -> None:
        entered.set()
        release.wait(30)
        returned.set()

    worker = start_worker(tasks, shutdown_grace=60)
    inner = _driven(worker)
    try:
        (job_id,) = add(Sessions, "hold")
        wait_for(entered.is_set, what="the handler to start")
        inner.on_signal(signal.SIGTERM)
        inner.wait()  # returns: a stop was asked for
        inner.on_signal(signal.SIGTERM)  # the second signal: abort
        worker.stop()
        assert not returned.is_set()
        assert job(engine, job_id).status == "pending"
    finally:
        release.set()


def test_the_async_worker_reads_through_to_the_worker_it_drives(server: Any) -> None:
    async_engine = create_async_engine(server.url)
    worker = AsyncWorker(async_engine, Task, Tasks(), concurrency=3)
    inner = worker.worker
    assert isinstance(inner, Worker) and inner.config.concurrency == 3
    for name in ("engine", "model", "handler", "config", "session_factory", "owner", "stats", "ledger", "signal",
                 "executors", "heartbeat", "sweeper", "listener"):
        assert getattr(worker, name) is getattr(inner, name), name
    assert worker.stopped is inner.stopped is False
    assert worker.engine is async_engine  # the engine it was given, not a sync one


# -- job_context ---------------------------------------------------------------------------


class Contexts:
    """A ``job_context`` factory that records what each context saw: the job it wrapped
    and the exception its exit was given; ``swallow``: its exit suppresses exceptions."""

    def __init__(self, *, swallow: bool = False) -> None:
        self.swallow = swallow
        self.inside = 0
        self.exits: list[type[BaseException] | None] = []
        self.runs: list[tuple[int, int, int]] = []  # (job id, attempt, contexts open)

    def __call__(self) -> Any:
        contexts = self

        class Context:
            def __enter__(self) -> None:
                contexts.inside += 1

            def __exit__(self, kind: type[BaseException] | None, *rest: Any) -> bool:
                contexts.inside -= 1
                contexts.exits.append(kind)
                return contexts.swallow

        return Context()

    def tasks(self) -> Tasks:
        tasks = Tasks()

        @tasks.task
        def in_context(job: Any) -> None:
            self.runs.append((job.id, job.attempts, self.inside))
            if job.attempts == 1 and job.payload.get("fail_first"):
                raise ValueError("first attempt fails")

        return tasks


def test_job_context_wraps_every_run_and_sees_what_the_handler_raised(
    engine: Engine, Sessions: Any, start_worker: Any
) -> None:
    contexts = Contexts()
    (ok,) = add(Sessions, "in_context")
    (flaky,) = add(Sessions, "in_context", fail_first=True)
    start_worker(contexts.tasks(), job_context=contexts, concurrency=1)
    wait_for(lambda: all(job(engine, i).status == "done" for i in (ok, flaky)), what="both jobs done")
    assert sorted(contexts.runs) == sorted([(ok, 1, 1), (flaky, 1, 1), (flaky, 2, 1)])
    assert sorted(contexts.exits, key=str) == sorted([None, ValueError, None], key=str)
    assert contexts.inside == 0


def test_a_job_context_that_swallows_the_error_does_not_run_the_handler_twice(
    engine: Engine, Sessions: Any, start_worker: Any
) -> None:
    """A ``with`` block whose context suppresses the exception goes on after the block;
    the handler must not run again for it, and the attempt has still failed."""
    contexts = Contexts(swallow=True)
    (job_id,) = add(Sessions, "in_context", fail_first=True)
    start_worker(contexts.tasks(), job_context=contexts, concurrency=1)
    wait_for(status_is(engine, job_id, "done"), what="the retry done")
    assert contexts.runs == [(job_id, 1, 1), (job_id, 2, 1)]
    row = job(engine, job_id)
    assert row.attempts == 2 and "first attempt fails" in row.last_error


# -- leases --------------------------------------------------------------------------------


def test_heartbeats_keep_a_long_job_leased(engine: Engine, Sessions: Any, start_worker: Any) -> None:
    (job_id,) = add(Sessions, "record", sleep=2.5)
    first = start_worker(lease=1.0, heartbeat_interval=0.2)
    wait_for(status_is(engine, job_id, "running"))
    other = start_worker(lease=1.0, heartbeat_interval=0.2, sweep_interval=0.1)
    wait_for(status_is(engine, job_id, "done"))
    row = job(engine, job_id)
    assert row.attempts == 1 and claimed_by(row.lease_owner, first)
    assert len(effects(engine)) == 1 and other.stats.claimed == 0


@pytest.mark.compat  # the worker smoke test of the compatibility run
def test_stale_completion_is_refused_and_its_writes_rolled_back(
    engine: Engine, Sessions: Any, start_worker: Any
) -> None:
    """A handler holds its job past the lease; meanwhile another worker re-claims and
    finishes it. The first handler's completion, and its writes, must not land."""
    release = Event()
    entered = Event()
    outcome: list[BaseException] = []
    tasks = Tasks()

    @tasks.task
    def slow(job: Any, session: Session) -> None:
        session.add(Effect(job_id=job.id, worker=threading.current_thread().name, note=f"attempt {job.attempts}"))
        if job.attempts == 1:
            entered.set()
            release.wait(30)
            try:
                session.flush()
            except BaseException as exc:  # pragma: no cover - reported below
                outcome.append(exc)
                raise

    (job_id,) = add(Sessions, "slow")
    stale = start_worker(tasks, lease=30, sweep_interval=0, concurrency=1)  # only the fresh one re-claims
    assert entered.wait(10)
    # The lease runs out (as if the heartbeat could not reach the database)...
    with engine.begin() as conn:
        conn.execute(update(TASKS).values(lease_expires_at=func.now() - timedelta(seconds=1)))
    # ...and another worker sweeps it, re-claims it and finishes it.
    fresh = start_worker(tasks)
    wait_for(status_is(engine, job_id, "done"))
    assert claimed_by(job(engine, job_id).lease_owner, fresh)
    release.set()
    wait_for(lambda: stale.stats.lost == 1, what="the stale worker to notice its lost lease")
    assert not outcome
    rows = effects(engine)
    assert [(r.job_id, r.note) for r in rows] == [(job_id, "attempt 2")]
    final = job(engine, job_id)
    assert (final.status, final.attempts) == ("done", 2) and claimed_by(final.lease_owner, fresh)


def test_a_handler_that_commits_after_losing_its_lease_commits_nothing(
    engine: Engine, Sessions: Any, start_worker: Any
) -> None:
    """The handler's own commit() only releases a savepoint: the worker commits, and
    finding the job taken, rolls everything back."""
    committed = Event()
    tasks = Tasks()

    @tasks.task
    def commits(job: Any, session: Session) -> None:
        session.add(Effect(job_id=job.id, worker="w"))
        with engine.begin() as conn:  # someone else takes the job meanwhile
            conn.execute(update(TASKS).values(lease_owner="thief"))
        session.commit()
        committed.set()

    add(Sessions, "commits")
    worker = start_worker(tasks)
    assert committed.wait(10)
    wait_for(lambda: worker.stats.lost == 1, what="the lost lease to be noticed")
    assert effects(engine) == [] and worker.stats.done == 0


# -- wake-ups ------------------------------------------------------------------------------


@pytest.mark.compat  # the worker smoke test of the compatibility run
def test_notify_wakes_an_idle_worker(engine: Engine, Sessions: Any, start_worker: Any) -> None:
    worker = start_worker(poll_interval=120)
    wait_for(worker.idle, what="the worker to go idle")
    started = time.monotonic()
    (job_id,) = add(Sessions, "record")
    wait_for(status_is(engine, job_id, "done"), timeout=10)
    # Far below the 120 s poll: only the NOTIFY can explain it (the benchmark measures it).
    assert time.monotonic() - started < 10


def test_poll_only_mode_still_finds_jobs(engine: Engine, Sessions: Any, start_worker: Any) -> None:
    worker = start_worker(listen=False, poll_interval=0.3)
    assert worker.listener is None
    wait_for(worker.idle)
    (job_id,) = add(Sessions, "record")
    wait_for(status_is(engine, job_id, "done"), timeout=10)


def test_polling_still_finds_jobs_when_listen_is_broken(
    engine: Engine, Sessions: Any, start_worker: Any, make_worker: Any
) -> None:
    worker = make_worker(engine, Task, app_tasks, poll_interval=0.4, backoff=FAST)
    assert worker.listener is not None
    worker.listener.channel = "a_channel_nobody_notifies"  # LISTEN works, hears nothing
    worker.start()
    try:
        wait_for(worker.idle)
        (job_id,) = add(Sessions, "record")
        wait_for(status_is(engine, job_id, "done"), timeout=10)
    finally:
        worker.stop(grace=1)


def test_every_worker_connection_uses_the_engine_options(
    engine: Engine, Sessions: Any, server: Any, tmp_path: Any, make_worker: Any
) -> None:

    app_engine = engine_with(server.url, application_name="sqla_queue_tagged")
    started = tmp_path / "started"
    add(Sessions, "record", sleep=30, started=str(started))
    worker = make_worker(app_engine, Task, app_tasks, lease=3, heartbeat_interval=0.2, poll_interval=0.5)
    worker.start()
    try:
        wait_for(started.exists)
        wait_for(lambda: worker.stats.heartbeats >= 2, what="heartbeats")

        def tagged() -> dict[int, str]:
            with engine.connect() as conn:
                rows = conn.execute(
                    text(
                        "SELECT pid, coalesce(query, '') FROM pg_stat_activity "
                        "WHERE datname = current_database() AND application_name = 'sqla_queue_tagged'"
                    )
                )
                return dict(rows.all())

        def with_query(prefix: str) -> list[int]:
            return [pid for pid, q in tagged().items() if q.startswith(prefix)]

        wait_for(lambda: with_query("LISTEN"), what="the listener's connection, tagged")
        wait_for(lambda: with_query("WITH sqla_queue_known AS"), what="the heartbeat's, tagged")
        # listener, heartbeat, sweeper and one connection per executor: all made by app_engine
        assert len(tagged()) >= 3 + worker.config.concurrency
    finally:
        worker.stop(grace=0.1)
        app_engine.dispose()


def test_listener_reconnects_and_polls_once(engine: Engine, Sessions: Any, server: Any, make_worker: Any) -> None:

    # Kill only this worker's listener: our database, our application_name.
    worker_engine = engine_with(server.url, application_name="sqla_queue_listen_victim")
    worker = make_worker(worker_engine, Task, app_tasks, poll_interval=120, backoff=FAST, sweep_interval=0.2)
    worker.start()
    try:
        listener = worker.listener
        assert listener is not None
        wait_for(lambda: listener.connections == 1)
        wait_for(worker.idle)

        def cut() -> bool:
            """Terminate the listener's connection once it waits in LISTEN (it also takes
            the worker's session lock right after connecting)."""
            with engine.begin() as conn:
                killed = conn.scalar(
                    text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND application_name = 'sqla_queue_listen_victim' "
                        "AND query LIKE 'LISTEN %'"
                    )
                )
            return bool(killed == 1)

        wait_for(cut, what="the listener's connection cut while it listens")
        assert listener.connections == 1
        (job_id,) = add(Sessions, "record")  # its NOTIFY may fall into the gap
        wait_for(lambda: listener.connections == 2, what="the listener to reconnect")
        wait_for(status_is(engine, job_id, "done"), timeout=10)
    finally:
        worker.stop(grace=1)
        worker_engine.dispose()


# -- shutdown ------------------------------------------------------------------------------


def test_stop_hands_back_running_and_waiting_jobs(engine: Engine, Sessions: Any, start_worker: Any) -> None:
    # Quick jobs first: a thread claims one job at a time until it has measured its
    # handlers, then batches (here of 3) once they proved fast.
    warm_up = add(Sessions, "work", 20)
    worker = start_worker(concurrency=1, batch_size=3)
    wait_for(all_status(engine, warm_up, "done"), what="the warm-up jobs")
    ids = add(Sessions, "work", 3, sleep=30)
    wait_for(lambda: worker.stats.claimed == len(warm_up) + 3)
    wait_for(lambda: sum(job(engine, i).status == "running" for i in ids) == 3)
    worker.stop(grace=0.2)
    rows = sorted((job(engine, i) for i in ids), key=lambda r: -r.max_attempts)
    assert all(r.status == "pending" and r.lease_owner is None for r in rows)
    # the one that had started has used its attempt; the two that never started have not
    # (max_attempts grew by one: the attempt number itself is never handed out again)
    assert [(r.attempts, r.max_attempts) for r in rows] == [
        (1, DEFAULT_MAX_ATTEMPTS + 1), (1, DEFAULT_MAX_ATTEMPTS + 1), (1, DEFAULT_MAX_ATTEMPTS)]
    assert worker.stats.released == 3
    with engine.begin() as conn:  # claimable again at once, no lease to wait out
        assert len(conn.execute(q.claim(Task, owner="next", limit=3)).all()) == 3


def test_stop_lets_running_jobs_finish_within_the_grace(
    engine: Engine, Sessions: Any, start_worker: Any
) -> None:
    (job_id,) = add(Sessions, "record", sleep=0.5)
    worker = start_worker()
    # Started, not only claimed: stop() hands a claimed job whose handler has not started
    # back at once, attempt not counted (another test checks that).
    wait_for(lambda: any(h.started for h in worker.ledger.held()), what="the handler to start")
    worker.stop(grace=10)
    assert job(engine, job_id).status == "done" and len(effects(engine)) == 1
    assert worker.stats.released == 0


def test_run_until_idle_processes_everything_runnable(engine: Engine, Sessions: Any, make_worker: Any) -> None:
    ids = add(Sessions, "record", 25)
    worker = make_worker(engine, Task, app_tasks, concurrency=3, poll_interval=0.2)
    worker.run(install_signal_handlers=False, until_idle=True)
    assert worker.stopped
    assert all(job(engine, i).status == "done" for i in ids)


def test_until_idle_runs_a_job_due_within_the_poll_the_worker_was_not_told_of(engine: Engine, make_worker: Any) -> None:
    """``until_idle`` asks the table before it returns: the worker's own view of due times
    (NOTIFYs, its estimate of a retry's ``run_after``) can miss a job due within the poll."""
    worker = make_worker(engine, Task, app_tasks, concurrency=2, poll_interval=5)
    worker.start()
    try:
        wait_for(worker.idle, what="the worker idle")
        with engine.begin() as conn:  # a Core insert: no NOTIFY, no due time the worker knows of
            job_id = conn.execute(
                insert(Task)
                .values(task="record", payload={}, run_after=func.now() + timedelta(seconds=0.3))
                .returning(Task.id)
            ).scalar_one()
        worker.wait(until_idle=True)
        assert job(engine, job_id).status == "done"
    finally:
        worker.stop()


# -- database trouble ----------------------------------------------------------------------


def test_worker_survives_terminated_connections(engine: Engine, Sessions: Any, server: Any, make_worker: Any) -> None:

    worker_engine = engine_with(server.url, application_name="sqla_queue_victim")
    ids = add(Sessions, "record", 120, sleep=0.01)
    worker = make_worker(worker_engine, Task, app_tasks, concurrency=4, backoff=FAST, lease=5, poll_interval=0.2)
    worker.start()
    try:
        for goal in (20, 50, 80):

            def reached(goal: int = goal) -> bool:
                return len(effects(engine)) >= goal

            wait_for(reached)
            with engine.begin() as conn:
                conn.execute(
                    text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND application_name = 'sqla_queue_victim'"
                    )
                )
        wait_for(lambda: all(job(engine, i).status == "done" for i in ids), timeout=60)
    finally:
        worker.stop(grace=1)
        worker_engine.dispose()
    done = [e.job_id for e in effects(engine)]
    assert sorted(done) == ids  # every job's writes exactly once
