"""Unique jobs: at most one job per key in the chosen statuses, a duplicate skipped by
``INSERT … ON CONFLICT DO NOTHING`` and never an error, on every enqueue path, sync and
async, across connections and processes. Real PostgreSQL throughout."""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy import Engine, Integer, MetaData, create_engine, func, select, text, update
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from sqla_queue import (
    AsyncQueueSession,
    BulkRowError,
    Enqueued,
    EnqueuedMany,
    EnqueueError,
    QueueSession,
    TaskMixin,
    UniqueJobs,
    enqueue,
    enqueue_many,
    enqueue_values,
)
from sqla_queue import sql as q
from sqla_queue.enqueue.rows import table_plan

from .helpers import Server, table_of, wait_for
from .models import EmailJob, OnceJob, Order, OrderJob, Task
from .test_bulk import _ChildJob, _Parent

EMAIL = table_of(EmailJob)
TASKS = table_of(Task)


@pytest.fixture
def Sessions(engine: Engine) -> sessionmaker[QueueSession]:
    return sessionmaker(engine, class_=QueueSession)


def jobs(engine: Engine, table: Any = EMAIL) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(table).order_by(table.c.id)))


def run_async(server: Server, body: Callable[[AsyncEngine], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        async_engine = create_async_engine(server.url)
        try:
            return await body(async_engine)
        finally:
            await async_engine.dispose()

    return asyncio.run(main())


# -- enqueue() ----------------------------------------------------------------------------


def test_a_keyed_enqueue_inserts_at_once_and_a_duplicate_is_skipped_naming_the_holder(
    engine: Engine, Sessions: sessionmaker[QueueSession]
) -> None:
    with Sessions() as session:
        session.add(Order(id=1, customer="ada"))  # pending: flushed before the job's insert
        first = session.enqueue(EmailJob(order_id=1, recipient="a@example.com"), unique_key="invoice:1", priority=3)
        assert isinstance(first, Enqueued) and first.inserted and not first.skipped and first
        job = first.job
        assert job is not None and job.id == first.job_id
        assert job in session and job.status == "pending" and job.priority == 3 and job.unique_key == "invoice:1"
        second = session.enqueue(EmailJob(recipient="b@example.com"), unique_key="invoice:1")
        assert (second.inserted, second.job_id, second.job, bool(second)) == (False, first.job_id, None, False)
        other = session.enqueue(EmailJob(recipient="c@example.com"), unique_key="invoice:2")
        assert other.inserted
        session.commit()  # no IntegrityError, now or at commit
    rows = jobs(engine)
    assert [(r.unique_key, r.recipient) for r in rows] == [
        ("invoice:1", "a@example.com"), ("invoice:2", "c@example.com"),
    ]
    with engine.connect() as conn:
        assert conn.scalar(select(func.count()).select_from(Order.__table__)) == 1


def test_a_keyed_job_rolls_back_with_the_caller(engine: Engine, Sessions: sessionmaker[QueueSession]) -> None:
    with Sessions() as session:
        assert session.enqueue(EmailJob(), unique_key="k").inserted
        session.rollback()
    assert jobs(engine) == []
    with Sessions() as session:
        assert session.enqueue(EmailJob(), unique_key="k").inserted  # the key is free again
        session.commit()
    assert len(jobs(engine)) == 1


@pytest.mark.parametrize("status", ["pending", "running", "done", "failed", "cancelled"])
def test_which_statuses_hold_a_key(engine: Engine, Sessions: sessionmaker[QueueSession], status: str) -> None:
    """Default (pending, running): a finished job frees its key. ``UNIQUE_EVER``: a done
    one keeps it."""
    for model in (EmailJob, OnceJob):
        with Sessions() as session:
            held = session.enqueue(model(), unique_key="k")
            session.commit()
        with engine.begin() as conn:
            conn.execute(update(table_of(model)).values(status=status))
        with Sessions() as session:
            again = session.enqueue(model(), unique_key="k")
            session.commit()
        holds = status in ("pending", "running") or (model is OnceJob and status == "done")
        assert again.inserted is not holds, (model.__name__, status)
        if holds:
            assert again.job_id == held.job_id


def test_the_key_can_be_a_column_of_the_users_own(engine: Engine, Sessions: sessionmaker[QueueSession]) -> None:
    assert OrderJob.__queue_unique__ == UniqueJobs(column="order_id")
    with Sessions() as session:
        session.add_all([Order(id=1, customer="a"), Order(id=2, customer="b")])
        first = session.enqueue(OrderJob(note="one"), unique_key=1)
        assert first.inserted and first.job is not None and first.job.order_id == 1
        assert session.enqueue(OrderJob(order_id=1, note="again"), unique_key=1).job_id == first.job_id
        assert session.enqueue(OrderJob(note="two"), unique_key=2).inserted
        session.enqueue(OrderJob(note="no order"))  # no key: an ordinary job
        session.enqueue(OrderJob(note="no order either"))
        many = session.enqueue_many(OrderJob, [{"order_id": 1}, {"order_id": 2}, {"note": "free"}])
        assert (many.inserted, many.skipped) == (1, 2)
        assert enqueue_values(session, OrderJob, {"order_id": 2}).skipped
        session.commit()
    rows = jobs(engine, table_of(OrderJob))
    assert sorted(r.order_id or 0 for r in rows) == [0, 0, 0, 1, 2]
    assert all(r.unique_key is None for r in rows)


def test_bad_keys_are_refused_before_anything_is_written(
    engine: Engine, Sessions: sessionmaker[QueueSession]
) -> None:
    with Sessions() as session:
        session.add(Order(id=1, customer="a"))
        for bad, match in [("", "non-empty"), (True, "non-empty"), ("x" * 256, "unique_key")]:
            with pytest.raises(EnqueueError, match=match):
                session.enqueue(EmailJob(), unique_key=bad)  # type: ignore[call-overload]
        with pytest.raises(EnqueueError, match="enqueue it with unique_key"):
            session.enqueue(EmailJob(unique_key="set by hand"))
        with pytest.raises(EnqueueError, match="give one key"):
            session.enqueue(EmailJob(unique_key="a"), unique_key="b")
        with pytest.raises(EnqueueError, match="relationship"):
            session.enqueue(_ChildJob(parent=_Parent(), size=1), unique_key="rel")
        session.commit()  # the caller's transaction is still fine
    assert jobs(engine) == []


def test_a_model_without_the_key_column_refuses_a_key() -> None:
    with pytest.raises(ValueError, match="include pending"):
        UniqueJobs(statuses=("running",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="job statuses"):
        UniqueJobs(statuses=("waiting",))  # type: ignore[arg-type]


# -- two connections at the same moment ----------------------------------------------------


def _blocked_on(engine: Engine, waiter: int, holder: int) -> bool:
    with engine.connect() as conn:
        return holder in (conn.scalar(text("SELECT pg_blocking_pids(:pid)"), {"pid": waiter}) or [])


def test_two_transactions_enqueueing_one_key_at_once_end_with_one_job(engine: Engine, Sessions: Any) -> None:
    """Both insert the key at the same moment (a barrier); the one that comes second
    waits for the first transaction, which commits, and is then skipped: one job, and
    both callers' transactions commit their business rows."""
    barrier = threading.Barrier(2)
    results: dict[int, Enqueued[Any]] = {}
    errors: list[BaseException] = []

    def enqueuer(n: int) -> None:
        try:
            with Sessions() as session:
                session.add(Order(id=n, customer=f"c{n}"))
                session.flush()
                barrier.wait(10)
                results[n] = session.enqueue(EmailJob(order_id=n), unique_key="same")
                session.commit()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    for _ in range(20):
        with engine.begin() as conn:
            conn.execute(text("TRUNCATE email_jobs, orders CASCADE"))
        results.clear()
        threads = [threading.Thread(target=enqueuer, args=(n,)) for n in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        assert sorted(r.inserted for r in results.values()) == [False, True]
        rows = jobs(engine)
        assert len(rows) == 1
        assert {r.job_id for r in results.values()} == {rows[0].id}
        with engine.connect() as conn:
            assert conn.scalar(select(func.count()).select_from(Order.__table__)) == 2


def test_a_waiting_duplicate_is_inserted_when_the_holder_rolls_back(engine: Engine, Sessions: Any) -> None:
    with Sessions() as first:
        assert first.enqueue(EmailJob(recipient="first"), unique_key="k").inserted
        holder_pid = first.connection().exec_driver_sql("SELECT pg_backend_pid()").scalar()
        outcome: list[Enqueued[Any]] = []
        ready = threading.Event()
        waiter_pid: list[int] = []

        def second() -> None:
            with Sessions() as session:
                waiter_pid.append(session.connection().exec_driver_sql("SELECT pg_backend_pid()").scalar())
                ready.set()
                outcome.append(session.enqueue(EmailJob(recipient="second"), unique_key="k"))
                session.commit()

        thread = threading.Thread(target=second)
        thread.start()
        assert ready.wait(10)
        wait_for(lambda: _blocked_on(engine, waiter_pid[0], holder_pid), what="the second insert waiting")
        first.rollback()
        thread.join(10)
    assert outcome[0].inserted
    assert [r.recipient for r in jobs(engine)] == ["second"]


def _enqueue_random_keys(url: str, seed: int, path: str, out: Any) -> None:
    """One process: 1000 enqueues of random keys out of 500, each its own transaction,
    by ``enqueue()``, ``enqueue_values()`` or ``enqueue_many()``."""
    engine = create_engine(url, pool_size=1)  # one connection, reused by every transaction
    Sessions = sessionmaker(engine, class_=QueueSession)
    rng = random.Random(seed)
    inserted = 0
    try:
        for _ in range(1000):
            key = f"key-{rng.randrange(500)}"
            with Sessions() as session:
                if path == "enqueue":
                    inserted += session.enqueue(Task(task="t"), unique_key=key).inserted
                elif path == "values":
                    inserted += enqueue_values(session, Task, {"task": "t"}, unique_key=key).inserted
                else:
                    inserted += session.enqueue_many(Task, [{"task": "t", "unique_key": key}])
                session.commit()
        out.put(("ok", inserted))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out.put(("error", repr(exc)))
    finally:
        engine.dispose()


@pytest.mark.system
def test_eight_processes_enqueueing_random_keys_leave_one_job_per_key(engine: Engine, server: Server) -> None:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    url = server.url.render_as_string(hide_password=False)
    paths = ["enqueue", "values", "many"]
    processes = [
        context.Process(target=_enqueue_random_keys, args=(url, seed, paths[seed % 3], out)) for seed in range(8)
    ]
    for p in processes:
        p.start()
    answers = [out.get(timeout=300) for _ in processes]
    for p in processes:
        p.join(30)
    assert all(kind == "ok" for kind, _ in answers), answers
    with engine.connect() as conn:
        total, distinct = conn.execute(select(func.count(), func.count(TASKS.c.unique_key.distinct()))).one()
    assert total == distinct  # one job per key
    assert sum(n for _, n in answers) == total  # and each insert was reported once
    assert total > 400  # 8000 draws of 500 keys: (nearly) every key was drawn


# -- enqueue_many() -----------------------------------------------------------------------


@pytest.mark.parametrize("method", ["auto", "copy", "insert"])
@pytest.mark.parametrize("batch_size", [3, 1000])
def test_enqueue_many_skips_duplicates_in_the_call_and_against_existing_jobs(
    engine: Engine, Sessions: sessionmaker[QueueSession], method: Any, batch_size: int
) -> None:
    with Sessions() as session:
        session.enqueue(Task(task="before"), unique_key="k0")
        rows: list[Any] = []
        for i in range(10):
            rows.append({"task": "keyed", "unique_key": f"k{i % 4}"})  # k0..k3, each repeated
            rows.append({"task": "plain"})
        rows.append(Task(task="instance", unique_key="k9"))
        rows.append(Task(task="instance", unique_key="k9"))
        rows.append(Task(task="instance"))
        written = session.enqueue_many(Task, rows, method=method, batch_size=batch_size, priority=2)
        assert isinstance(written, EnqueuedMany) and isinstance(written, int)
        # 10 plain + 1 instance without a key; k1, k2, k3, k9 new; 7 keyed rows skipped.
        assert (written, written.inserted, written.skipped) == (15, 15, 8)
        session.commit()
    rows_in = jobs(engine, TASKS)
    assert len(rows_in) == 16
    keys = [r.unique_key for r in rows_in if r.unique_key is not None]
    assert sorted(keys) == ["k0", "k1", "k2", "k3", "k9"]
    assert {r.priority for r in rows_in if r.task != "before"} == {2}


@pytest.mark.parametrize("method", ["auto", "insert"])
def test_keyed_bulk_rows_get_the_values_enqueue_writes(
    engine: Engine, Sessions: sessionmaker[QueueSession], method: Any
) -> None:
    """Keyed rows leave to the server the defaults it repeats: the rows are the same."""
    with Sessions() as session:
        session.enqueue(Task(task="one"), unique_key="single")
        session.enqueue(Task(task="one", max_attempts=2), unique_key="single-opt", priority=4)
        rows: list[Any] = [
            {"task": "one", "unique_key": "bulk"},
            Task(task="one", unique_key="bulk-instance"),
            {"task": "one", "unique_key": "bulk-opt", "max_attempts": 2},
        ]
        assert session.enqueue_many(Task, rows[:2], method=method) == 2
        assert session.enqueue_many(Task, rows[2:], method=method, priority=4) == 1
        session.commit()
    ignored = {"id", "unique_key", "created_at", "run_after"}
    found = {r.unique_key: {k: v for k, v in r._mapping.items() if k not in ignored} for r in jobs(engine, TASKS)}
    assert found["bulk"] == found["bulk-instance"] == found["single"]
    assert found["single"]["queue"] == "default" and found["single"]["payload"] == {}
    assert found["bulk-opt"] == found["single-opt"]
    assert (found["bulk-opt"]["priority"], found["bulk-opt"]["max_attempts"]) == (4, 2)


def test_a_python_default_the_server_default_does_not_repeat_is_sent(engine: Engine) -> None:
    """Only a server default that gives the same value stands in for the Python default."""
    class Base(DeclarativeBase):
        metadata = MetaData()

    class OddTask(Base, TaskMixin):
        __tablename__ = "odd_default_tasks"
        priority: Mapped[int] = mapped_column(Integer, default=5, server_default=text("0"))

    assert "priority" not in table_plan(OddTask).server_same
    assert {"queue", "status", "attempts", "max_attempts", "isolated"} <= table_plan(OddTask).server_same
    Base.metadata.create_all(engine)
    try:
        with QueueSession(engine) as session:
            written = session.enqueue_many(OddTask, [{"task": "t", "unique_key": f"k{i}"} for i in range(3)])
            assert (written.inserted, written.skipped) == (3, 0)
            session.commit()
        with engine.connect() as conn:
            assert conn.execute(select(OddTask.priority).distinct()).scalars().all() == [5]
    finally:
        Base.metadata.drop_all(engine)


def test_enqueue_many_without_keys_returns_the_count_as_before(Sessions: sessionmaker[QueueSession]) -> None:
    with Sessions() as session:
        written = session.enqueue_many(Task, [{"task": "t"}] * 5)
        assert (written, written.skipped, repr(written)) == (5, 0, "EnqueuedMany(inserted=5, skipped=0)")
        assert session.enqueue_many(Task, []) == 0


def test_a_bad_keyed_row_names_its_index_and_leaves_nothing(
    engine: Engine, Sessions: sessionmaker[QueueSession]
) -> None:
    with Sessions() as session:
        session.add(Order(id=1, customer="a"))
        rows = [{"task": "t", "unique_key": "a"}, {"task": "t"}, {"task": "t", "unique_key": "x" * 300}]
        with pytest.raises(BulkRowError) as raised:
            session.enqueue_many(Task, rows, batch_size=1)
        assert raised.value.index == 2
        session.commit()
    assert jobs(engine, TASKS) == []


def test_enqueue_many_of_keyed_rows_from_asyncio(engine: Engine, server: Server) -> None:
    async def body(async_engine: AsyncEngine) -> EnqueuedMany:
        Sessions = async_sessionmaker(async_engine, class_=AsyncQueueSession)

        async def rows() -> Any:
            for i in range(6):
                yield {"task": "t", "unique_key": f"k{i % 3}"}

        async with Sessions() as session:
            written = await session.enqueue_many(Task, rows(), batch_size=4)
            again = await enqueue_many(session, Task, [{"task": "t", "unique_key": "k1"}, {"task": "t"}])
            await session.commit()
            assert (again.inserted, again.skipped) == (1, 1)
            return written

    written = run_async(server, body)
    assert (written.inserted, written.skipped) == (3, 3)
    assert len(jobs(engine, TASKS)) == 4


# -- enqueue_values() and the async session -------------------------------------------------


def test_enqueue_values_with_a_key(engine: Engine, Sessions: sessionmaker[QueueSession]) -> None:
    with Sessions() as session:
        first = enqueue_values(session, Task, {"task": "t"}, unique_key="k", delay=60)
        assert first.inserted and first.job is None
        again = enqueue_values(session, Task, {"task": "t", "unique_key": "k"})
        assert (again.inserted, again.job_id) == (False, first.job_id)
        session.commit()
    with engine.connect() as conn:  # a Connection too, and its transaction goes on
        assert enqueue_values(conn, Task, {"task": "t"}, unique_key="k").skipped
        assert enqueue_values(conn, Task, {"task": "t"}, unique_key="other").inserted
        conn.commit()
    assert len(jobs(engine, TASKS)) == 2


def test_keyed_enqueues_from_asyncio(engine: Engine, server: Server) -> None:
    async def body(async_engine: AsyncEngine) -> list[bool]:
        Sessions = async_sessionmaker(async_engine, class_=AsyncQueueSession)
        async with Sessions() as session:
            first = await session.enqueue(Task(task="t"), unique_key="k")
            assert first.job is not None and first.job.id == first.job_id and first.job.status == "pending"
            second = await enqueue(session, Task(task="t"), unique_key="k")
            third = await enqueue_values(session, Task, {"task": "t"}, unique_key="k")
            fourth = await enqueue_values(session, Task, {"task": "t"}, unique_key="k2")
            plain = session.enqueue(Task(task="no key"))  # still no I/O, nothing to await
            await session.flush()
            assert plain.id is not None
            await session.commit()
        async with async_engine.connect() as conn:
            fifth = await enqueue_values(conn, Task, {"task": "t"}, unique_key="k2")
            await conn.commit()
        return [first.inserted, second.inserted, third.inserted, fourth.inserted, fifth.inserted]

    assert run_async(server, body) == [True, False, False, True, False]
    assert len(jobs(engine, TASKS)) == 3


def test_a_keyed_job_is_claimed_and_completed_like_any_other(engine: Engine, Sessions: Any) -> None:
    with Sessions() as session:
        job_id = session.enqueue(Task(task="t"), unique_key="k").job_id
        session.commit()
    with engine.begin() as conn:
        claimed = conn.execute(q.claim(TASKS, owner="w", limit=1)).one()
        assert claimed.id == job_id
        conn.execute(q.complete_if_owner(TASKS, owner="w", tokens=[(job_id, 1)]))
    with Sessions() as session:
        assert session.enqueue(Task(task="t"), unique_key="k").inserted  # done frees it
        session.commit()


def test_the_builders_skip_a_held_key(engine: Engine) -> None:
    with engine.begin() as conn:
        stmt = q.insert_unique(TASKS).returning(TASKS.c.id)
        first = conn.execute(stmt, {"task": "t", "unique_key": "k"}).scalar()
        assert conn.execute(stmt, {"task": "t", "unique_key": "k"}).first() is None
        assert conn.execute(q.unique_holder(TASKS, key="k")).scalar() == first
        assert conn.execute(q.unique_holder(TASKS, key="none")).first() is None


def test_requeue_of_a_failed_job_leaves_a_held_key_alone(engine: Engine, Sessions: Any) -> None:
    with Sessions() as session:
        ids = [session.enqueue(Task(task="t"), unique_key=k).job_id for k in ("held", "free", "twice")]
        session.commit()
    with engine.begin() as conn:
        conn.execute(update(TASKS).values(status="failed"))
    with Sessions() as session:
        holder = session.enqueue(Task(task="t"), unique_key="held").job_id
        newer = session.enqueue(Task(task="t"), unique_key="twice").job_id
        session.commit()
    with engine.begin() as conn:
        conn.execute(update(TASKS).where(TASKS.c.id == newer).values(status="failed"))
        requeued = set(conn.scalars(q.requeue_failed(TASKS)))
    # "held" is held by a pending job; of the two failed "twice", the newer is requeued.
    assert requeued == {ids[1], newer}
    statuses = {r.id: r.status for r in jobs(engine, TASKS)}
    assert statuses == {ids[0]: "failed", ids[1]: "pending", ids[2]: "failed", holder: "pending", newer: "pending"}


def test_two_bulk_loads_of_the_same_keys_in_opposite_orders_do_not_deadlock(engine: Engine, Sessions: Any) -> None:
    """Keyed rows go in key order: the second load waits for the first, never in a cycle.
    (Inserted in the order given, about half of these trials deadlock.)"""
    keys = [f"k{n:04}" for n in range(1000)]
    results: dict[int, EnqueuedMany] = {}
    errors: list[BaseException] = []

    def load(n: int, ordered: list[str], barrier: threading.Barrier) -> None:
        try:
            with Sessions() as session:
                session.execute(text("SELECT 1"))
                barrier.wait(10)
                results[n] = session.enqueue_many(Task, [{"task": "t", "unique_key": k} for k in ordered])
                session.commit()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    for _ in range(6):  # each trial of the unordered insert deadlocked about every other time
        with engine.begin() as conn:
            conn.execute(text("TRUNCATE tasks"))
        results.clear()
        barrier = threading.Barrier(2)
        threads = [
            threading.Thread(target=load, args=(0, keys, barrier)),
            threading.Thread(target=load, args=(1, keys[::-1], barrier)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert sorted((r.inserted, r.skipped) for r in results.values()) == [(0, 1000), (1000, 0)]
        assert len(jobs(engine, TASKS)) == 1000
