"""Workflows: jobs that wait for others, released by the statement that ends their last
parent, in its transaction; the policies for a parent that fails; batches; the cancel of
a whole workflow. Workers of both runtimes, and the statements across connections.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, select, text
from sqlalchemy.ext.asyncio import async_sessionmaker
from sqlalchemy.orm import Session

from sqla_queue import (
    AsyncQueueSession,
    EnqueueError,
    Tasks,
    Workflow,
    cancel,
    enqueue_workflow,
    parent_counts,
    parent_results,
    queue_table,
)
from sqla_queue import sql as q
from sqla_queue.enqueue.workflow import WAITING_RUN_AFTER
from sqla_queue.sql import CASCADE_REASON

from .helpers import SENTINEL_CHANNEL, Server, notifications_until_sentinel, table_of, wait_for, wait_for_counts
from .models import Effect, StepJob, StepTask, Task
from .test_ops import on_driver
from .workers import async_engine_like
from .workflow_app import tasks as app_tasks

STEPS = table_of(StepTask)
EFFECTS = table_of(Effect)

tasks = Tasks()


@tasks.task
def named(job: Any) -> str:
    return str(job.payload["name"])


@tasks.task
def gather(job: Any) -> dict[str, Any]:
    with Session(_ENGINES[0]) as session:
        seen = parent_results(session, StepTask, job.id)
        done = parent_counts(session, StepTask, job.id)["done"]
    return {"seen": sorted(seen.values()), "done": done}


@tasks.task
def counts(job: Any) -> dict[str, int]:
    with Session(_ENGINES[0]) as session:
        return parent_counts(session, StepTask, job.id)


@tasks.task
def in_transaction(job: Any, session: Session) -> str:
    """Transactional: its completion runs in its session's transaction."""
    return str(job.payload["name"])


@tasks.task
def fails(job: Any) -> None:
    raise ValueError("this parent fails")


@tasks.task
def doomed_commit(job: Any, session: Session) -> str:
    """Transactional: its writes break a deferred constraint, so its transaction (and the
    completion in it, which ran) rolls back at COMMIT, after the handler returned."""
    session.execute(text("INSERT INTO wf_guard (parent) VALUES (-1)"))
    return "returned"


#: The engine the handlers above read with (set by the fixture below).
_ENGINES: list[Engine] = []


@pytest.fixture(autouse=True)
def _handlers_engine(engine: Engine) -> Any:
    _ENGINES[:] = [engine]
    yield
    _ENGINES.clear()


def job(task: str, **payload: Any) -> StepTask:
    return StepTask(task=task, payload=payload, max_attempts=payload.pop("attempts", 3))


def rows(engine: Engine, flow: Workflow) -> dict[int, Any]:
    with engine.connect() as conn:
        found = conn.execute(select(STEPS).where(STEPS.c.workflow_id == flow.id)).all()
    return {r.id: r for r in found}


def effects(engine: Engine) -> list[tuple[int, str]]:
    with engine.connect() as conn:
        return [(r.job_id, r.note) for r in conn.execute(select(EFFECTS).order_by(EFFECTS.c.id))]


def enqueued(engine: Engine, flow: Workflow) -> Workflow:
    with Session(engine, expire_on_commit=False) as session:
        enqueue_workflow(session, flow)
        session.commit()
    return flow


# -- the worker runs a graph in order ---------------------------------------------------------


def test_a_diamond_and_a_fan_run_each_job_once_after_its_parents_committed(
    engine: Engine, start_worker: Callable[..., Any]
) -> None:
    """Every job of the graph writes one effect row in its own transaction, after checking
    that each of its parents ended done and that their effect rows are there."""
    flow = Workflow()
    root = flow.add(job("step"))
    fan = [flow.add(job("step"), after=[root]) for _ in range(6)]
    left = flow.add(job("step"), after=fan[:3])
    right = flow.add(job("step"), after=fan[3:])
    flow.add(job("step"), after=[left, right, root])
    enqueued(engine, flow)
    start_worker(app_tasks, StepTask, concurrency=4)
    wait_for(lambda: all(r.status == "done" for r in rows(engine, flow).values()), timeout=60, what="all done")
    found = effects(engine)
    assert sorted(job_id for job_id, _ in found) == sorted(j.id for j in flow.jobs)
    assert {note for _, note in found} == {"ok"}


