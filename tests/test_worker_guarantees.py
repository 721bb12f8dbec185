"""The worker's guarantees (issue 9, behaviours 1-5), tried as a hostile user would.

Every test runs the in-process :class:`~sqla_queue.Worker` against real PostgreSQL:

1. transactional completion is exactly once for every shape of handler transaction;
2. nothing a handler does kills or wedges its worker, and every stored error is storable;
3. a row that cannot become the handler's object fails alone;
4. heartbeats survive a handler locking its own row, many held jobs, jobs finishing
   during a beat, a hung connection, and a database that does not answer for a lease;
5. held jobs stay bounded while completions are stalled, and the worker drains after.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from sqla_queue import Backoff, ClaimToken, DeadLetter, RetryLater, Tasks, Worker
from sqla_queue.runtime import Event, sleep
from sqla_queue.worker.ledger import Held

from .helpers import Server, wait_for, wait_for_counts
from .models import Effect, FragileJob, Task, UniqueKey
from .proxy import Link, proxied
from .workers import FAST, TASKS, add, claimed_by, effects, engine_with, job, status_is

#: The application_name of the connections this file's own engines make.
APP_NAME = "sqla_queue_guarantees"


# -- helpers -------------------------------------------------------------------------------


def scalar(engine: Engine, sql: str, **params: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(text(sql), params).scalar()


def execute(engine: Engine, sql: str, **params: Any) -> list[Any]:
    with engine.begin() as conn:
        result = conn.execute(text(sql), params)
        return list(result.all()) if result.returns_rows else []


def notes(engine: Engine) -> list[str]:
    return sorted(e.note for e in effects(engine))


def statuses(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT status, count(*) FROM tasks GROUP BY status")).all()
    return {str(status): int(count) for status, count in rows}


def status_of(engine: Engine, job_id: int) -> str:
    """The job's status, reading no other column (some rows here cannot be loaded)."""
    return str(scalar(engine, "SELECT status FROM tasks WHERE id = :id", id=job_id))


def steal(engine: Engine, job_id: int) -> None:
    """Another worker takes the job: the lease owner changes under the handler."""
    with engine.begin() as conn:
        conn.execute(update(Task).where(Task.id == job_id).values(lease_owner="thief"))


def give_back(engine: Engine, job_id: int) -> None:
    """The thief hands the job back: claimable again at once."""
    execute(
        engine,
        "UPDATE tasks SET status = 'pending', lease_owner = NULL, lease_expires_at = NULL, "
        "run_after = now() WHERE id = :id",
        id=job_id,
    )


@contextmanager
def held_lock(engine: Engine, mode: str) -> Iterator[Connection]:
    """A connection holding ``LOCK TABLE tasks IN <mode> MODE`` until the block ends."""
    conn = engine.connect()
    trans = conn.begin()
    try:
        conn.execute(text(f"LOCK TABLE tasks IN {mode} MODE"))
        yield conn
    finally:
        trans.rollback()
        conn.close()


@pytest.fixture
def tagged_engine(server: Server) -> Iterator[Engine]:
    """An engine whose connections carry :data:`APP_NAME`, to find them in pg_stat_activity."""
    tagged = engine_with(server.url, application_name=APP_NAME)
    yield tagged
    tagged.dispose()


# == 1. Transactional completion is exactly once for every shape of handler transaction ===
#
# A shape makes the handler's writes (Effect rows noted "<what> a<attempt>") and returns
# the notes that must be committed: exactly the handler's final writes.


def _effect(job: Any, note: str) -> Effect:
    return Effect(job_id=job.id, worker="w", note=note)


def savepoint_committed(job: Any, session: Session, tag: str) -> list[str]:
    session.add(_effect(job, f"outer {tag}"))
    with session.begin_nested():
        session.add(_effect(job, f"savepoint {tag}"))
    return [f"outer {tag}", f"savepoint {tag}"]


def savepoint_rolled_back(job: Any, session: Session, tag: str) -> list[str]:
    session.add(_effect(job, f"outer {tag}"))
    savepoint = session.begin_nested()
    session.add(_effect(job, f"savepoint {tag}"))
    session.flush()
    savepoint.rollback()
    return [f"outer {tag}"]


def savepoint_integrity_error_caught(job: Any, session: Session, tag: str) -> list[str]:
    """Get-or-create: the unique row ``taken`` already exists (the test made it)."""
    session.add(_effect(job, f"outer {tag}"))
    try:
        with session.begin_nested():
            session.add(UniqueKey(key="taken", job_id=job.id))
    except IntegrityError:
        session.add(_effect(job, f"existed {tag}"))
    return [f"outer {tag}", f"existed {tag}"]


def commits_once(job: Any, session: Session, tag: str) -> list[str]:
    session.add(_effect(job, f"committed {tag}"))
    session.commit()
    return [f"committed {tag}"]


def commits_several_times(job: Any, session: Session, tag: str) -> list[str]:
    session.add(_effect(job, f"first {tag}"))
    session.commit()
    session.add(_effect(job, f"second {tag}"))
    session.commit()
    session.add(_effect(job, f"after the last commit {tag}"))  # committed by the worker
    return [f"first {tag}", f"second {tag}", f"after the last commit {tag}"]


