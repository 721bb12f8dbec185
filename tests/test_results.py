"""Results: a handler's return value stored by the fenced completion, read with ``result()``
and waited for with ``wait_for_result()`` (woken by the NOTIFY of the statement that
finished the job, with a poll as fallback), on both runtimes.

``ResultTask`` keeps its results as JSONB (``ResultMixin``); ``TotalJob`` keeps them in an
``Integer`` column of its own (``__queue_result__ = "total"``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, create_engine, func, insert, select, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from sqla_queue import (
    JobCancelledError,
    JobFailedError,
    NoSuchJob,
    ResultNotReady,
    ResultNotStorable,
    ResultTimeout,
    RetryLater,
    Tasks,
    WorkerConfig,
    cancel,
    current_job,
    result,
    wait_for_result,
)
from sqla_queue import sql as q
from sqla_queue.model import results_channel
from sqla_queue.ops import QueueOps
from sqla_queue.sql._results import NOTIFY_IDS_MAX

from .helpers import Server, table_of, wait_for, wait_for_counts
from .models import Effect, ResultTask, Task, TotalJob
from .test_ops import on_driver

RESULTS = table_of(ResultTask)
TOTALS = table_of(TotalJob)
EFFECTS = table_of(Effect)

tasks = Tasks()


@tasks.task
def add(job: Any) -> dict[str, int]:
    return {"sum": job.payload["a"] + job.payload["b"]}


@tasks.task
def nothing(job: Any) -> None:
    return None


@tasks.task
def boom(job: Any) -> None:
    raise ValueError(f"no sum for {job.payload}")


@tasks.task
def unstorable(job: Any) -> object:
    return {"at": object()}


@tasks.task
def sized(job: Any) -> str:
    return "x" * int(job.payload["n"])


@tasks.task
def written(job: Any, session: Session) -> list[int]:
    """Transactional: its write and its result commit with the completion, or neither."""
    session.add(Effect(job_id=job.id, worker="w", note="written"))
    if job.payload.get("bad"):
        return [1, object()]  # type: ignore[list-item]
    return [job.id, job.attempts]


@tasks.task
def resumed(job: Any) -> int:
    """Counts its attempts in its progress: each attempt resumes from the last one's."""
    done = int((job.progress or {}).get("steps", 0)) + 1
    current_job().progress({"steps": done})
    if done < 3:
        raise RetryLater(0.01, "not yet")
    return done


@tasks.task
def reporting(job: Any) -> str:
    """Records progress, then waits until the test has seen it in the row (or is told to stop)."""
    current_job().progress({"at": "halfway"})
    assert GO.wait(30), "the test never let the handler go on"
    return "finished"


@tasks.task
def written_with_progress(job: Any, session: Session) -> int:
    session.add(Effect(job_id=job.id, worker="w", note="progress"))
    current_job().progress("all written")
    return 1


GO = threading.Event()


def enqueue(engine: Engine, *specs: tuple[str, dict[str, Any]], max_attempts: int = 3) -> list[int]:
    with engine.begin() as conn:
        rows = [{"task": name, "payload": payload, "max_attempts": max_attempts} for name, payload in specs]
        return list(conn.scalars(insert(RESULTS).returning(RESULTS.c.id, sort_by_parameter_order=True), rows))


def row(engine: Engine, job_id: int) -> Any:
    with engine.connect() as conn:
        return conn.execute(select(RESULTS).where(RESULTS.c.id == job_id)).one()


def waiting_reads(engine: Engine, table: str) -> int:
    """Connections of this database idle after reading a job's result: waiters that made
    their first read and now wait for a NOTIFY."""
    with engine.connect() as conn:
        return conn.scalar(
            select(func.count()).select_from(text("pg_stat_activity")).where(
                text("datname = current_database() AND state = 'idle' AND query LIKE :read")
            ),
            {"read": f"SELECT {table}.status, %"},
        ) or 0