def test_a_child_reads_its_parents_results(engine: Engine, start_worker: Callable[..., Any]) -> None:
    flow = Workflow()
    parents = [flow.add(job("named", name=name)) for name in ("b", "a", "c")]
    child = flow.add(job("gather"), after=parents)
    enqueued(engine, flow)
    start_worker(tasks, StepTask)
    wait_for(lambda: rows(engine, flow)[child.id].status == "done", timeout=30, what="the child done")
    assert rows(engine, flow)[child.id].result == {"seen": ["a", "b", "c"], "done": 3}


def test_the_enqueue_wakes_the_queues_of_the_jobs_that_can_run_only(
    engine: Engine, listener: Any, server: Server
) -> None:
    """A job that waits for its parents is never due: waking its queue at the commit
    would only send its workers to claim nothing (its release wakes it)."""
    channel = queue_table(StepTask).channel
    for name in (channel, SENTINEL_CHANNEL):
        listener.execute(f'LISTEN "{name}"')
    flow = Workflow()
    first = flow.add(StepTask(task="named", payload={}), queue="first")
    flow.add(StepTask(task="named", payload={}), after=[first], queue="later")
    flow.add(StepTask(task="named", payload={}), queue="alone")
    enqueued(engine, flow)
    assert sorted(notifications_until_sentinel(listener, server.conninfo)) == [(channel, "alone"), (channel, "first")]


def test_waiting_jobs_are_pending_never_due_and_load_as_python_values(engine: Engine) -> None:
    flow = Workflow()
    parent = flow.add(job("named", name="p"))
    child = flow.add(job("named", name="c"), after=[parent])
    enqueued(engine, flow)
    found = rows(engine, flow)
    assert found[child.id].status == "pending" and found[child.id].waiting_on == 1
    assert found[child.id].run_after == WAITING_RUN_AFTER
    assert found[child.id].parent_ids == [parent.id] and found[parent.id].child_ids == [child.id]
    with engine.begin() as conn:  # a claim takes the parent only
        claimed = conn.execute(q.claim(StepTask, owner="w", limit=10, lease=30)).all()
    assert [r.id for r in claimed] == [parent.id]
    with Session(engine) as session:  # the ORM loads a waiting job like any other
        assert session.get(StepTask, child.id).run_after == WAITING_RUN_AFTER  # type: ignore[union-attr]


# -- what a failed parent does to its children -----------------------------------------------


def test_cancel_policy_cancels_everything_below_a_dead_letter_and_nothing_else(
    engine: Engine, start_worker: Callable[..., Any]
) -> None:
    flow = Workflow(on_parent_failure="cancel")
    bad = flow.add(job("fails", attempts=1))
    good = flow.add(job("named", name="good"))
    child = flow.add(job("named", name="child"), after=[bad, good])
    grandchild = flow.add(job("named", name="grandchild"), after=[child])
    aside = flow.add(job("named", name="aside"), after=[good])
    enqueued(engine, flow)
    start_worker(tasks, StepTask)

    def settled() -> bool:
        found = rows(engine, flow)
        return bool(found[grandchild.id].status == "cancelled" and found[aside.id].status == "done")

    wait_for(settled, timeout=30, what="the cascade and the other branch")
    found = rows(engine, flow)
    assert found[bad.id].status == "failed"
    assert found[child.id].status == "cancelled" and found[child.id].last_error == CASCADE_REASON
    assert found[child.id].attempts == 0 and found[grandchild.id].attempts == 0


