"""``schema_translate_map``: one model, a table per tenant schema.

Two schemas made here, each with its own ``tasks`` table; an engine with
``execution_options(schema_translate_map={None: "tenant_a"})``. Every enqueue path must
write to ``tenant_a.tasks`` and wake the listeners of that table's channel, and a worker
on that engine (both runtimes) must claim, heartbeat, sweep and complete there only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, func, insert, select, text
from sqlalchemy.orm import Session

from sqla_queue import QueueSession, WorkerStartError, Workflow, enqueue_values, enqueue_workflow, pause
from sqla_queue import sql as q
from sqla_queue.model import notify_channel

from .helpers import SENTINEL_CHANNEL, Server, notifications_until_sentinel, table_of, wait_for
from .models import TASK_QUEUES, StepJob, Task
from .workers import FAST, TASKS

TENANTS = ("tenant_a", "tenant_b")


def tenant(engine: Engine, name: str) -> Engine:
    return engine.execution_options(schema_translate_map={None: name})


@pytest.fixture
def tenants(engine: Engine) -> Iterator[Engine]:
    """The test database's engine, with a ``tasks`` table in each tenant's schema."""
    for name in TENANTS:
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {name} CASCADE"))
            conn.execute(text(f"CREATE SCHEMA {name}"))
        TASKS.create(tenant(engine, name))
        TASK_QUEUES.create(tenant(engine, name))  # the task table's queues can be paused
    yield engine
    with engine.begin() as conn:
        for name in TENANTS:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {name} CASCADE"))


def test_a_pause_holds_in_its_tenants_schema_only(tenants: Engine) -> None:
    """The queues table follows the queue table into each tenant's schema: a queue
    paused in one tenant is claimed as usual in another."""
    for name in TENANTS:
        with tenant(tenants, name).begin() as conn:
            conn.execute(insert(TASKS).values(task="work", payload={}, queue="x"))
    with tenant(tenants, "tenant_a").begin() as conn:
        assert pause(conn, Task, "x") is True
    claimed = {}
    for name in TENANTS:
        with tenant(tenants, name).begin() as conn:
            claimed[name] = len(conn.execute(q.claim(Task, owner="me", queues=["x"])).all())
    assert claimed == {"tenant_a": 0, "tenant_b": 1}


def rows_in(engine: Engine, schema: str | None) -> list[Any]:
    table = f"{schema}.tasks" if schema else "tasks"
    with engine.connect() as conn:
        return list(conn.execute(text(f"SELECT id, status, queue, attempts, task FROM {table} ORDER BY id")))


def channel(schema: str | None) -> str:
    return notify_channel(TASKS, {None: schema} if schema else None)


def test_channels_follow_the_translated_schema() -> None:
    assert len({channel(None), channel("tenant_a"), channel("tenant_b")}) == 3
    assert channel("tenant_a") == notify_channel(TASKS.to_metadata(TASKS.metadata.__class__(), schema="tenant_a"))


def test_every_enqueue_path_writes_to_the_tenant_and_wakes_its_workers(
    tenants: Engine, server: Server, listener: psycopg.Connection[Any]
) -> None:
    a = tenant(tenants, "tenant_a")
    for name in (SENTINEL_CHANNEL, channel(None), channel("tenant_a"), channel("tenant_b")):
        listener.execute(f'LISTEN "{name}"')
    with QueueSession(a) as session:
        session.enqueue(Task(task="work", payload={}), queue="orm")
        session.commit()
    with QueueSession(a) as session:
        session.enqueue_many(Task, [{"task": "work", "payload": {}}] * 2, queue="copy", method="copy")
        session.enqueue_many(Task, [{"task": "work", "payload": {}}] * 2, queue="insert", method="insert")
        session.commit()
    with QueueSession(a) as session:
        enqueue_values(session, Task, {"task": "work", "payload": {}}, queue="values")
        session.commit()
    with a.connect() as conn:
        enqueue_values(conn, Task, {"task": "work", "payload": {}}, queue="values_conn")
        conn.commit()
    # A Session whose connection carries the map (the engine has none).
    with QueueSession(tenants) as session:
        session.connection(execution_options={"schema_translate_map": {None: "tenant_a"}})
        enqueue_values(session, Task, {"task": "work", "payload": {}}, queue="values_option")
        session.commit()
    got = notifications_until_sentinel(listener, server.conninfo)
    assert {c for c, _ in got} == {channel("tenant_a")}, got
    assert {p for _, p in got} == {"orm", "copy", "insert", "values", "values_conn", "values_option"}
    queues = sorted(r.queue for r in rows_in(tenants, "tenant_a"))
    assert queues == ["copy", "copy", "insert", "insert", "orm", "values", "values_conn", "values_option"]
    assert rows_in(tenants, None) == [] and rows_in(tenants, "tenant_b") == []
    # The plans cached for the first tenant do not leak to the second.
    b = tenant(tenants, "tenant_b")
    with b.connect() as conn:
        enqueue_values(conn, Task, {"task": "work", "payload": {}}, queue="values_conn")
        conn.commit()
    assert [r.queue for r in rows_in(tenants, "tenant_b")] == ["values_conn"]


def test_keyed_bulk_rows_go_to_the_tenant_and_skip_only_its_duplicates(tenants: Engine) -> None:
    """The keyed INSERT compiled once per set of columns is compiled per schema too."""
    rows: list[Any] = [
        {"task": "work", "unique_key": "k1"},
        {"task": "work", "unique_key": "k2", "priority": 3},  # another set of columns
        {"task": "work", "unique_key": "k1"},
    ]
    for name in ("tenant_a", "tenant_b", "tenant_a"):
        with QueueSession(tenant(tenants, name)) as session:
            written = session.enqueue_many(Task, rows)
            expected = (0, 3) if name == "tenant_a" and rows_in(tenants, name) else (2, 1)
            assert (written.inserted, written.skipped) == expected, name
            session.commit()
    for name in TENANTS:
        assert [(r.task, r.queue, r.attempts) for r in rows_in(tenants, name)] == [("work", "default", 0)] * 2
    assert rows_in(tenants, None) == []


def test_a_worker_claims_beats_sweeps_and_completes_in_its_tenant_only(
    tenants: Engine, make_worker: Any
) -> None:
    a = tenant(tenants, "tenant_a")

    def jobs(engine: Engine, n: int, **payload: Any) -> list[int]:
        with QueueSession(engine) as session:
            made = [session.enqueue(Task(task="work", payload=dict(payload)), queue="q") for _ in range(n)]
            session.commit()
            return [j.id for j in made]

    with Session(tenants) as session:  # the same ids in every schema: public, tenant_b
        session.add_all(Task(task="work", payload={}, queue="q") for _ in range(3))
        session.commit()
    jobs(tenant(tenants, "tenant_b"), 3)
    ids = jobs(a, 3)
    long_id = jobs(a, 1, sleep=2.5)[0]  # outlives its lease: only heartbeats keep it
    with a.begin() as conn:
        swept_id = conn.scalar(
            insert(TASKS)
            .values(task="work", payload={}, queue="q", status="running", attempts=1, lease_owner="dead",
                    lease_expires_at=func.now() - text("interval '1 second'"))
            .returning(TASKS.c.id)
        )
    worker = make_worker(a, Task, _tasks(), lease=1.0, heartbeat_interval=0.2, backoff=FAST,
                         poll_interval=0.5, sweep_interval=0.2, queues=("q", "r"))
    worker.start()
    try:
        wait_for(lambda: all(r.status == "done" for r in rows_in(tenants, "tenant_a")), timeout=40,
                 what="every tenant_a job done")
        assert worker.stats.lost == 0 and worker.stats.heartbeats > 0
    finally:
        worker.stop(grace=1)
    done = {r.id: r for r in rows_in(tenants, "tenant_a")}
    assert set(done) == {*ids, long_id, swept_id}
    assert done[long_id].attempts == 1 and done[swept_id].attempts == 2
    assert {(r.status, r.attempts) for r in rows_in(tenants, None)} == {("pending", 0)}
    assert {(r.status, r.attempts) for r in rows_in(tenants, "tenant_b")} == {("pending", 0)}


def test_the_start_up_check_looks_in_the_translated_schema(tenants: Engine, make_worker: Any) -> None:
    worker = make_worker(tenant(tenants, "tenant_c"), Task, _tasks())
    with pytest.raises(WorkerStartError, match=r"tenant_c\.tasks"):
        worker.start()
    worker.stop()


def _tasks() -> Any:
    from .worker_app import tasks

    return tasks


@pytest.mark.parametrize("queues", [("a",), ("a", "b")], ids=["one queue", "two queues"])
def test_cursor_claims_read_the_tenants_table(tenants: Engine, queues: tuple[str, ...]) -> None:
    """The cursor claim, compiled once and run on the DBAPI cursor (with arrays of one
    entry per queue when several are served), reads the translated table: after a claim
    from the head, the cursor claim takes the tenant's next jobs of each queue, never the
    rows with the same ids in the other schemas."""
    from sqla_queue.worker.cursor import ClaimCursor

    from .test_ops import add, on_driver, tokens_of

    a = tenant(tenants, "tenant_a")
    for other in (tenants, tenant(tenants, "tenant_b")):  # the same ids, elsewhere
        for queue in queues:
            add(other, 3, queue=queue)
    first = {queue: add(a, 1, queue=queue)[0] for queue in queues}
    with on_driver("thread", a) as on:
        ops = on.ops(queues=queues)
        cursor = ClaimCursor(60.0, per_queue=ops.after_per_queue)
        head = ops.claim_request("w", len(queues), after=cursor.start(), seen=cursor.claimed)
        assert not head.from_cursor
        assert tokens_of(on(lambda conn: ops.fetch_claimed(conn, head))) == sorted((k, 1) for k in first.values())
        later = sorted(k for queue in queues for k in add(a, 2, queue=queue))
        request = ops.claim_request("w", 10, after=cursor.start(), seen=cursor.claimed)
        assert request.from_cursor
        assert tokens_of(on(lambda conn: ops.fetch_claimed(conn, request))) == [(k, 1) for k in later]
    for schema in (None, "tenant_b"):
        assert {r.status for r in rows_in(tenants, schema)} == {"pending"}


def test_a_released_child_wakes_the_workers_of_its_tenant(tenants: Engine, make_worker: Any) -> None:
    """A workflow in ``tenant_a``, its parent in queue ``p`` and its child in ``c``: the
    worker of ``p`` ends the parent, whose statement releases the child and NOTIFYs the
    channel of ``tenant_a``'s table, where the worker of ``c`` listens (its poll is a
    minute, so only that wake-up runs the child in time)."""
    a = tenant(tenants, "tenant_a")
    steps = table_of(StepJob)
    steps.create(a)
    flow = Workflow()
    parent = flow.add(StepJob(), queue="p")
    child = flow.add(StepJob(), after=[parent], queue="c")
    quiet = {"poll_interval": 60.0, "sweep_interval": 60.0}
    workers = [make_worker(a, StepJob, lambda job: None, queues=(name,), **quiet) for name in ("c", "p")]
    with Session(a, expire_on_commit=False) as session:
        enqueue_workflow(session, flow)
        session.commit()
    workers[0].start()
    wait_for(lambda: workers[0].listener.connections >= 1 and workers[0].idle, timeout=20,
             what="the worker of c listening, and idle")
    workers[1].start()
    try:
        wait_for(lambda: _status(a, child.id) == "done", timeout=20, what="the child run after its wake-up")
        assert _status(a, parent.id) == "done"
    finally:
        for worker in workers:
            worker.stop(grace=1)


def test_wake_values_give_a_statement_run_by_hand_its_tenant_s_channel(tenants: Engine, server: Server) -> None:
    a = tenant(tenants, "tenant_a")
    steps = table_of(StepJob)
    steps.create(a)
    flow = Workflow()
    parent = flow.add(StepJob(), queue="p")
    flow.add(StepJob(), after=[parent], queue="c")
    with Session(a, expire_on_commit=False) as session:
        enqueue_workflow(session, flow)
        session.commit()
    assert q.wake_values(StepJob, a.connect()) == {q.CHANNEL_PARAM: notify_channel(steps, {None: "tenant_a"})}
    assert q.wake_values(Task, a.connect()) == {}
    with psycopg.connect(server.conninfo, autocommit=True) as listening:
        listening.execute(f'LISTEN "{SENTINEL_CHANNEL}"')
        listening.execute(f'LISTEN "{notify_channel(steps, {None: "tenant_a"})}"')
        with a.begin() as conn:
            (claimed,) = conn.execute(q.claim(StepJob, owner="me", queues=["p"])).all()
            stmt = q.complete_if_owner(StepJob, owner="me", tokens=[(claimed.id, claimed.attempts)])
            conn.execute(stmt, q.wake_values(StepJob, conn))
        received = notifications_until_sentinel(listening, server.conninfo)
    assert (notify_channel(steps, {None: "tenant_a"}), "c") in received


def _status(engine: Engine, key: int) -> str:
    steps = table_of(StepJob)
    with engine.connect() as conn:
        return str(conn.scalar(select(steps.c.status).where(steps.c.id == key)))