class Waiter:
    """``wait_for_result`` in a thread of its own, sync or on an event loop of its own with
    an asyncio engine: its value or error, and when it returned."""

    def __init__(self, engine: Engine, kind: str, model: Any, job_id: Any, **options: Any) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.returned_at: float | None = None
        self._thread = threading.Thread(target=self._run, args=(engine, kind, model, job_id, options), daemon=True)
        self._thread.start()

    def _run(self, engine: Engine, kind: str, model: Any, job_id: Any, options: dict[str, Any]) -> None:
        try:
            if kind == "sync":
                self.value = wait_for_result(engine, model, job_id, **options)
            else:
                self.value = asyncio.run(self._async(engine, model, job_id, options))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc
        self.returned_at = time.monotonic()

    @staticmethod
    async def _async(engine: Engine, model: Any, job_id: Any, options: dict[str, Any]) -> Any:
        async_engine = create_async_engine(engine.url)
        try:
            async with AsyncSession(async_engine) as session:  # the session's engine is used
                return await wait_for_result(session, model, job_id, **options)
        finally:
            await async_engine.dispose()

    def join(self, timeout: float = 30) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the waiter did not return"


@pytest.fixture(params=["sync", "async"])
def waiter_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# -- the worker stores what the handler returned ---------------------------------------------


def test_a_handler_s_return_value_is_the_job_s_result_in_every_batch(
    engine: Engine, start_worker: Callable[..., Any]
) -> None:
    specs = [("add", {"a": n, "b": 1}) for n in range(60)] + [("nothing", {})] * 5
    ids = enqueue(engine, *specs)
    worker = start_worker(tasks, ResultTask, concurrency=2, batch_size=16)
    wait_for(lambda: all(row(engine, i).status == "done" for i in ids), timeout=30)
    with Session(engine) as session:
        assert [result(session, ResultTask, i) for i in ids[:60]] == [{"sum": n + 1} for n in range(60)]
        assert [result(session, ResultTask, i) for i in ids[60:]] == [None] * 5
    wait_for_counts(worker, done=65)  # a count follows its completion's commit


def test_a_transactional_handler_s_result_commits_with_its_writes(
    engine: Engine, start_worker: Callable[..., Any]
) -> None:
    good, bad = enqueue(engine, ("written", {}), ("written", {"bad": True}), max_attempts=2)
    start_worker(tasks, ResultTask)
    wait_for(lambda: row(engine, good).status == "done" and row(engine, bad).status == "failed", timeout=30)
    assert row(engine, good).result == [good, 1]
    failed = row(engine, bad)
    assert failed.result is None
    assert "ResultNotStorable" in failed.last_error and "not JSON-serialisable" in failed.last_error
    with engine.connect() as conn:  # the bad job's two attempts wrote nothing that stayed
        assert list(conn.scalars(select(EFFECTS.c.job_id))) == [good]


@pytest.mark.parametrize(("task", "payload", "error"), [
    ("unstorable", {}, "not JSON-serialisable"),
    ("sized", {"n": 200}, "over the worker's max_result_size of 100"),
])
def test_a_result_the_table_cannot_keep_fails_the_attempt_and_is_retried_with_backoff(
    engine: Engine, start_worker: Callable[..., Any], task: str, payload: dict[str, Any], error: str
) -> None:
    (job_id,) = enqueue(engine, (task, payload), max_attempts=2)
    (fits,) = enqueue(engine, ("sized", {"n": 98}))  # 100 characters of JSON, quotes included
    worker = start_worker(tasks, ResultTask, max_result_size=100)
    wait_for(lambda: row(engine, job_id).status == "failed" and row(engine, fits).status == "done", timeout=30)
    failed = row(engine, job_id)
    assert failed.attempts == 2 and failed.result is None
    assert failed.last_error.startswith("sqla_queue.errors.ResultNotStorable: ") and error in failed.last_error
    assert row(engine, fits).result == "x" * 98
    assert worker.stats.retried == 1 and worker.stats.failed == 1