def test_run_policy_runs_the_child_once_every_parent_ended_and_a_batch_callback_counts_them(
    engine: Engine, start_worker: Callable[..., Any]
) -> None:
    members = [job("named", name=str(n)) for n in range(5)] + [job("fails", attempts=1)]
    flow = Workflow.batch(members, callback=job("counts"))
    callback = flow.jobs[-1]
    enqueued(engine, flow)
    with Session(engine) as session:  # one cancelled before it ran
        cancel(session, StepTask, ids=[members[0].id])
        session.commit()
    start_worker(tasks, StepTask, concurrency=3)
    wait_for(lambda: rows(engine, flow)[callback.id].status == "done", timeout=30, what="the callback done")
    found = rows(engine, flow)
    assert found[callback.id].result == {"done": 4, "failed": 1, "cancelled": 1, "pending": 0, "running": 0}
    assert found[callback.id].attempts == 1  # released once, run once


def test_hold_policy_keeps_the_child_until_the_requeued_parent_ends_done(engine: Engine) -> None:
    flow = Workflow(on_parent_failure="hold")
    parent = flow.add(job("named", name="p"))
    child = flow.add(job("named", name="c"), after=[parent])
    enqueued(engine, flow)
    _end(engine, parent.id, "fail")
    found = rows(engine, flow)
    assert found[parent.id].status == "failed" and found[parent.id].child_ids == [child.id]
    assert found[child.id].status == "pending" and found[child.id].run_after == WAITING_RUN_AFTER
    with engine.begin() as conn:
        conn.execute(q.requeue_failed(StepTask, ids=[parent.id]))
    _end(engine, parent.id, "complete")
    found = rows(engine, flow)
    assert found[child.id].waiting_on == 0 and found[child.id].run_after < WAITING_RUN_AFTER
    assert found[parent.id].child_ids is None


def _end(engine: Engine, job_id: int, how: str) -> None:
    """Claim job ``job_id`` and end its attempt (``complete`` or ``fail``)."""
    with engine.begin() as conn:
        (claimed,) = conn.execute(q.claim(StepTask, owner="w", limit=1, lease=30)).all()
        assert claimed.id == job_id
        token = (claimed.id, claimed.attempts)
        if how == "complete":
            assert conn.execute(q.complete_if_owner(StepTask, owner="w", tokens=[token])).all()
        else:
            assert conn.execute(q.fail_if_owner(StepTask, owner="w", token=token, error="no")).all()


# -- exactly once, and only with the parent's commit ------------------------------------------


def test_two_parents_ending_together_neither_waits_and_the_child_is_released_once(engine: Engine) -> None:
    """Two completions in two transactions at once: the second does not wait for the
    child's row the first holds (a lock wait fails the statement here); it ends its
    parent, which keeps the child in ``child_ids``, and says so in its last column. The
    settle, after the first's commit, counts it: the child is released once, and a
    second settle finds nothing."""
    flow = Workflow()
    parents = [flow.add(job("named", name=str(n))) for n in range(2)]
    child = flow.add(job("named", name="c"), after=parents)
    enqueued(engine, flow)
    with engine.begin() as conn:
        claimed = conn.execute(q.claim(StepTask, owner="w", limit=2, lease=30)).all()
    tokens = {r.id: (r.id, r.attempts) for r in claimed}
    with engine.connect() as first, engine.connect() as second:
        first.begin()
        (counted,) = first.execute(q.complete_if_owner(StepTask, owner="w", tokens=[tokens[parents[0].id]])).all()
        assert tuple(counted) == (*tokens[parents[0].id], None)  # it took the child: nothing kept
        second.begin()
        second.execute(text("SET LOCAL lock_timeout = '2s'"))
        (kept,) = second.execute(q.complete_if_owner(StepTask, owner="w", tokens=[tokens[parents[1].id]])).all()
        assert tuple(kept) == (*tokens[parents[1].id], [child.id])
        second.commit()
        owed = rows(engine, flow)
        assert (owed[parents[1].id].status, owed[parents[1].id].child_ids) == ("done", [child.id])
        assert owed[child.id].waiting_on == 2  # the first has not committed
        first.commit()
    found = rows(engine, flow)
    assert (found[child.id].waiting_on, found[child.id].run_after) == (1, WAITING_RUN_AFTER)
    assert found[parents[0].id].child_ids is None
    with engine.begin() as conn:
        assert [r[0] for r in conn.execute(q.settle_edges(StepTask))] == [parents[1].id]
    found = rows(engine, flow)
    assert (found[child.id].waiting_on, found[child.id].status) == (0, "pending")
    assert found[child.id].run_after < WAITING_RUN_AFTER and found[parents[1].id].child_ids is None
    with engine.begin() as conn:
        assert conn.execute(q.settle_edges(StepTask)).all() == []
    assert rows(engine, flow)[child.id].run_after == found[child.id].run_after