def rolls_back_then_writes(job: Any, session: Session, tag: str) -> list[str]:
    session.add(_effect(job, f"rolled back {tag}"))
    session.flush()
    session.rollback()
    session.add(_effect(job, f"kept {tag}"))
    return [f"kept {tag}"]


def rolls_back_last(job: Any, session: Session, tag: str) -> list[str]:
    session.add(_effect(job, f"rolled back {tag}"))
    session.flush()
    session.rollback()
    return []


def catches_its_own_commit_error(job: Any, session: Session, tag: str) -> list[str]:
    """Its commit() raises (a duplicate of the existing ``taken`` row); it recovers."""
    session.add(_effect(job, f"lost with the failed commit {tag}"))
    session.add(UniqueKey(key="taken", job_id=job.id))
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
    else:  # pragma: no cover - the test's precondition
        raise AssertionError("the commit should have failed")
    session.add(_effect(job, f"after the failed commit {tag}"))
    return [f"after the failed commit {tag}"]


def does_nothing(job: Any, session: Session, tag: str) -> list[str]:
    return []


SHAPES: list[Callable[[Any, Session, str], list[str]]] = [
    savepoint_committed,
    savepoint_rolled_back,
    savepoint_integrity_error_caught,
    commits_once,
    commits_several_times,
    rolls_back_then_writes,
    rolls_back_last,
    catches_its_own_commit_error,
    does_nothing,
]


def _shape_tasks(
    engine: Engine, shape: Callable[[Any, Session, str], list[str]], expected: dict[int, list[str]]
) -> Tasks:
    tasks = Tasks()

    @tasks.task
    def shaped(job: Any, session: Session) -> None:
        job_id, attempt, steal_it = job.id, job.attempts, bool(job.payload.get("steal"))
        expected[attempt] = shape(job, session, f"a{attempt}")
        if steal_it and attempt == 1:
            steal(engine, job_id)  # after its writes: none of them may commit

    return tasks


@pytest.mark.parametrize("shape", SHAPES, ids=[s.__name__ for s in SHAPES])
def test_every_transaction_shape_completes_exactly_once(
    engine: Engine, Sessions: Any, start_worker: Any, shape: Callable[[Any, Session, str], list[str]]
) -> None:
    with Sessions() as session:
        session.add(UniqueKey(key="taken"))
        session.commit()
    expected: dict[int, list[str]] = {}
    (job_id,) = add(Sessions, "shaped")
    worker = start_worker(_shape_tasks(engine, shape, expected))
    wait_for(status_is(engine, job_id, "done", "failed"), what="the job to finish")
    wait_for(worker.idle, what="the worker to go idle")
    row = job(engine, job_id)
    assert (row.status, row.attempts, row.last_error) == ("done", 1, None)
    assert notes(engine) == sorted(expected[1])
    assert (worker.stats.done, worker.stats.lost, worker.stats.retried, worker.stats.failed) == (1, 0, 0, 0)
    assert scalar(engine, "SELECT count(*) FROM unique_keys") == 1


@pytest.mark.parametrize("shape", SHAPES, ids=[s.__name__ for s in SHAPES])
def test_every_transaction_shape_commits_nothing_when_the_lease_is_lost(
    engine: Engine, Sessions: Any, start_worker: Any, shape: Callable[[Any, Session, str], list[str]]
) -> None:
    with Sessions() as session:
        session.add(UniqueKey(key="taken"))
        session.commit()
    expected: dict[int, list[str]] = {}
    (job_id,) = add(Sessions, "shaped", steal=True)
    worker = start_worker(_shape_tasks(engine, shape, expected), lease=5, heartbeat_interval=0.2)
    wait_for(lambda: worker.stats.lost == 1, what="attempt 1 counted lost")
    wait_for(lambda: not worker.held(), what="attempt 1 forgotten")
    row = job(engine, job_id)
    assert (row.status, row.lease_owner, row.attempts) == ("running", "thief", 1)
    assert effects(engine) == [] and worker.stats.done == 0  # nothing of attempt 1
    give_back(engine, job_id)
    wait_for(status_is(engine, job_id, "done", "failed"), what="attempt 2 to finish")
    wait_for(worker.idle, what="the worker to go idle")
    row = job(engine, job_id)
    assert (row.status, row.attempts) == ("done", 2) and claimed_by(row.lease_owner, worker)
    assert notes(engine) == sorted(expected[2])  # attempt 2's writes, once
    assert (worker.stats.done, worker.stats.lost) == (1, 1)
    assert scalar(engine, "SELECT count(*) FROM unique_keys") == 1