def test_a_typed_result_column_keeps_the_value_in_its_type(engine: Engine, start_worker: Callable[..., Any]) -> None:
    with engine.begin() as conn:
        ids = list(conn.scalars(insert(TOTALS).returning(TOTALS.c.id, sort_by_parameter_order=True),
                                [{"amount": 7, "max_attempts": 1}, {"amount": -1, "max_attempts": 1}]))

    def total(job: TotalJob) -> Any:
        return job.amount * 6 if job.amount > 0 else "not a number"

    start_worker(total, TotalJob)
    wait_for(lambda: _statuses(engine, TOTALS, ids) == ["done", "failed"], timeout=30)
    with Session(engine) as session:
        assert result(session, TotalJob, ids[0]) == 42
        with pytest.raises(JobFailedError, match="its column holds int") as failed:
            result(session, TotalJob, ids[1])
    assert failed.value.status == "failed" and "ResultNotStorable" in (failed.value.last_error or "")
    with engine.connect() as conn:
        assert conn.scalar(select(TOTALS.c.total).where(TOTALS.c.id == ids[0])) == 42


def _statuses(engine: Engine, table: Any, ids: list[int]) -> list[str]:
    with engine.connect() as conn:
        found: dict[int, str] = dict(conn.execute(select(table.c.id, table.c.status).where(table.c.id.in_(ids))).all())
    return [found[i] for i in ids]


# -- result(): read in the caller's transaction ------------------------------------------------


def test_result_says_what_keeps_a_job_from_having_one(engine: Engine) -> None:
    pending, failed, cancelled = enqueue(engine, ("add", {"a": 1, "b": 1}), ("boom", {}), ("add", {}))
    with engine.begin() as conn:
        conn.execute(RESULTS.update().where(RESULTS.c.id == failed).values(status="failed", last_error="E: why\ntb"))
        conn.execute(RESULTS.update().where(RESULTS.c.id == cancelled).values(status="cancelled"))
    with Session(engine) as session:
        with pytest.raises(ResultNotReady, match="is pending") as not_ready:
            result(session, ResultTask, pending)
        assert not_ready.value.status == "pending" and isinstance(not_ready.value, LookupError)
        with pytest.raises(JobFailedError, match="ended failed: E: why") as error:
            result(session, ResultTask, failed)
        assert error.value.last_error == "E: why\ntb" and error.value.job_id == failed
        with pytest.raises(JobCancelledError, match="ended cancelled"):
            result(session, ResultTask, cancelled)
        with pytest.raises(NoSuchJob, match="no job 999"):
            result(session, ResultTask, 999)
        with pytest.raises(TypeError, match=r"keeps no results: mix sqla_queue\.ResultMixin"):
            result(session, Task, pending)
        with pytest.raises(TypeError, match="needs a Session or a Connection"):
            result(engine, ResultTask, pending)  # type: ignore[call-overload]


def test_result_reads_in_the_caller_s_transaction_on_both_kinds(engine: Engine) -> None:
    (job_id,) = enqueue(engine, ("add", {}))
    with engine.begin() as conn:
        conn.execute(RESULTS.update().where(RESULTS.c.id == job_id).values(status="done", result={"k": [1, 2]}))
    with engine.connect() as conn:
        assert result(conn, ResultTask, job_id) == {"k": [1, 2]}

    async def read() -> Any:
        async_engine = create_async_engine(engine.url)
        try:
            async with AsyncSession(async_engine) as session:
                return await result(session, ResultTask, job_id)
        finally:
            await async_engine.dispose()

    assert asyncio.run(read()) == {"k": [1, 2]}


# -- wait_for_result(): woken by the finishing statement's NOTIFY --------------------------------


def test_wait_for_result_returns_soon_after_the_commit(
    engine: Engine, start_worker: Callable[..., Any], waiter_kind: str
) -> None:
    (job_id,) = enqueue(engine, ("add", {"a": 20, "b": 22}))
    # A poll far beyond the bound: only the NOTIFY of the completion can wake it in time.
    waiter = Waiter(engine, waiter_kind, ResultTask, job_id, timeout=60, poll_interval=60)
    wait_for(lambda: waiting_reads(engine, RESULTS.name) >= 1, timeout=20)
    started = time.monotonic()
    start_worker(tasks, ResultTask)
    waiter.join()
    assert waiter.error is None and waiter.value == {"sum": 42}
    assert waiter.returned_at is not None and waiter.returned_at - started < 5