def test_a_settle_is_refused_a_limit_below_one_and_a_table_without_workflows() -> None:
    with pytest.raises(ValueError, match="limit must be at least 1"):
        q.settle_edges(StepTask, limit=0)
    with pytest.raises(TypeError, match="keeps no workflows"):
        q.settle_edges(Task)


def _parents_ended_owing(engine: Engine, n: int) -> tuple[Workflow, list[StepTask], StepTask]:
    """A fan-in of ``n`` parents ended by one statement run by hand while a transaction
    held the child: every parent ended owing it (``child_ids`` kept, nothing counted)."""
    flow = Workflow()
    parents = [flow.add(job("named", name=str(i))) for i in range(n)]
    child = flow.add(job("named", name="c"), after=parents)
    enqueued(engine, flow)
    with engine.begin() as conn:
        claimed = conn.execute(q.claim(StepTask, owner="gone", limit=n, lease=30)).all()
    with engine.connect() as holder:
        holder.begin()
        holder.execute(select(STEPS.c.id).where(STEPS.c.id == child.id).with_for_update())
        with engine.begin() as conn:
            tokens = [(r.id, r.attempts) for r in claimed]
            done = conn.execute(q.complete_if_owner(StepTask, owner="gone", tokens=tokens))
            assert [r[-1] for r in done] == [[child.id]] * n
        holder.rollback()
    found = rows(engine, flow)
    assert found[child.id].waiting_on == n and all(found[p.id].child_ids == [child.id] for p in parents)
    return flow, parents, child


def test_settles_take_their_parents_in_batches_and_count_each_once(engine: Engine) -> None:
    """Parents that ended owing a child, settled by several statements of a small
    ``limit``: each takes parents no other took, and the child is released by the last."""
    flow, parents, child = _parents_ended_owing(engine, 5)
    settled: list[int] = []
    for _ in range(3):
        with engine.begin() as conn:
            settled += [r[0] for r in conn.execute(q.settle_edges(StepTask, limit=2))]
    assert sorted(settled) == sorted(p.id for p in parents)
    found = rows(engine, flow)[child.id]
    assert (found.waiting_on, found.status) == (0, "pending") and found.run_after < WAITING_RUN_AFTER


@pytest.mark.parametrize("transactional", [False, True], ids=["plain", "transactional"])
def test_a_fan_in_s_completions_never_wait_for_the_child(
    engine: Engine, start_worker: Callable[..., Any], transactional: bool
) -> None:
    """A transaction holds the child of a fan-in: the worker ends all its parents
    meanwhile (none waits for the row; their handlers plain, or transactional), and once
    the holder lets go the child runs, settled at once by the worker that completed the
    parents (its sweeper's own interval is a minute)."""
    flow = Workflow()
    task = "in_transaction" if transactional else "named"
    parents = [flow.add(job(task, name=str(n))) for n in range(12)]
    child = flow.add(job("named", name="c"), after=parents)
    enqueued(engine, flow)
    with engine.connect() as holder:
        holder.begin()
        holder.execute(select(STEPS.c.id).where(STEPS.c.id == child.id).with_for_update())
        start_worker(tasks, StepTask, concurrency=4, sweep_interval=60.0)
        wait_for(lambda: all(rows(engine, flow)[p.id].status == "done" for p in parents), timeout=20,
                 what="every parent done while the child's row is held")
        assert rows(engine, flow)[child.id].run_after == WAITING_RUN_AFTER
        holder.rollback()
    wait_for(lambda: rows(engine, flow)[child.id].status == "done", timeout=20, what="the child done")
    assert all(r.child_ids is None for r in rows(engine, flow).values())