def test_get_or_create_in_a_savepoint_commits_the_row_once_and_the_job_once(
    engine: Engine, Sessions: Any, start_worker: Any
) -> None:
    """The reported case: the business row committed on every attempt (4 times) and the
    job left running while the worker counted it done."""
    tasks = Tasks()

    @tasks.task
    def get_or_create(job: Any, session: Session) -> None:
        try:
            with session.begin_nested():
                session.add(UniqueKey(key=job.payload["key"], job_id=job.id))
        except IntegrityError:
            pass  # it exists already: fine
        session.add(_effect(job, f"attempt {job.attempts}"))

    ids = add(Sessions, "get_or_create", 4, key="customer-42", max_attempts=4)
    worker = start_worker(tasks, concurrency=2)
    for job_id in ids:
        wait_for(status_is(engine, job_id, "done", "failed"), what=f"job {job_id} to finish")
    wait_for(worker.idle, what="the worker to go idle")
    with engine.connect() as conn:
        rows = conn.execute(select(TASKS.c.status, TASKS.c.attempts).where(TASKS.c.id.in_(ids))).all()
    assert sorted(rows) == [("done", 1)] * 4
    assert scalar(engine, "SELECT count(*) FROM unique_keys WHERE key = 'customer-42'") == 1
    assert sorted((e.job_id, e.note) for e in effects(engine)) == [(i, "attempt 1") for i in ids]
    assert (worker.stats.done, worker.stats.lost, worker.stats.retried) == (4, 0, 0)


# == 2. Nothing a handler does can kill or wedge a worker ==================================


class CustomBaseException(BaseException):
    pass


BASE_EXCEPTIONS: dict[str, Callable[[], BaseException]] = {
    "SystemExit": lambda: SystemExit(3),
    "KeyboardInterrupt": KeyboardInterrupt,
    "CancelledError": asyncio.CancelledError,
    "GeneratorExit": GeneratorExit,
    "BaseException subclass": lambda: CustomBaseException("not an Exception"),
}


def _qualified(exc: BaseException) -> str:
    kind = type(exc)
    return f"{kind.__module__}.{kind.__qualname__}"


def _liveness_tasks(tasks: Tasks, concurrency: int) -> None:
    """``together``: jobs that finish only if ``concurrency`` threads run them at once."""
    barrier = threading.Barrier(concurrency, timeout=15)

    @tasks.task
    def together(job: Any) -> None:
        barrier.wait()

    @tasks.task
    def noop(job: Any) -> None:
        pass


def _assert_every_thread_alive(engine: Engine, Sessions: Any, concurrency: int) -> None:
    """``concurrency`` jobs that each wait for all the others (one per thread: the worker
    claims one job at a time here), then more jobs than threads."""
    together = add(Sessions, "together", concurrency, max_attempts=1)
    more = add(Sessions, "noop", 5 * concurrency)
    for job_id in together + more:
        wait_for(status_is(engine, job_id, "done", "failed"), what=f"job {job_id} to finish")
    with engine.connect() as conn:
        found = conn.execute(select(TASKS.c.status).where(TASKS.c.id.in_(together + more))).scalars().all()
    assert set(found) == {"done"}, "an executor thread is gone or wedged"


@pytest.mark.parametrize("transactional", [False, True], ids=["plain", "transactional"])
@pytest.mark.parametrize("name", list(BASE_EXCEPTIONS))
def test_a_base_exception_from_a_handler_retries_then_fails_its_job(
    engine: Engine, Sessions: Any, start_worker: Any, name: str, transactional: bool
) -> None:
    make = BASE_EXCEPTIONS[name]
    tasks = Tasks()
    if transactional:

        @tasks.task(name="bad")
        def bad_tx(job: Any, session: Session) -> None:
            session.add(_effect(job, "must not commit"))
            session.flush()
            raise make()

    else:

        @tasks.task(name="bad")
        def bad_plain(job: Any) -> None:
            raise make()

    _liveness_tasks(tasks, 2)
    ids = add(Sessions, "bad", 3, max_attempts=2)
    worker = start_worker(tasks, concurrency=2, batch_size=1)
    for job_id in ids:
        wait_for(status_is(engine, job_id, "failed"), what=f"job {job_id} to fail")
    for job_id in ids:
        row = job(engine, job_id)
        assert row.attempts == 2 and row.last_error.startswith(_qualified(make()))
    assert effects(engine) == []
    wait_for_counts(worker, retried=3, failed=3)  # the counts follow the rows, a moment later
    _assert_every_thread_alive(engine, Sessions, 2)


class UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("this exception cannot be printed")


class UnprintableReason:
    def __str__(self) -> str:
        raise RuntimeError("this reason cannot be printed")


NASTY = "NUL \x00 and a lone surrogate \ud800 in the text"
MEGABYTE = "x" * 1_000_000