@pytest.mark.parametrize("ending", ["dead letter", "cancel"])
def test_wait_for_result_raises_soon_for_a_job_that_ends_without_one(
    engine: Engine, start_worker: Callable[..., Any], waiter_kind: str, ending: str
) -> None:
    (job_id,) = enqueue(engine, ("boom", {"n": 1}), max_attempts=1)
    waiter = Waiter(engine, waiter_kind, ResultTask, job_id, timeout=60, poll_interval=60)
    wait_for(lambda: waiting_reads(engine, RESULTS.name) >= 1, timeout=20)
    started = time.monotonic()
    if ending == "cancel":
        with Session(engine) as session:
            assert cancel(session, ResultTask, ids=[job_id]) == [job_id]
            session.commit()
    else:
        start_worker(tasks, ResultTask)
    waiter.join()
    assert waiter.returned_at is not None and waiter.returned_at - started < 5
    if ending == "cancel":
        assert isinstance(waiter.error, JobCancelledError)
    else:
        assert isinstance(waiter.error, JobFailedError)
        assert waiter.error.last_error is not None and "ValueError: no sum for {'n': 1}" in waiter.error.last_error


def test_a_rolled_back_completion_wakes_no_waiter_and_the_poll_still_finds_the_end(
    engine: Engine, waiter_kind: str
) -> None:
    (job_id,) = enqueue(engine, ("add", {}))
    waiter = Waiter(engine, waiter_kind, ResultTask, job_id, timeout=60, poll_interval=0.3)
    wait_for(lambda: waiting_reads(engine, RESULTS.name) >= 1, timeout=20)
    with engine.begin() as conn:
        (token,) = [(r.id, r.attempts) for r in conn.execute(q.claim(ResultTask, owner="me", limit=1))]
    with engine.connect() as conn:  # completed, then rolled back: no result, no NOTIFY
        assert conn.execute(q.complete_if_owner(ResultTask, owner="me", tokens=[token], results=[7])).all()
        conn.rollback()
    assert row(engine, job_id).status == "running" and waiter.returned_at is None
    with engine.begin() as conn:  # finished by a statement that sends nothing: the poll sees it
        conn.execute(RESULTS.update().where(RESULTS.c.id == job_id).values(status="done", result=8))
    waiter.join()
    assert waiter.error is None and waiter.value == 8


def test_wait_for_result_gives_up_after_its_timeout(engine: Engine, waiter_kind: str) -> None:
    (job_id,) = enqueue(engine, ("add", {}))
    began = time.monotonic()
    waiter = Waiter(engine, waiter_kind, ResultTask, job_id, timeout=0.5, poll_interval=0.1)
    waiter.join()
    assert isinstance(waiter.error, ResultTimeout) and isinstance(waiter.error, TimeoutError)
    assert waiter.error.status == "pending" and "still pending after 0.5s" in str(waiter.error)
    assert waiter.returned_at is not None and 0.5 <= waiter.returned_at - began < 10


def test_wait_for_result_refuses_what_it_cannot_wait_for(engine: Engine) -> None:
    with pytest.raises(NoSuchJob):  # an uncommitted job is not there for the waiter's own connection
        wait_for_result(engine, ResultTask, 12345, timeout=1)
    with pytest.raises(TypeError, match="keeps no results"):
        wait_for_result(engine, Task, 1)
    for bad in ({"timeout": -1}, {"poll_interval": 0}, {"timeout": float("nan")}, {"poll_interval": True}):
        with pytest.raises(ValueError, match="seconds"):
            wait_for_result(engine, ResultTask, 1, **bad)
    with pytest.raises(TypeError, match="needs an Engine"):
        wait_for_result("postgresql://", ResultTask, 1)  # type: ignore[call-overload]