def test_a_sweeper_tick_settles_what_a_worker_left(engine: Engine, start_worker: Callable[..., Any]) -> None:
    """Children a parent kept, found by any worker's sweeper on its tick (the worker that
    ended the parent died before it could settle them: here, a statement run by hand)."""
    flow, _, child = _parents_ended_owing(engine, 3)
    assert rows(engine, flow)[child.id].run_after == WAITING_RUN_AFTER
    start_worker(tasks, StepTask, sweep_interval=0.3)
    wait_for(lambda: rows(engine, flow)[child.id].status == "done", timeout=20, what="the child done")


def test_a_completion_that_rolls_back_releases_nothing(engine: Engine) -> None:
    flow = Workflow()
    parent = flow.add(job("named", name="p"))
    child = flow.add(job("named", name="c"), after=[parent])
    enqueued(engine, flow)
    with engine.begin() as conn:
        (claimed,) = conn.execute(q.claim(StepTask, owner="w", limit=1, lease=30)).all()
    with engine.connect() as conn:
        conn.begin()
        assert conn.execute(q.complete_if_owner(StepTask, owner="w", tokens=[(claimed.id, claimed.attempts)])).all()
        inside = conn.execute(select(STEPS.c.waiting_on).where(STEPS.c.id == child.id)).scalar_one()
        conn.rollback()
    assert inside == 0  # the statement did release it, in the transaction that rolled back
    found = rows(engine, flow)
    assert (found[child.id].waiting_on, found[child.id].run_after) == (1, WAITING_RUN_AFTER)
    assert found[parent.id].child_ids == [child.id]


@pytest.fixture
def guard(engine: Engine) -> Any:
    """``wf_guard``: a row of it with ``parent = -1`` breaks a deferred foreign key at COMMIT."""
    with engine.begin() as conn:
        conn.execute(text(
            "CREATE TABLE wf_guard (id serial PRIMARY KEY, parent bigint REFERENCES step_tasks (id) "
            "DEFERRABLE INITIALLY DEFERRED)"
        ))
    yield
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE wf_guard"))


@pytest.mark.usefixtures("guard")
def test_a_parent_whose_transaction_rolls_back_after_its_handler_returned_never_releases_its_child(
    engine: Engine, start_worker: Callable[..., Any]
) -> None:
    flow = Workflow(on_parent_failure="hold")
    parent = flow.add(job("doomed_commit", attempts=2))
    child = flow.add(job("named", name="c"), after=[parent])
    enqueued(engine, flow)
    worker = start_worker(tasks, StepTask)
    wait_for(lambda: rows(engine, flow)[parent.id].status == "failed", timeout=30, what="the parent dead-lettered")
    assert worker.stats.done == 0
    found = rows(engine, flow)
    assert found[parent.id].attempts == 2 and "wf_guard" in (found[parent.id].last_error or "")
    assert (found[child.id].status, found[child.id].waiting_on, found[child.id].attempts) == ("pending", 1, 0)


def test_the_sweeper_s_dead_letter_applies_the_policy(engine: Engine) -> None:
    flow = Workflow()
    parent = flow.add(job("named", name="p", attempts=1))
    child = flow.add(job("named", name="c"), after=[parent])
    enqueued(engine, flow)
    with engine.begin() as conn:
        conn.execute(q.claim(StepTask, owner="gone", limit=1, lease=0.01))
    with engine.begin() as conn:
        conn.execute(text("SELECT pg_sleep(0.05)"))
        swept: list[Any] = list(conn.execute(q.sweep_expired(StepTask)))
    assert [(r[0], r[1]) for r in swept] == [(parent.id, "failed")]
    assert rows(engine, flow)[child.id].status == "cancelled"


# -- cancel a whole workflow ------------------------------------------------------------------