ERRORS: dict[str, tuple[Callable[[], BaseException], str]] = {
    # name: (what the handler raises, how the stored last_error starts)
    "unprintable exception": (UnprintableError, _qualified(UnprintableError())),
    "NUL and surrogate": (lambda: ValueError(NASTY), "builtins.ValueError: NUL "),
    "DeadLetter with NUL and surrogate": (lambda: DeadLetter(NASTY), "DeadLetter: NUL "),
    "RetryLater with NUL and surrogate": (lambda: RetryLater(0, NASTY), "RetryLater: NUL "),
    "DeadLetter with an unprintable reason": (lambda: DeadLetter(UnprintableReason()), "DeadLetter: "),  # type: ignore[arg-type]
    "1 MB message": (lambda: RuntimeError(MEGABYTE), "builtins.RuntimeError: xxxx"),
    "1 MB DeadLetter": (lambda: DeadLetter(MEGABYTE), "DeadLetter: xxxx"),
    "1 MB RetryLater": (lambda: RetryLater(0, MEGABYTE), "RetryLater: xxxx"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_every_error_text_is_stored_sanitized_and_bounded(
    engine: Engine, Sessions: Any, start_worker: Any, name: str
) -> None:
    make, prefix = ERRORS[name]
    tasks = Tasks()

    @tasks.task
    def nasty(job: Any) -> None:
        raise make()

    _liveness_tasks(tasks, 1)
    (job_id,) = add(Sessions, "nasty", max_attempts=1)
    worker = start_worker(tasks, concurrency=1, max_error_length=2000)
    wait_for(status_is(engine, job_id, "failed"), what="the job to be recorded failed")
    error = job(engine, job_id).last_error
    assert error is not None and error.startswith(prefix)
    assert len(error) <= 2000 and "\x00" not in error
    if "NUL" in name:
        assert "and a lone surrogate" in error and "in the text" in error
    wait_for_counts(worker, failed=1)
    _assert_every_thread_alive(engine, Sessions, 1)


def _recorded(engine: Engine, job_id: int, attempt: int) -> Callable[[], bool]:
    def check() -> bool:
        row = job(engine, job_id)
        return bool(row.attempts == attempt and row.status != "running")

    return check


def test_a_backoff_that_overflows_is_recorded_and_the_worker_lives_on(
    engine: Engine, Sessions: Any, start_worker: Any
) -> None:
    tasks = Tasks()

    @tasks.task
    def fails(job: Any) -> None:
        raise RuntimeError(f"failure on attempt {job.attempts}")

    _liveness_tasks(tasks, 2)
    (retried,) = add(Sessions, "fails", max_attempts=5)
    (second,) = add(Sessions, "fails", max_attempts=5)
    (exhausted,) = add(Sessions, "fails", max_attempts=3)
    # The next claim makes these attempt 3, 2 and 3: 1e300**2 overflows, 1e300 s cannot be
    # a timedelta, and an infinite cap times the jitter makes NaN.
    execute(engine, "UPDATE tasks SET attempts = 2 WHERE id IN (:a, :b)", a=retried, b=exhausted)
    execute(engine, "UPDATE tasks SET attempts = 1 WHERE id = :b", b=second)
    overflowing = Backoff(base=1, factor=1e300, cap=float("inf"))
    worker = start_worker(tasks, concurrency=2, batch_size=1, backoff=overflowing)
    wait_for(status_is(engine, exhausted, "failed"), what="the exhausted job to fail")
    for job_id, attempt in ((retried, 3), (second, 2)):
        wait_for(_recorded(engine, job_id, attempt), what=f"job {job_id} attempt {attempt} recorded")
        row = job(engine, job_id)
        assert (row.status, row.attempts) == ("pending", attempt)
        assert row.last_error.startswith(f"builtins.RuntimeError: failure on attempt {attempt}")
        # Postponed (far): a huge backoff is not a reason to run it again at once.
        assert scalar(engine, "SELECT run_after > now() + interval '1 hour' FROM tasks WHERE id = :id", id=job_id)
    assert job(engine, exhausted).last_error.startswith("builtins.RuntimeError: failure on attempt 3")
    wait_for_counts(worker, retried=2, failed=1)
    _assert_every_thread_alive(engine, Sessions, 2)


async def coroutine_handler(job: Any) -> None:
    pass


async def coroutine_handler_with_session(job: Any, session: Session) -> None:
    pass


async def coroutine_with_an_option(job: Any, option: int) -> None:
    pass


class AsyncCallable:
    async def __call__(self, job: Any) -> None:
        pass


def _registry(handler: Any) -> Tasks:
    tasks = Tasks()
    tasks.register("async_task", handler)
    return tasks


COROUTINE_HANDLERS: dict[str, Callable[[], Any]] = {
    "async def": lambda: coroutine_handler,
    "async def with a session": lambda: coroutine_handler_with_session,
    "in a Tasks registry": lambda: _registry(coroutine_handler),
    "functools.partial": lambda: functools.partial(coroutine_with_an_option, option=1),
    "async __call__": AsyncCallable,
    "async __call__ in a registry": lambda: _registry(AsyncCallable()),
}


@pytest.mark.parametrize("name", list(COROUTINE_HANDLERS))
def test_a_coroutine_function_handler_is_refused_when_the_worker_is_built(engine: Engine, name: str) -> None:
    with pytest.raises(TypeError) as refused:
        # A registry may refuse it at registration already: that is as good.
        Worker(engine, Task, COROUTINE_HANDLERS[name]())
    message = str(refused.value)
    assert "coroutine" in message and "AsyncWorker" in message


@pytest.mark.parametrize("runtime", ["thread"], indirect=True)  # the asyncio worker awaits it
@pytest.mark.parametrize("transactional", [False, True], ids=["plain", "transactional"])
def test_a_handler_returning_an_awaitable_fails_its_job_clearly(
    engine: Engine, Sessions: Any, start_worker: Any, transactional: bool
) -> None:
    ran: list[int] = []

    async def body(job_id: int) -> None:
        ran.append(job_id)

    tasks = Tasks()
    if transactional:

        @tasks.task(name="sneaky")
        def sneaky_tx(job: Any, session: Session) -> Any:
            session.add(_effect(job, "must not commit"))
            return body(job.id)

    else:

        @tasks.task(name="sneaky")
        def sneaky_plain(job: Any) -> Any:
            return body(job.id)

    _liveness_tasks(tasks, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (job_id,) = add(Sessions, "sneaky", max_attempts=3)
        worker = start_worker(tasks, concurrency=1)
        wait_for(status_is(engine, job_id, "failed"), what="the job to fail")
        _assert_every_thread_alive(engine, Sessions, 1)
        gc.collect()
    row = job(engine, job_id)
    assert row.attempts == 1, "retrying cannot help: it should fail at once"
    assert "awaitable" in row.last_error and "sneaky" in row.last_error
    assert ran == [] and effects(engine) == []
    unawaited = [w for w in caught if "never awaited" in str(w.message)]
    assert unawaited == []
    wait_for_counts(worker, failed=1)


# == 3. A row that cannot become the handler's object fails alone ==========================


def _claimed_together_with_good_rows(
    engine: Engine, Sessions: Any, start_worker: Any, insert_bad: str, reason: str
) -> None:
    """Good rows before and after the bad one, then more good jobs once it failed. One
    thread: its first claim takes one job (its handlers are not measured yet), the next
    one the bad row in a batch with good ones."""
    before = add(Sessions, "record")
    (bad,) = [row[0] for row in execute(engine, insert_bad)]
    after = add(Sessions, "record", 2)
    worker = start_worker(concurrency=1, batch_size=100)
    wait_for(lambda: status_of(engine, bad) == "failed", what="the bad row to fail")
    later = add(Sessions, "record", 3)
    good = before + after + later
    for job_id in good:
        wait_for(status_is(engine, job_id, "done", "failed"), what=f"job {job_id} to finish")
    with engine.connect() as conn:
        found = conn.execute(
            select(TASKS.c.id, TASKS.c.status, TASKS.c.attempts, TASKS.c.last_error).order_by(TASKS.c.id)
        ).all()
    by_id = {r.id: r for r in found}
    assert all((by_id[i].status, by_id[i].attempts) == ("done", 1) for i in good)
    assert sorted(e.job_id for e in effects(engine)) == sorted(good)
    bad_row = by_id[bad]
    assert bad_row.attempts == 1, "a row that cannot load fails at once"
    assert reason in bad_row.last_error
    wait_for_counts(worker, failed=1, lost=0)


def test_a_payload_python_cannot_parse_fails_alone(engine: Engine, Sessions: Any, start_worker: Any) -> None:
    _claimed_together_with_good_rows(
        engine,
        Sessions,
        start_worker,
        "INSERT INTO tasks (task, payload) "
        "VALUES ('record', ('{\"n\": ' || repeat('9', 5000) || '}')::jsonb) RETURNING id",
        "digits",  # Python's int max-str-digits limit
    )


def test_a_row_psycopg_cannot_read_fails_alone(engine: Engine, Sessions: Any, start_worker: Any) -> None:
    _claimed_together_with_good_rows(
        engine,
        Sessions,
        start_worker,
        "INSERT INTO tasks (task, created_at) VALUES ('record', 'infinity') RETURNING id",
        "cannot read the row",
    )


@pytest.mark.parametrize(
    ("label", "code", "reason"),
    [("broken", "ok", "refuses to load a 'broken' label"), ("fine", "unreadable", "Picky cannot read")],
    ids=["reconstructor raises", "TypeDecorator raises"],
)
def test_a_model_that_refuses_a_row_fails_that_job_alone(
    engine: Engine, start_worker: Any, label: str, code: str, reason: str
) -> None:
    seen: list[int] = []

    def handle(job: FragileJob) -> None:
        seen.append(job.id)

    insert = "INSERT INTO fragile_jobs (label, code) VALUES (:label, :code) RETURNING id"
    good = [execute(engine, insert, label="fine", code="ok")[0][0]]
    bad = execute(engine, insert, label=label, code=code)[0][0]
    good += [execute(engine, insert, label="fine", code="ok")[0][0] for _ in range(2)]
    worker = start_worker(handle, FragileJob, concurrency=1, batch_size=100)
    table = FragileJob.__table__
    columns = (table.c.id, table.c.status, table.c.attempts, table.c.last_error)

    def rows() -> dict[int, Any]:
        with engine.connect() as conn:
            return {r.id: r for r in conn.execute(select(*columns))}

    wait_for(lambda: all(r.status in ("done", "failed") for r in rows().values()), what="all finished")
    found = rows()
    assert sorted(seen) == good
    assert all((found[i].status, found[i].attempts) == ("done", 1) for i in good)
    assert (found[bad].status, found[bad].attempts) == ("failed", 1)
    assert reason in found[bad].last_error
    wait_for_counts(worker, done=3, failed=1)


# == 4. Heartbeats ========================================================================


def test_a_handler_locking_its_own_job_row_does_not_cost_other_jobs_their_lease(
    engine: Engine, Sessions: Any, start_worker: Any
) -> None:
    """The handler updates its job row and holds the transaction for ~8 beats (longer than
    the lease) while the same worker holds three other jobs."""
    box: list[Worker] = []
    ready = Event()
    released = Event()
    waited: list[bool] = []
    tasks = Tasks()

    @tasks.task
    def locks_its_row(job: Any, session: Session) -> None:
        ready.wait(10)
        worker = box[0]
        session.add(job)
        job.priority = 7
        session.flush()  # its row is locked until the worker commits
        session.add(_effect(job, "locked"))
        waited.append(worker.heartbeat.wait_rounds(worker.heartbeat.rounds + 8, timeout=10))
        released.set()

    @tasks.task
    def holds(job: Any, session: Session) -> None:
        ready.wait(10)
        released.wait(15)
        session.add(_effect(job, "held"))

    (locker,) = add(Sessions, "locks_its_row")
    others = add(Sessions, "holds", 3)
    worker = start_worker(tasks, concurrency=4, batch_size=1, lease=1, heartbeat_interval=0.2)
    box.append(worker)
    ready.set()
    for job_id in [locker, *others]:
        wait_for(status_is(engine, job_id, "done", "failed"), what=f"job {job_id} to finish")
    assert waited == [True], "the heartbeat stopped beating while the handler held its row"
    with engine.connect() as conn:
        rows = conn.execute(select(TASKS.c.id, TASKS.c.status, TASKS.c.attempts, TASKS.c.priority)).all()
    assert sorted(rows) == sorted([(locker, "done", 1, 7)] + [(i, "done", 1, 0) for i in others])
    assert notes(engine) == ["held", "held", "held", "locked"]
    wait_for_counts(worker, lost=0, swept=0, done=4)  # the counts follow the rows, a moment later


MANY = 12_000


def _inject_held(engine: Engine, worker: Worker, count: int, lease: float) -> tuple[list[int], Any]:
    """``count`` rows running under ``worker``'s lease, in its ledger (as if its executors
    had claimed them: their adaptive batches never reach this many on a small machine).
    They sit in a queue the worker does not claim from. Returns their ids and the
    lease expiry they were inserted with."""
    rows = execute(
        engine,
        "INSERT INTO tasks (task, queue, status, attempts, lease_owner, lease_expires_at) "
        "SELECT 'injected', 'held', 'running', 1, :owner, "
        "       clock_timestamp() + :lease * interval '1 second' "
        "FROM generate_series(1, :n) RETURNING id, lease_expires_at",
        owner=f"{worker.owner}/injected",
        lease=lease,
        n=count,
    )
    worker.ledger.add([Held(ClaimToken(row[0], 1), owner=f"{worker.owner}/injected") for row in rows])
    return [row[0] for row in rows], max(row[1] for row in rows)


def _blocking_tasks(gate: Event, started: list[int]) -> Tasks:
    tasks = Tasks()

    @tasks.task
    def blocks(job: Any, session: Session) -> None:
        session.add(_effect(job, f"blocked a{job.attempts}"))
        started.append(job.id)
        gate.wait(60)

    return tasks


#: Worker connections whose every prepared statement runs a generic plan, as PostgreSQL
#: chooses for a statement run often (psycopg prepares it after a few runs).
GENERIC_PLANS = "-c plan_cache_mode=force_generic_plan"


def test_heartbeats_keep_more_than_ten_thousand_held_jobs(engine: Engine, Sessions: Any, make_worker: Any) -> None:
    """Under the worst plan: a generic one, with statistics taken while no job ran (the
    heartbeat's tokens joined to the table by nested loop, the square of their number in
    one statement: 12,000 tokens took over a minute, past the lease)."""
    gate = Event()
    started: list[int] = []
    blocking = add(Sessions, "blocks", 40, queue="work")
    execute(engine, "ANALYZE tasks")
    generic = engine_with(engine.url, options=GENERIC_PLANS)
    worker = make_worker(
        generic,
        Task,
        _blocking_tasks(gate, started),
        queues=("work",),
        concurrency=4,
        batch_size=3000,
        lease=30,
        heartbeat_interval=0.5,
        backoff=FAST,
        poll_interval=0.5,
        sweep_interval=0.2,
    )
    worker.start()
    try:
        try:
            wait_for(lambda: len(started) == 4, what="every executor blocked in a handler")
            injected, inserted_expiry = _inject_held(engine, worker, MANY, lease=30)
            assert len(worker.held()) > 10_000
            beats = worker.stats.heartbeats
            assert worker.heartbeat.wait_rounds(worker.heartbeat.rounds + 3, timeout=60), "heartbeats fail"
            assert worker.stats.heartbeats >= beats + 3
            with engine.connect() as conn:
                extended = conn.execute(
                    text(
                        "SELECT count(*) FROM tasks WHERE id = ANY(:ids) AND status = 'running' "
                        "AND lease_owner = :owner AND lease_expires_at > :inserted"
                    ),
                    {"ids": injected, "owner": f"{worker.owner}/injected", "inserted": inserted_expiry},
                ).scalar()
            assert extended == MANY, "not every held job's lease was extended"
            assert (worker.stats.lost, worker.stats.swept) == (0, 0)
        finally:
            gate.set()
        for job_id in blocking:
            wait_for(status_is(engine, job_id, "done", "failed"), what=f"job {job_id} to finish")
        assert sorted(e.job_id for e in effects(engine)) == blocking
        assert all(job(engine, i).attempts == 1 for i in blocking)
        wait_for_counts(worker, lost=0, done=len(blocking))  # the counts follow the rows
        assert len(worker.held()) == MANY  # the injected ones: never run, still held
    finally:
        worker.stop(grace=1)
        generic.dispose()


def test_stop_hands_back_more_than_ten_thousand_held_jobs(engine: Engine, Sessions: Any, make_worker: Any) -> None:
    """Under the worst plan, as the heartbeat test above."""
    gate = Event()
    started: list[int] = []
    add(Sessions, "blocks", 40, queue="work")
    execute(engine, "ANALYZE tasks")
    generic = engine_with(engine.url, options=GENERIC_PLANS)
    worker = make_worker(
        generic,
        Task,
        _blocking_tasks(gate, started),
        queues=("work",),
        concurrency=4,
        batch_size=3000,
        lease=30,
        heartbeat_interval=0.5,
        backoff=FAST,
        poll_interval=0.5,
        sweep_interval=0.2,
    )
    worker.start()
    try:
        try:
            wait_for(lambda: len(started) == 4, what="every executor blocked in a handler")
            _inject_held(engine, worker, MANY, lease=30)
            held = len(worker.held())
            assert held > 10_000
            begun = time.monotonic()
            worker.stop(grace=0.2)
            took = time.monotonic() - begun
            # It returned without the handlers, which block for a minute: releasing this many
            # rows takes seconds (docs/operations/timing.md gives the figures), not the handlers' time.
            assert took < 30, took
        finally:
            gate.set()
        for service in worker.services():
            assert service.join(10), f"{service.name} did not stop"
        counts = statuses(engine)
        assert worker.stats.released == held
        assert counts.get("running", 0) == 0 and counts.get("done", 0) == 0
        assert scalar(engine, "SELECT count(*) FROM tasks WHERE lease_owner IS NOT NULL") == 0
        assert effects(engine) == []  # the blocked handlers' writes were handed back with them
        assert worker.stats.done == 0 and worker.stats.lost == 0
    finally:
        worker.stop(grace=1)
        generic.dispose()


def test_jobs_finishing_during_beats_are_not_reported_lost(engine: Engine, start_worker: Any) -> None:
    execute(engine, "INSERT INTO tasks (task) SELECT 'record' FROM generate_series(1, 2500)")
    execute(engine, "INSERT INTO tasks (task) SELECT 'work' FROM generate_series(1, 2500)")
    # Beats every 50 ms, so many meet a completion; the lease is long enough that a
    # stall of the machine (CI runs two suites on two cores) cannot take a job away.
    worker = start_worker(concurrency=4, lease=5, heartbeat_interval=0.05)
    # What is tested is that none is lost, not the speed: on two cores shared with a second
    # suite the asyncio worker has drained them in 27 s and in more than 60.
    wait_for(lambda: statuses(engine) == {"done": 5000}, timeout=180, what="all 5,000 done")
    wait_for_counts(worker, done=5000, lost=0, swept=0)  # the counts follow the rows, a moment later
    assert worker.stats.heartbeats > 0
    assert scalar(engine, "SELECT count(*) FROM effects") == 2500
    assert scalar(engine, "SELECT count(DISTINCT job_id) FROM effects") == 2500
    assert scalar(engine, "SELECT max(attempts) FROM tasks") == 1


#: Text of the heartbeat's statement (the claims lock their rows in a subquery).
HEARTBEAT_MARKER = b"FOR UPDATE OF tasks SKIP LOCKED"


def _beating(link: Link) -> bool:
    return "heartbeat" in link.tags and not link.closed


def test_a_hung_heartbeat_connection_is_noticed_and_replaced(
    engine: Engine, Sessions: Any, server: Server, make_worker: Any
) -> None:
    """The heartbeat's connection freezes behind a proxy that still acknowledges packets
    (TCP keepalive never fires): its beat is cut by its deadline and a new connection
    beats on, so the running job keeps its lease (no sweep, no loss) and is recorded
    once. (A proxy, not a stopped backend: a backend stopped while it holds a lock of
    the server's own would stall every session of the server.)"""
    with proxied(server, f"{APP_NAME}_hung", {"heartbeat": HEARTBEAT_MARKER}) as (proxy, worker_engine):
        (job_id,) = add(Sessions, "record", sleep=3)
        worker = make_worker(
            worker_engine,
            Task,
            _app_tasks(),
            lease=1.2,
            heartbeat_interval=0.2,
            sweep_interval=0.2,
            poll_interval=0.5,
            backoff=FAST,
        )
        worker.start()
        try:
            wait_for(status_is(engine, job_id, "running"), what="the job to start")
            wait_for(lambda: any(_beating(link) for link in proxy.links), what="the heartbeat's connection")
            frozen = proxy.freeze(_beating)
            assert len(frozen) == 1, [sorted(link.tags) for link in proxy.links]
            rounds = worker.heartbeat.rounds
            assert worker.heartbeat.wait_rounds(rounds + 3, timeout=5), "the heartbeat did not recover"
            assert any(_beating(link) for link in proxy.links if link not in frozen), "no new heartbeat connection"
            wait_for(status_is(engine, job_id, "done", "failed"), timeout=10, what="the job to finish")
            assert not any(link.thawed for link in frozen), "the frozen connection thawed"
        finally:
            proxy.thaw()
            worker.stop(grace=1)
    row = job(engine, job_id)
    assert (row.status, row.attempts) == ("done", 1) and claimed_by(row.lease_owner, worker)
    assert len(effects(engine)) == 1
    wait_for_counts(worker, done=1)
    assert (worker.stats.lost, worker.stats.swept) == (0, 0)


def _app_tasks() -> Tasks:
    from .worker_app import tasks

    return tasks


def test_no_beat_for_a_whole_lease_stops_claiming_and_loses_what_is_held(
    engine: Engine, Sessions: Any, start_worker: Any
) -> None:
    box: list[Worker] = []
    running = Event()
    returned = Event()
    tasks = Tasks()

    @tasks.task
    def stalls(job: Any, session: Session) -> None:
        session.add(_effect(job, f"attempt {job.attempts}"))
        session.flush()
        if job.attempts == 1:
            running.set()
            deadline = time.monotonic() + 10
            while box[0].stats.lost == 0 and time.monotonic() < deadline:
                sleep(0.02)  # the handler takes its time: until its lease is given up
            returned.set()

    worker = start_worker(tasks, concurrency=2, lease=1, heartbeat_interval=0.2, sweep_interval=0.2)
    box.append(worker)  # before the job exists: its handler reads the worker's counters
    (job_id,) = add(Sessions, "stalls")
    assert running.wait(10)
    with held_lock(engine, "ACCESS EXCLUSIVE"):  # no statement reaches the table for a while
        wait_for(lambda: worker.stats.lost == 1, timeout=10, what="the held job counted lost")
        assert returned.wait(10)
        wait_for(lambda: not worker.held(), what="the lost job forgotten")
        # No beat can succeed while the table is locked: the worker must not claim again
        # (healthy) before one does. Watch it for three heartbeat intervals.
        watch_until = time.monotonic() + 3 * worker.config.effective_heartbeat
        while time.monotonic() < watch_until:
            assert not worker.ledger.healthy, "claiming resumed although no heartbeat succeeded"
            sleep(0.01)
    wait_for(status_is(engine, job_id, "done", "failed"), timeout=15, what="the job to run again")
    wait_for(worker.idle, what="the worker to go idle")
    row = job(engine, job_id)
    assert (row.status, row.attempts) == ("done", 2)
    assert notes(engine) == ["attempt 2"], "attempt 1's writes committed"
    # Healthy again: the retry was claimed. On a loaded machine a later beat may overrun
    # its 0.2 s deadline and flip it for a moment, which is the design, not a failure.
    wait_for(lambda: worker.ledger.healthy, what="claiming to stay resumed")
    wait_for_counts(worker, lost=1, done=1)
    assert worker.stats.swept >= 1


# == 5. Backpressure ======================================================================


def test_held_jobs_stay_bounded_while_completions_stall_and_all_drain_after(engine: Engine, start_worker: Any) -> None:
    total = 30_000
    execute(engine, "INSERT INTO tasks (task) SELECT 'work' FROM generate_series(1, :n)", n=total)
    worker = start_worker(concurrency=16, lease=10, heartbeat_interval=1)
    bound = worker.config.concurrency * worker.config.max_batch()
    samples: list[int] = []
    sampling = Event()

    def sample() -> None:
        while not sampling.is_set():
            samples.append(len(worker.held()))
            sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        wait_for(lambda: worker.stats.done >= 1000, timeout=30, what="the worker to be draining")
        with held_lock(engine, "EXCLUSIVE") as conn:  # UPDATEs wait; reads go on
            done_at_start = conn.execute(text("SELECT count(*) FROM tasks WHERE status = 'done'")).scalar()
            sleep(1.0)  # the stall itself
            done_at_end = conn.execute(text("SELECT count(*) FROM tasks WHERE status = 'done'")).scalar()
            stalled_held = len(worker.held())
        assert done_at_end == done_at_start, "the stall did not stall completions"
        assert done_at_start is not None and done_at_start < total, "the worker finished before the stall"
        # The bound and the drain are tested, not the speed (see the beats test above).
        wait_for(lambda: statuses(engine) == {"done": total}, timeout=180, what="everything to drain")
    finally:
        sampling.set()
        sampler.join(5)
    assert max(samples) <= bound, f"held {max(samples)} jobs, more than {bound}"
    assert stalled_held <= bound
    wait_for_counts(worker, done=total, lost=0)  # an outcome is counted once its COMMIT returns
    assert scalar(engine, "SELECT max(attempts) FROM tasks") == 1