def test_the_waiter_s_pooled_connection_stops_listening_and_keeps_nothing(server: Server, engine: Engine) -> None:
    (job_id,) = enqueue(engine, ("add", {}))
    with engine.begin() as conn:
        conn.execute(RESULTS.update().where(RESULTS.c.id == job_id).values(status="done", result=1))
    one = create_engine(server.url, pool_size=1, max_overflow=0)
    try:
        assert wait_for_result(one, ResultTask, job_id, timeout=5) == 1
        with one.connect() as conn:
            assert conn.exec_driver_sql("SELECT count(*) FROM pg_listening_channels()").scalar() == 0
            raw = conn.connection.driver_connection
            assert isinstance(raw, psycopg.Connection) and not list(raw.notifies(timeout=0))
    finally:
        one.dispose()


# -- the statements: results bound per token, one NOTIFY per statement ---------------------------


@pytest.fixture
def results_listener(server: Server) -> Iterator[psycopg.Connection[Any]]:
    conn = psycopg.connect(server.conninfo, autocommit=True)
    conn.execute(f'LISTEN "{results_channel(RESULTS)}"')
    try:
        yield conn
    finally:
        conn.close()


def heard(conn: psycopg.Connection[Any], timeout: float = 2.0) -> list[str]:
    """Every payload on the results channel until none more comes for ``timeout``."""
    return [n.payload for n in conn.notifies(timeout=timeout)]


@pytest.mark.parametrize("driver", ["thread", "asyncio"])
def test_the_compiled_completion_stores_each_token_s_result_and_notifies_once(
    engine: Engine, results_listener: psycopg.Connection[Any], driver: str
) -> None:
    ids = enqueue(engine, *[("add", {})] * 4)
    with on_driver(driver, engine) as on:
        ops = on.ops(model=ResultTask)
        assert isinstance(ops, QueueOps) and ops.stores_results
        claimed = on(lambda c: ops.fetch_claimed(c, ops.claim_request("w", 10)))
        tokens = sorted(c.token for c in claimed)
        encode = ops.result_encoder(1000)
        results = [encode(v) for v in ({"a": 1}, None, [1, "two"], "text")]
        moved = on(lambda c: ops.complete(c, "w", tokens[:3], results[:3]))
        assert moved == dict.fromkeys(tokens[:3], "done")
        assert heard(results_listener) == [",".join(map(str, ids[:3]))]
        done, _ = on(lambda c: ops.complete_then_claim(c, tokens[3:], ops.claim_request("w", 10), results[3:]))
        assert done == {tokens[3]: "done"}
        assert heard(results_listener) == [str(ids[3])]
    assert [row(engine, i).result for i in ids] == [{"a": 1}, None, [1, "two"], "text"]


def test_a_statement_finishing_too_many_ids_to_list_sends_a_star(
    engine: Engine, results_listener: psycopg.Connection[Any]
) -> None:
    n = NOTIFY_IDS_MAX // 4 + 10  # ids of four digits and a comma: past the payload's limit
    with engine.begin() as conn:
        conn.execute(text("SELECT setval(pg_get_serial_sequence('result_tasks', 'id'), 1000)"))
    ids = enqueue(engine, *[("add", {})] * n)
    with engine.begin() as conn:
        tokens = [(r.id, r.attempts) for r in conn.execute(q.claim(ResultTask, owner="me", limit=n))]
        assert len(tokens) == n and min(ids) >= 1000
        finished = conn.execute(q.complete_if_owner(ResultTask, owner="me", tokens=tokens)).all()
        assert len(finished) == n
    assert heard(results_listener) == ["*"]


def test_retries_notify_only_the_jobs_they_dead_letter(
    engine: Engine, results_listener: psycopg.Connection[Any]
) -> None:
    again, last = enqueue(engine, ("boom", {}), ("boom", {}), max_attempts=2)
    with engine.begin() as conn:
        conn.execute(RESULTS.update().where(RESULTS.c.id == last).values(max_attempts=1))
        tokens = {r.id: (r.id, r.attempts) for r in conn.execute(q.claim(ResultTask, owner="me", limit=2))}
    with engine.begin() as conn:
        for job_id in (again, last):
            conn.execute(q.retry_if_owner(ResultTask, owner="me", token=tokens[job_id], error="E", delay=0))
    assert heard(results_listener) == [str(last)]