def test_cancel_a_whole_workflow_leaves_other_workflows_alone(engine: Engine) -> None:
    flows = [Workflow(), Workflow()]
    for flow in flows:
        parent = flow.add(job("named", name="p"))
        flow.add(job("named", name="c"), after=[parent])
        enqueued(engine, flow)
    with engine.begin() as conn:  # one job of the first workflow is running
        conn.execute(q.claim(StepTask, owner="w", limit=1, lease=30))
    with Session(engine) as session:
        cancelled = cancel(session, StepTask, workflow=flows[0].id)
        session.commit()
    assert sorted(cancelled) == sorted(j.id for j in flows[0].jobs)
    assert {r.status for r in rows(engine, flows[0]).values()} == {"cancelled"}
    assert {r.status for r in rows(engine, flows[1]).values()} == {"pending"}
    with Session(engine) as session, pytest.raises(TypeError, match="uuid"):
        cancel(session, StepTask, workflow="not-an-id")  # type: ignore[call-overload]


def test_workflow_jobs_lists_a_workflow_in_key_order(engine: Engine) -> None:
    flow = Workflow()
    parent = flow.add(job("named", name="p"))
    child = flow.add(job("named", name="c"), after=[parent])
    enqueued(engine, flow)
    with engine.connect() as conn:
        listed = conn.execute(q.workflow_jobs(StepTask, flow.id)).all()
    assert [(r.id, r.status, r.waiting_on, r.parent_ids) for r in listed] == [
        (parent.id, "pending", 0, None), (child.id, "pending", 1, [parent.id])
    ]


# -- the enqueue ------------------------------------------------------------------------------


def test_an_async_session_enqueues_a_workflow_in_its_transaction(engine: Engine) -> None:
    import asyncio

    async def run() -> list[int]:
        async_engine = async_engine_like(engine)
        try:
            make = async_sessionmaker(async_engine, class_=AsyncQueueSession, expire_on_commit=False)
            async with make() as session:
                flow = Workflow()
                parent = flow.add(job("named", name="p"))
                flow.add(job("named", name="c"), after=[parent])
                await session.enqueue_workflow(flow)
                await session.rollback()  # the graph goes with the transaction
                again = Workflow()
                parent = again.add(job("named", name="p"))
                again.add(job("named", name="c"), after=[parent])
                await enqueue_workflow(session, again)
                await session.commit()
                return [j.id for j in again.jobs]
        finally:
            await async_engine.dispose()

    ids = asyncio.run(run())
    with engine.connect() as conn:
        found = conn.execute(select(STEPS.c.id, STEPS.c.waiting_on).order_by(STEPS.c.id)).all()
    assert [tuple(r) for r in found] == [(ids[0], 0), (ids[1], 1)]


def test_a_bad_job_leaves_the_session_as_it_was(engine: Engine) -> None:
    flow = Workflow()
    parent = flow.add(job("named", name="p"))
    flow.add(StepTask(task="named", payload={"at": object()}), after=[parent])
    with Session(engine) as session:
        with pytest.raises(EnqueueError):
            enqueue_workflow(session, flow)
        assert not session.new and not flow.enqueued
    with engine.connect() as conn:
        assert conn.scalar(select(STEPS.c.id)) is None


def test_a_table_without_results_still_releases(engine: Engine) -> None:
    flow = Workflow()
    parent = flow.add(StepJob())
    child = flow.add(StepJob(), after=[parent])
    with Session(engine, expire_on_commit=False) as session:
        enqueue_workflow(session, flow)
        session.commit()
    with engine.begin() as conn:
        (claimed,) = conn.execute(q.claim(StepJob, owner="w", limit=5, lease=30)).all()
        conn.execute(q.complete_if_owner(StepJob, owner="w", tokens=[(claimed.id, claimed.attempts)]))
        steps = table_of(StepJob)
        waiting = conn.execute(select(steps.c.waiting_on).where(steps.c.id == child.id)).scalar_one()
    assert waiting == 0


# -- the worker's operations: jobs without children finish without the release -------------


@pytest.mark.parametrize("driver", ["thread", "asyncio"])
@pytest.mark.parametrize("how", ["complete", "complete_then_claim", "fail"])
def test_operations_release_children_of_a_batch_mixing_parents_and_leaves(
    engine: Engine, driver: str, how: str
) -> None:
    """A batch of a parent and a job without children is finished by the statement that
    releases (or cancels under the policy); a batch of leaves alone by its twin without the
    release. Both end their jobs."""
    flow = Workflow()
    parent = flow.add(job("named", name="p"))
    leaf = flow.add(job("named", name="leaf"))
    child = flow.add(job("named", name="c"), after=[parent])
    lone = flow.add(job("named", name="lone"))
    enqueued(engine, flow)
    with on_driver(driver, engine) as on:
        ops = on.ops(StepTask)
        first = on(lambda conn: ops.fetch_claimed(conn, ops.claim_request("w", 2)))
        assert sorted(c.token.job_id for c in first) == [parent.id, leaf.id]  # RETURNING has no order
        tokens = [c.token for c in first]
        if how == "complete":
            on(lambda conn: ops.complete(conn, "w", tokens))
        elif how == "fail":
            on(lambda conn: ops.fail(conn, "w", tokens, ["no", "no"]))
        else:
            on(lambda conn: ops.complete_then_claim(conn, tokens, ops.claim_request("w", 5)))
        ended = "failed" if how == "fail" else "done"
        found = rows(engine, flow)
        assert (found[parent.id].status, found[leaf.id].status) == (ended, ended)
        if how == "fail":
            assert found[child.id].status == "cancelled"
        else:
            assert found[child.id].waiting_on == 0 and found[child.id].run_after < WAITING_RUN_AFTER
        if how != "complete_then_claim":  # the lone job: a leaf alone, by the twin
            (claimed,) = on(lambda conn: ops.fetch_claimed(conn, ops.claim_request("w", 1, key=lone.id)))
            on(lambda conn: ops.complete(conn, "w", [claimed.token]))
            assert rows(engine, flow)[lone.id].status == "done"


# -- retention never strands a waiting child --------------------------------------------------


def test_a_job_whose_children_still_wait_is_never_deleted_pruned_or_archived(engine: Engine) -> None:
    """A pending parent, and a failed one held by the "hold" policy, keep their children
    waiting: deleting them would strand the children, so delete, prune and archive pass
    over them; once the workflow is cancelled they go like any job."""
    flow = Workflow(on_parent_failure="hold")
    held = flow.add(job("named", name="held"))
    pending = flow.add(job("named", name="pending"))
    child = flow.add(job("named", name="c"), after=[held, pending])
    enqueued(engine, flow)
    _end(engine, held.id, "fail")
    with engine.begin() as conn:
        deleted = conn.execute(q.delete_jobs(StepTask, ids=[held.id, pending.id])).all()
        pruned = conn.execute(q.prune_finished(StepTask, older_than=0, statuses=["failed"])).rowcount
    assert deleted == [] and pruned == 0
    assert set(rows(engine, flow)) == {held.id, pending.id, child.id}
    with Session(engine) as session:
        cancel(session, StepTask, workflow=flow.id)
        session.commit()
    with engine.begin() as conn:
        deleted = conn.execute(q.delete_jobs(StepTask, ids=[pending.id])).all()
        pruned = conn.execute(q.prune_finished(StepTask, older_than=0, statuses=["failed"])).rowcount
    assert [r[0] for r in deleted] == [pending.id] and pruned == 1


# -- hostile parents: the release follows the parent's committed end, whatever its shape -----


@tasks.task
def shaped(job: Any, session: Session) -> str:
    """Transactional, of the shape ``payload["shape"]``: a SAVEPOINT of its own, or a first
    attempt that raises SystemExit or ConnectionError; every done attempt writes an effect."""
    shape = job.payload["shape"]
    if shape == "savepoint":
        with session.begin_nested():
            session.add(Effect(job_id=job.id, worker="parent", note="in a savepoint"))
        return "ok"
    if job.attempts == 1:
        if shape == "exit":
            raise SystemExit(3)
        raise ConnectionError("the peer went away")
    session.add(Effect(job_id=job.id, worker="parent", note=shape))
    return "ok"