def test_the_single_call_builder_checks_results_before_anything_runs(engine: Engine) -> None:
    with pytest.raises(ValueError, match="one value per token"):
        q.complete_if_owner(ResultTask, owner="me", tokens=[(1, 1), (2, 1)], results=[1])
    with pytest.raises(ResultNotStorable, match="not JSON-serialisable"):
        q.complete_if_owner(ResultTask, owner="me", tokens=[(1, 1)], results=[{1, 2}])
    with pytest.raises(TypeError, match="keeps no results"):
        q.complete_if_owner(Task, owner="me", tokens=[(1, 1)], results=[1])


@pytest.mark.parametrize("size", [0, -1, 2**28])
def test_max_result_size_is_checked(size: int) -> None:
    with pytest.raises(ValueError, match="max_result_size"):
        WorkerConfig(max_result_size=size)


# -- progress: written with the heartbeat and with every outcome, kept across retries ------------


def test_progress_survives_a_retry_and_the_next_attempt_resumes_from_it(
    engine: Engine, start_worker: Callable[..., Any]
) -> None:
    (job_id,) = enqueue(engine, ("resumed", {}), max_attempts=5)
    start_worker(tasks, ResultTask)
    wait_for(lambda: row(engine, job_id).status == "done", timeout=30)
    done = row(engine, job_id)
    assert (done.attempts, done.progress, done.result) == (3, {"steps": 3}, 3)


def test_progress_reaches_the_row_with_the_heartbeat_while_the_handler_runs(
    engine: Engine, start_worker: Callable[..., Any]
) -> None:
    GO.clear()
    (job_id,) = enqueue(engine, ("reporting", {}))
    try:
        start_worker(tasks, ResultTask, lease=3.0, heartbeat_interval=0.2)
        wait_for(lambda: row(engine, job_id).progress == {"at": "halfway"}, timeout=20)
        assert row(engine, job_id).status == "running"
    finally:
        GO.set()
    wait_for(lambda: row(engine, job_id).status == "done", timeout=20)
    assert (row(engine, job_id).progress, row(engine, job_id).result) == ({"at": "halfway"}, "finished")


def test_a_transactional_handler_s_progress_commits_with_its_completion(
    engine: Engine, start_worker: Callable[..., Any]
) -> None:
    (job_id,) = enqueue(engine, ("written_with_progress", {}))
    start_worker(tasks, ResultTask)
    wait_for(lambda: row(engine, job_id).status == "done", timeout=30)
    assert (row(engine, job_id).progress, row(engine, job_id).result) == ("all written", 1)


@pytest.mark.parametrize("driver", ["thread", "asyncio"])
def test_the_compiled_beat_and_outcomes_write_each_token_s_progress(engine: Engine, driver: str) -> None:
    ids = enqueue(engine, *[("add", {})] * 6)
    with engine.begin() as conn:
        conn.execute(RESULTS.update().where(RESULTS.c.id == ids[1]).values(progress={"kept": True}))
    with on_driver(driver, engine) as on:
        ops = on.ops(model=ResultTask)
        assert ops.stores_progress
        claimed = on(lambda c: ops.fetch_claimed(c, ops.claim_request("w/0", 10)))
        tokens = sorted(c.token for c in claimed)
        encode = ops.progress_encoder(100)
        beat = [encode(v) for v in (1, None, "three", None, None, None)]
        assert on(lambda c: ops.extend_leases(c, "w/", tokens, progress=beat)) == set(tokens)
        assert [row(engine, i).progress for i in ids] == [1, {"kept": True}, "three", None, None, None]
        ends = [encode({"end": n}) for n in range(2)]
        assert on(lambda c: ops.retry(c, "w/0", tokens[3:5], ["E", "E"], [0.0, 0.0], ends)) == dict.fromkeys(
            tokens[3:5], "pending")
        assert on(lambda c: ops.complete(c, "w/0", tokens[:3], [None] * 3, [None, encode(2), None])) == dict.fromkeys(
            tokens[:3], "done")
    assert [row(engine, i).progress for i in ids] == [1, 2, "three", {"end": 0}, {"end": 1}, None]