@pytest.mark.parametrize("shape", ["savepoint", "exit", "connection"])
def test_a_hostile_parent_releases_its_child_once_with_its_committed_end(
    engine: Engine, start_worker: Callable[..., Any], shape: str
) -> None:
    flow = Workflow()
    parent = flow.add(job("shaped", shape=shape))
    child = flow.add(job("named", name="c"), after=[parent])
    enqueued(engine, flow)
    worker = start_worker(tasks, StepTask)
    wait_for(lambda: rows(engine, flow)[child.id].status == "done", timeout=30, what="the child done")
    found = rows(engine, flow)
    assert found[parent.id].status == "done"
    assert found[parent.id].attempts == (1 if shape == "savepoint" else 2)
    assert found[child.id].attempts == 1 and found[child.id].started_at >= found[parent.id].finished_at
    assert [job_id for job_id, _ in effects(engine)] == [parent.id]  # the failed attempt wrote nothing
    wait_for_counts(worker, done=2)  # counted once each COMMIT returned, a moment after the rows show it


@tasks.task
def edits_its_row(job: Any, session: Session) -> str:
    """Transactional: updates its own row (as a handler recording something on it may),
    in the transaction its completion then runs in."""
    session.execute(STEPS.update().where(STEPS.c.id == job.id).values(priority=7))
    session.add(Effect(job_id=job.id, worker="parent", note="edited"))
    return "ok"


def test_a_parent_that_updates_its_own_row_releases_its_child_once(
    engine: Engine, start_worker: Callable[..., Any]
) -> None:
    flow = Workflow()
    parents = [flow.add(job("edits_its_row")) for _ in range(2)]
    child = flow.add(job("named", name="c"), after=parents)
    enqueued(engine, flow)
    worker = start_worker(tasks, StepTask, concurrency=2)
    wait_for(lambda: rows(engine, flow)[child.id].status == "done", timeout=30, what="the child done")
    found = rows(engine, flow)
    assert all((found[p.id].status, found[p.id].priority, found[p.id].child_ids) == ("done", 7, None) for p in parents)
    assert found[child.id].attempts == 1 and found[child.id].waiting_on == 0
    assert sorted(job_id for job_id, _ in effects(engine)) == sorted(p.id for p in parents)
    wait_for_counts(worker, done=3)


def test_a_parent_whose_row_cannot_be_loaded_ends_failed_and_cancels_its_child(
    engine: Engine, start_worker: Callable[..., Any]
) -> None:
    """The worker dead-letters a row it cannot load as the model; the workflow's policy
    (``cancel``) cancels the child in that statement, and the other parent's completion
    does not release it."""
    flow = Workflow()
    bad = flow.add(job("named", name="bad"))
    good = flow.add(job("named", name="good"))
    child = flow.add(job("named", name="c"), after=[bad, good])
    enqueued(engine, flow)
    with engine.begin() as conn:  # Python refuses to parse an integer of more than 4,300 digits
        conn.execute(text("UPDATE step_tasks SET payload = ('{\"n\": ' || repeat('7', 5000) || '}')::jsonb "
                          "WHERE id = :i"), {"i": bad.id})
    start_worker(tasks, StepTask, concurrency=2)

    def states() -> dict[int, tuple[str, int, str | None]]:  # not the payload: it cannot be loaded
        with engine.connect() as conn:
            found = conn.execute(select(STEPS.c.id, STEPS.c.status, STEPS.c.attempts, STEPS.c.last_error)
                                 .where(STEPS.c.workflow_id == flow.id))
            return {r.id: (r.status, r.attempts, r.last_error) for r in found}

    wait_for(lambda: (states()[child.id][0], states()[good.id][0]) == ("cancelled", "done"),
             timeout=30, what="the child cancelled, the good parent done")
    found = states()
    assert found[bad.id][0] == "failed" and "cannot load" in (found[bad.id][2] or "")
    assert found[child.id] == ("cancelled", 0, CASCADE_REASON)
