"""The operations layer's conformance suite: every method of :class:`QueueOps` against real
PostgreSQL, on both drivers (psycopg on threads, psycopg's asyncio connections in the
runtime's greenlets), through the path the worker uses (statements compiled once by the
driver, run on its cursor), with one and several values of every list option: queues,
tokens, keys passed over, tokens kept."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest
from sqlalchemy import Engine, MetaData, func, insert, select, text, update
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import DeclarativeBase

from sqla_queue import TaskMixin
from sqla_queue import sql as q
from sqla_queue.driver import AsyncDriver, DbConnection, Driver, WorkerStartError
from sqla_queue.model import DEFAULT_MAX_ATTEMPTS
from sqla_queue.ops import Claimed, ClaimRequest, QueueOps, SweepResult, TokenState
from sqla_queue.ops import queue as ops_queue
from sqla_queue.runtime import run_in_greenlet
from sqla_queue.sql import ClaimToken

from .models import Task
from .workers import TASKS, EventLoopThread

T = TypeVar("T")

class _OtherBase(DeclarativeBase):
    metadata = MetaData()


class NeverCreated(_OtherBase, TaskMixin):
    """A queue model whose table nobody created."""

    __tablename__ = "sqla_queue_test_ops_never_created"


#: Queue options as workers set them: all queues, one, several.
QUEUES = [None, ("a",), ("a", "b")]


class On:
    """One driver: ``ops(...)`` makes its operations object, ``on(fn)`` runs ``fn(conn)``
    on a fresh connection of it (in a greenlet on the event loop for the async driver)."""

    def __init__(self, driver: Driver, run: Callable[[Callable[[DbConnection], Any]], Any]) -> None:
        self.driver = driver
        self._run = run

    def ops(self, model: Any = Task, **options: Any) -> QueueOps:
        options.setdefault("lease", 60.0)
        options.setdefault("statement_deadline", 30.0)
        return QueueOps(self.driver, model, **options)

    def __call__(self, fn: Callable[[DbConnection], T]) -> T:
        result: T = self._run(fn)
        return result


@contextmanager
def on_driver(kind: str, engine: Engine) -> Iterator[On]:
    """The driver ``kind`` ("thread" or "asyncio") on ``engine``'s database."""
    if kind == "thread":
        driver = Driver(engine)

        def run(fn: Callable[[DbConnection], Any]) -> Any:
            conn = driver.connect("sqla_queue test ops")
            try:
                return fn(conn)
            finally:
                conn.close()

        yield On(driver, run)
        return
    loop = EventLoopThread()
    async_engine = create_async_engine(engine.url)
    async_driver = AsyncDriver(async_engine)

    def in_greenlet(fn: Callable[[DbConnection], Any]) -> Any:
        conn = async_driver.connect("sqla_queue test ops")
        try:
            return fn(conn)
        finally:
            conn.close()

    try:
        yield On(async_driver, lambda fn: loop.run(run_in_greenlet(in_greenlet, fn)))
    finally:
        loop.run(async_engine.dispose())
        loop.close()


@pytest.fixture(params=["thread", "asyncio"])
def on(request: pytest.FixtureRequest, engine: Engine) -> Iterator[On]:
    with on_driver(request.param, engine) as found:
        yield found


# -- the table, read and written apart from the layer under test -------------------------------


def add(engine: Engine, n: int, *, queue: str = "a", **values: Any) -> list[int]:
    with engine.begin() as conn:
        stmt = insert(TASKS).values(queue=queue, **values).returning(TASKS.c.id, sort_by_parameter_order=True)
        return list(conn.scalars(stmt, [{"task": "t", "payload": {"n": i}} for i in range(n)]))


def rows(engine: Engine, ids: list[int] | None = None) -> dict[int, Any]:
    with engine.connect() as conn:
        stmt = select(TASKS)
        if ids is not None:
            stmt = stmt.where(TASKS.c.id.in_(ids))
        return {row.id: row for row in conn.execute(stmt)}


def claim_directly(engine: Engine, owner: str, limit: int = 100, **kw: Any) -> list[ClaimToken]:
    with engine.begin() as conn:
        claimed = conn.execute(q.claim(Task, owner=owner, limit=limit, lease=60, **kw))
        return sorted(ClaimToken(r.id, r.attempts) for r in claimed)


def tokens_of(claimed: list[Claimed]) -> list[ClaimToken]:
    return sorted(c.token for c in claimed)


# -- claims ---------------------------------------------------------------------------


@pytest.mark.parametrize("queues", QUEUES)
def test_a_claim_takes_runnable_jobs_of_the_queues_served_as_model_instances(
    engine: Engine, on: On, queues: tuple[str, ...] | None
) -> None:
    served = {"a": add(engine, 3, queue="a"), "b": add(engine, 3, queue="b"), "c": add(engine, 3, queue="c")}
    add(engine, 2, queue="a", run_after=func.now() + text("interval '1 hour'"))  # not due
    ops = on.ops(queues=queues)
    claimed = on(lambda conn: ops.fetch_claimed(conn, ops.claim_request("w/0.0", 100)))
    wanted = sorted(i for name, ids in served.items() if queues is None or name in queues for i in ids)
    assert tokens_of(claimed) == [(i, 1) for i in wanted]
    assert all(isinstance(c.job, Task) and c.problem is None and not c.solitary for c in claimed)
    assert {c.token.job_id: c.job.payload for c in claimed} == {r.id: r.payload for r in rows(engine, wanted).values()}
    assert {(r.status, r.lease_owner) for r in rows(engine, wanted).values()} == {("running", "w/0.0")}


@pytest.mark.parametrize("queues", QUEUES)
def test_a_claim_takes_at_most_its_limit_in_priority_order(
    engine: Engine, on: On, queues: tuple[str, ...] | None
) -> None:
    low = add(engine, 2, queue="a")
    high = add(engine, 2, queue="b" if queues and len(queues) > 1 else "a", priority=5)
    ops = on.ops(queues=queues)
    first = on(lambda conn: ops.fetch_claimed(conn, ops.claim_request("w", 2)))
    assert tokens_of(first) == [(i, 1) for i in high]
    request = ops.claim_request("w", 1)
    assert request.limit == 1 and not request.isolated
    second = on(lambda conn: ops.fetch_claimed(conn, request))
    assert tokens_of(second) == [(low[0], 1)]


@pytest.mark.parametrize("queues", QUEUES)
def test_an_isolated_claim_takes_one_isolated_job_and_an_ordinary_claim_none(
    engine: Engine, on: On, queues: tuple[str, ...] | None
) -> None:
    lone = add(engine, 2, queue="a", isolated=True)
    solitary = add(engine, 1, queue="a", isolated=True, priority=9,
                   last_error=f"{q.SOLITARY_REASON}: worker x did not finish attempt 1 of 5")
    ordinary = add(engine, 2, queue="a")
    ops = on.ops(queues=queues)
    plain = on(lambda conn: ops.fetch_claimed(conn, ops.claim_request("w", 10)))
    assert tokens_of(plain) == [(i, 1) for i in ordinary]
    request = ops.claim_request("w", 10, isolated=True)
    assert request.isolated and request.limit == 1
    (first,) = on(lambda conn: ops.fetch_claimed(conn, request))
    assert first.token == (solitary[0], 1) and first.solitary
    (second,) = on(lambda conn: ops.fetch_claimed(conn, request))
    assert second.token == (lone[0], 1) and not second.solitary


@pytest.mark.parametrize("queues", QUEUES)
@pytest.mark.parametrize("skipped", [1, 3])
def test_a_claim_passes_over_the_keys_it_is_told_to_skip(
    engine: Engine, on: On, queues: tuple[str, ...] | None, skipped: int
) -> None:
    ids = add(engine, 5, queue="a")
    skip = ids[:skipped]
    ops = on.ops(queues=queues)
    claimed = on(lambda conn: ops.fetch_claimed(conn, ops.claim_request("w", 10, skip=skip)))
    assert tokens_of(claimed) == [(i, 1) for i in ids[skipped:]]
    assert {r.status for r in rows(engine, skip).values()} == {"pending"}


@pytest.mark.parametrize("skipped", [1, 3])
def test_an_isolated_claim_passes_over_skipped_keys_too(engine: Engine, on: On, skipped: int) -> None:
    ids = add(engine, 4, queue="a", isolated=True)
    ops = on.ops(queues=("a", "b"))
    (claimed,) = on(lambda conn: ops.fetch_claimed(conn, ops.claim_request("w", 1, isolated=True, skip=ids[:skipped])))
    assert claimed.token == (ids[skipped], 1)


@pytest.mark.parametrize("queues", QUEUES)
@pytest.mark.parametrize("isolated", [False, True])
def test_a_claim_by_key_takes_that_job_only_if_it_is_claimable(
    engine: Engine, on: On, queues: tuple[str, ...] | None, isolated: bool
) -> None:
    ids = add(engine, 3, queue="a", isolated=isolated)
    other = add(engine, 1, queue="a", isolated=not isolated)
    ops = on.ops(queues=queues)
    request = ops.claim_request("w", 10, isolated=isolated, key=ids[1])
    assert request.key == ids[1] and request.limit == 1 and request.after_completion is None
    assert tokens_of(on(lambda conn: ops.fetch_claimed(conn, request))) == [(ids[1], 1)]
    assert on(lambda conn: ops.fetch_claimed(conn, request)) == []  # running now
    wrong_kind = ops.claim_request("w", 1, isolated=isolated, key=other[0])
    assert on(lambda conn: ops.fetch_claimed(conn, wrong_kind)) == []
    assert {i: r.status for i, r in rows(engine).items()} == {ids[0]: "pending", ids[1]: "running",
                                                              ids[2]: "pending", other[0]: "pending"}


def test_a_claimed_row_that_cannot_be_loaded_comes_back_with_its_problem(engine: Engine, on: On) -> None:
    good = add(engine, 2, queue="a")
    (bad,) = add(engine, 1, queue="a")
    with engine.begin() as conn:  # Python refuses to parse an integer of more than 4,300 digits
        conn.execute(text("UPDATE tasks SET payload = ('{\"n\": ' || repeat('7', 5000) || '}')::jsonb WHERE id = :i"),
                     {"i": bad})
    ops = on.ops()
    claimed = {c.token.job_id: c for c in on(lambda conn: ops.fetch_claimed(conn, ops.claim_request("w", 10)))}
    assert sorted(claimed) == sorted([*good, bad])
    problem = claimed[bad].problem
    assert claimed[bad].job is None and claimed[bad].token == (bad, 1)
    assert problem is not None and problem.what == "cannot load the row as the model"
    assert isinstance(problem.error, ValueError)
    assert all(claimed[i].problem is None and claimed[i].job.id == i for i in good)


def test_check_table_fails_fast_on_a_missing_table_and_passes_on_a_queue_table(engine: Engine, on: On) -> None:
    ops, missing = on.ops(), on.ops(NeverCreated)
    on(lambda conn: ops.check_table())  # in the driver's runtime (a greenlet for the async one)
    with pytest.raises(WorkerStartError, match="does not exist"):
        on(lambda conn: missing.check_table())


# -- candidates and rows no claim can update ------------------------------------------------------


@pytest.mark.parametrize("queues", QUEUES)
@pytest.mark.parametrize("skipped", [0, 1, 2])
def test_claim_candidates_lists_the_next_keys_in_claim_order_without_claiming(
    engine: Engine, on: On, queues: tuple[str, ...] | None, skipped: int
) -> None:
    ids = add(engine, 3, queue="a") + add(engine, 2, queue="c", priority=1)
    isolated = add(engine, 2, queue="a", isolated=True)
    ops = on.ops(queues=queues)
    in_order = [*ids[3:], *ids[:3]] if queues is None else ids[:3]
    keys = on(lambda conn: ops.claim_candidates(conn, isolated=False, limit=3, skip=in_order[:skipped]))
    assert keys == in_order[skipped:skipped + 3]
    assert on(lambda conn: ops.claim_candidates(conn, isolated=True, limit=5, skip=[])) == isolated
    assert {r.status for r in rows(engine).values()} == {"pending"}


def test_fail_unclaimable_dead_letters_a_pending_job_only(engine: Engine, on: On) -> None:
    pending, running = add(engine, 2, queue="a")
    claim_directly(engine, "w", limit=1)
    ops = on.ops()
    assert on(lambda conn: ops.fail_unclaimable(conn, pending, "the claim cannot update this row")) is False
    assert on(lambda conn: ops.fail_unclaimable(conn, running, "the claim cannot update this row")) is True
    found = rows(engine)
    assert (found[running].status, found[running].attempts, found[running].last_error) == (
        "failed", 0, "the claim cannot update this row")
    assert found[pending].status == "running"


# -- the completion and the next claim, together -----------------------------------------------------


@pytest.mark.parametrize("queues", QUEUES)
@pytest.mark.parametrize("held", [1, 3])
def test_complete_then_claim_records_the_tokens_and_claims_the_next_batch(
    engine: Engine, on: On, queues: tuple[str, ...] | None, held: int
) -> None:
    first = add(engine, held, queue="a")
    tokens = claim_directly(engine, "w/0.0")
    nxt = add(engine, 2, queue="a") + add(engine, 2, queue="b")
    ops = on.ops(queues=queues)
    request = ops.claim_request("w/0.0", 10)
    done, claimed = on(lambda conn: ops.complete_then_claim(conn, tokens, request))
    assert done == dict.fromkeys(tokens, "done")
    wanted = [i for i in nxt if queues is None or rows(engine, [i])[i].queue in queues]
    assert tokens_of(claimed) == [(i, 1) for i in wanted]
    assert all(isinstance(c.job, Task) for c in claimed)
    found = rows(engine)
    assert {found[i].status for i in first} == {"done"}
    assert {(found[i].status, found[i].lease_owner) for i in wanted} == {("running", "w/0.0")}


@pytest.mark.parametrize("skipped", [1, 2])
def test_complete_then_claim_passes_over_skipped_keys_and_claims_isolated_jobs(
    engine: Engine, on: On, skipped: int
) -> None:
    add(engine, 2, queue="a")
    tokens = claim_directly(engine, "w/0.0")
    ids = add(engine, 3, queue="a")
    lone = add(engine, 1, queue="b", isolated=True)
    ops = on.ops(queues=("a", "b"))
    done, claimed = on(lambda conn: ops.complete_then_claim(conn, tokens[:1], ops.claim_request(
        "w/0.0", 10, skip=ids[:skipped])))
    assert done == {tokens[0]: "done"} and tokens_of(claimed) == [(i, 1) for i in ids[skipped:]]
    done, claimed = on(lambda conn: ops.complete_then_claim(conn, tokens[1:], ops.claim_request(
        "w/0.0", 10, isolated=True)))
    assert done == {tokens[1]: "done"} and tokens_of(claimed) == [(lone[0], 1)]


def test_complete_then_claim_leaves_tokens_of_another_owner_alone(engine: Engine, on: On) -> None:
    add(engine, 2, queue="a")
    tokens = claim_directly(engine, "w/0.0")
    ops = on.ops()
    done, claimed = on(lambda conn: ops.complete_then_claim(conn, tokens, ops.claim_request("w/1.0", 10)))
    assert done == {} and claimed == []
    assert {r.status for r in rows(engine).values()} == {"running"}


# -- outcomes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("held", [1, 3])
def test_complete_fail_and_release_move_the_tokens_the_owner_holds(engine: Engine, on: On, held: int) -> None:
    add(engine, 4 * held, queue="a")
    tokens = claim_directly(engine, "w")
    done, failed, back, handed = (tokens[n * held:(n + 1) * held] for n in range(4))
    ops = on.ops()
    assert on(lambda conn: ops.complete(conn, "other", done)) == {}
    assert on(lambda conn: ops.complete(conn, "w", done)) == dict.fromkeys(done, "done")
    assert on(lambda conn: ops.complete(conn, "w", done)) == {}  # fenced: a repeat moves nothing
    errors = [f"boom {n}" for n in range(held)]
    assert on(lambda conn: ops.fail(conn, "w", failed, errors)) == dict.fromkeys(failed, "failed")
    assert on(lambda conn: ops.release(conn, "w", back, refund=True)) == dict.fromkeys(back, "pending")
    assert on(lambda conn: ops.release(conn, "w", handed, refund=False)) == dict.fromkeys(handed, "pending")
    found = rows(engine)
    assert {found[t.job_id].status for t in done} == {"done"}
    assert [(found[t.job_id].status, found[t.job_id].last_error) for t in failed] == [
        ("failed", e) for e in errors]
    # Never given back (a token names one claim): a refund lets max_attempts grow instead.
    assert {(found[t.job_id].status, found[t.job_id].attempts, found[t.job_id].max_attempts,
             found[t.job_id].lease_owner) for t in back} == {("pending", 1, DEFAULT_MAX_ATTEMPTS + 1, None)}
    assert {(found[t.job_id].status, found[t.job_id].attempts, found[t.job_id].max_attempts)
            for t in handed} == {("pending", 1, DEFAULT_MAX_ATTEMPTS)}


@pytest.mark.parametrize("held", [1, 3])
def test_retry_says_which_tokens_went_back_and_which_were_exhausted(engine: Engine, on: On, held: int) -> None:
    again = add(engine, held, queue="a")
    last = add(engine, held, queue="a", max_attempts=1)
    tokens = claim_directly(engine, "w")
    ops = on.ops()
    errors = [f"err {t.job_id}" for t in tokens]
    delays = [0.0 if t.job_id in again else 5.0 for t in tokens]
    stale = [ClaimToken(t.job_id, t.attempt + 1) for t in tokens]
    assert on(lambda conn: ops.retry(conn, "w", stale, errors, delays)) == {}  # another attempt's tokens
    moved = on(lambda conn: ops.retry(conn, "w", tokens, errors, delays))
    assert moved == {t: ("pending" if t.job_id in again else "failed") for t in tokens}
    found = rows(engine)
    assert [(found[i].status, found[i].last_error) for i in again] == [("pending", f"err {i}") for i in again]
    assert [found[i].status for i in last] == ["failed"] * held


@pytest.mark.parametrize("count", [1, 3])
def test_token_states_read_the_rows_of_the_jobs_named(engine: Engine, on: On, count: int) -> None:
    ids = add(engine, count + 1, queue="a")
    claim_directly(engine, "w", limit=count)
    ops = on.ops()
    states = on(lambda conn: ops.token_states(conn, ids[:count]))
    assert all(isinstance(s, TokenState) for s in states)
    assert sorted(states) == [TokenState(i, 1, "running", "w", False, None) for i in ids[:count]]


def test_the_transactional_completion_commits_with_the_handler_s_transaction(engine: Engine, on: On) -> None:
    add(engine, 2, queue="a")
    mine, lost = claim_directly(engine, "w")
    ops = on.ops()

    def complete(token: ClaimToken, commit: bool) -> bool:
        def body(conn: DbConnection) -> bool:
            conn.set_autocommit(False)
            trans = conn.sa.begin()
            try:
                found = ops.complete_in_transaction(conn.sa, "w", token)
                trans.commit() if commit else trans.rollback()
                return found
            finally:
                conn.set_autocommit(True)

        return on(body)

    assert complete(mine, commit=False) is True
    assert rows(engine)[mine.job_id].status == "running"  # rolled back with the transaction
    assert complete(mine, commit=True) is True
    assert complete(ClaimToken(lost.job_id, 2), commit=True) is False  # not the current attempt
    found = rows(engine)
    assert (found[mine.job_id].status, found[lost.job_id].status) == ("done", "running")


# -- claims whose answer was lost --------------------------------------------------------------


@pytest.mark.parametrize("kept", [0, 1, 2])
def test_release_lost_claims_gives_back_the_owner_s_rows_but_the_kept_tokens(
    engine: Engine, on: On, kept: int
) -> None:
    add(engine, 5, queue="a")
    mine = claim_directly(engine, "w/0.0", limit=4)
    theirs = claim_directly(engine, "w/1.0", limit=1)
    ops = on.ops()
    keep = mine[:kept]
    released = on(lambda conn: ops.release_lost_claims(conn, "w/0.0", keep))
    assert sorted(released) == [t.job_id for t in mine[kept:]]
    found = rows(engine)
    assert {(found[t.job_id].status, found[t.job_id].attempts, found[t.job_id].max_attempts)
            for t in mine[kept:]} == {("pending", 1, DEFAULT_MAX_ATTEMPTS + 1)}
    assert {found[t.job_id].status for t in [*keep, *theirs]} == {"running"}


def test_release_lost_claims_releases_nothing_once_the_statement_is_stale(engine: Engine, on: On) -> None:
    add(engine, 2, queue="a")
    claim_directly(engine, "w/0.0")
    ops = on.ops(statement_deadline=0.0)
    assert on(lambda conn: ops.release_lost_claims(conn, "w/0.0", [])) == []
    assert {r.status for r in rows(engine).values()} == {"running"}


# -- leases -------------------------------------------------------------------------------


def _lease_left(engine: Engine, ids: list[Any]) -> dict[int, float]:
    with engine.connect() as conn:
        left = func.extract("epoch", TASKS.c.lease_expires_at - func.now())
        return {r[0]: float(r[1]) for r in conn.execute(select(TASKS.c.id, left).where(TASKS.c.id.in_(ids)))}


def _shorten_leases(engine: Engine, seconds: float = 5.0) -> None:
    with engine.begin() as conn:
        conn.execute(update(TASKS).where(TASKS.c.status == "running").values(
            lease_expires_at=func.now() + text(f"interval '{seconds} seconds'")))


@pytest.mark.parametrize("held", [1, 3])
def test_extend_leases_extends_the_tokens_of_every_owner_with_the_prefix(engine: Engine, on: On, held: int) -> None:
    add(engine, 2 * held + 1, queue="a")
    a = claim_directly(engine, "w:1/0.0", limit=held)
    b = claim_directly(engine, "w:1/1.2", limit=held)
    other = claim_directly(engine, "w:10/0.0", limit=1)
    _shorten_leases(engine)
    ops = on.ops(lease=600.0)
    tokens = [*a, *b, *other]
    assert on(lambda conn: ops.extend_leases(conn, "w:1/", tokens)) == {*a, *b}
    left = _lease_left(engine, [t.job_id for t in tokens])
    assert all(left[t.job_id] > 500 for t in [*a, *b]) and left[other[0].job_id] < 10
    assert on(lambda conn: ops.owned_tokens(conn, "w:1/", tokens)) == {*a, *b}
    assert on(lambda conn: ops.owned_tokens(conn, "w:10/", tokens)) == set(other)


def test_extend_leases_with_a_window_also_extends_the_owner_s_recent_unknown_leases(engine: Engine, on: On) -> None:
    add(engine, 2, queue="a")
    known = claim_directly(engine, "w:1/0.0", limit=1)
    unseen = claim_directly(engine, "w:1/1.0", limit=1)  # a claim whose answer is not read yet
    ops = on.ops(lease=60.0)
    assert on(lambda conn: ops.extend_leases(conn, "w:1/", known)) == set(known)  # no window: the tokens only
    assert on(lambda conn: ops.extend_leases(conn, "w:1/", known, since=30.0)) == {*known, *unseen}
    _shorten_leases(engine, 5.0)  # leased long ago, as far as a window of 30 s can tell
    assert on(lambda conn: ops.extend_leases(conn, "w:1/", [], since=30.0)) == set()


def test_extend_leases_steps_over_a_row_locked_by_another_transaction(engine: Engine, on: On) -> None:
    add(engine, 2, queue="a")
    tokens = claim_directly(engine, "w:1/0.0")
    ops = on.ops()
    with engine.begin() as conn:  # a handler's transaction holding its own job row
        conn.execute(select(TASKS.c.id).where(TASKS.c.id == tokens[0].job_id).with_for_update())
        assert on(lambda c: ops.extend_leases(c, "w:1/", tokens)) == {tokens[1]}
        assert on(lambda c: ops.owned_tokens(c, "w:1/", tokens)) == set(tokens)


# -- the sweep and the next due time --------------------------------------------------------


@pytest.mark.parametrize("limit", [1, 10])
def test_sweep_returns_expired_leases_and_says_what_it_did(engine: Engine, on: On, limit: int) -> None:
    back = add(engine, 2, queue="a") + add(engine, 1, queue="b")
    dead = add(engine, 1, queue="c", max_attempts=1)
    alive = add(engine, 1, queue="d")
    claim_directly(engine, "gone", queues=["a", "b", "c"])
    claim_directly(engine, "alive", queues=["d"])
    with engine.begin() as conn:
        conn.execute(update(TASKS).where(TASKS.c.lease_owner == "gone").values(
            lease_expires_at=func.now() - text("interval '1 second'")))
    ops = on.ops()
    swept = on(lambda conn: ops.sweep(conn, limit=limit))
    assert isinstance(swept, SweepResult)
    if limit == 1:
        assert swept.total == 1 and swept.back + len(swept.dead) == 1 and len(swept.queues) == 1
        swept = on(lambda conn: ops.sweep(conn, limit=10))
        assert swept.total == 3
        return
    assert (swept.total, swept.back, swept.dead, swept.queues) == (4, 3, dead, ["a", "b", "c"])
    expected = [(i, "pending", q, 1) for i, q in zip(back, ["a", "a", "b"], strict=True)]
    expected.append((dead[0], "failed", "c", 1))
    assert sorted((j.job_id, j.status, j.queue, j.attempt) for j in swept.jobs) == sorted(expected)
    assert all(isinstance(j.task, str) for j in swept.jobs)  # a task table: each job's task
    found = rows(engine)
    assert {(found[i].status, found[i].isolated) for i in back} == {("pending", True)}
    assert found[dead[0]].status == "failed" and found[alive[0]].status == "running"
    assert on(lambda conn: ops.sweep(conn, limit=10)) == SweepResult(0, 0, [], [], [])


@pytest.mark.parametrize("queues", QUEUES)
def test_next_due_is_the_soonest_delayed_job_of_the_queues_served(
    engine: Engine, on: On, queues: tuple[str, ...] | None
) -> None:
    ops = on.ops(queues=queues)
    assert on(ops.next_due) is None
    add(engine, 1, queue="c", run_after=func.now() + text("interval '100 seconds'"))
    add(engine, 1, queue="b", run_after=func.now() + text("interval '200 seconds'"))
    add(engine, 1, queue="a", run_after=func.now() + text("interval '300 seconds'"))
    seconds = on(ops.next_due)
    expected = {(): 100, ("a",): 300, ("a", "b"): 200}[queues or ()]
    assert seconds is not None and abs(seconds - expected) < 5


def test_the_requests_carry_what_their_caller_set(on: On) -> None:
    ops = on.ops(queues=("a", "b"))
    request = ops.claim_request("w/0.0", 7, skip=[1, 2], in_flight=42)
    assert isinstance(request, ClaimRequest)
    assert (request.owner, request.limit, request.isolated, request.skip, request.in_flight) == (
        "w/0.0", 7, False, [1, 2], 42)
    assert request.statement is not None and request.after_completion is not None
    assert ops.channel == on.driver.channel(TASKS)


# -- more tokens than one statement takes -------------------------------------------------


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> int:
    """Two tokens a statement, so a handful of tokens spans several statements."""
    monkeypatch.setattr(ops_queue, "TOKENS_PER_STATEMENT", 2)
    return 2


def test_every_token_call_covers_tokens_over_several_statements(engine: Engine, on: On, small_parts: int) -> None:
    add(engine, 25, queue="a")
    tokens = claim_directly(engine, "w/0.0")
    done, failed, again, snoozed, back = (tokens[n * 5:(n + 1) * 5] for n in range(5))
    ops = on.ops(lease=600.0)
    _shorten_leases(engine)
    assert on(lambda conn: ops.extend_leases(conn, "w/", tokens, since=1.0)) == set(tokens)
    assert all(left > 500 for left in _lease_left(engine, [t.job_id for t in tokens]).values())
    assert on(lambda conn: ops.owned_tokens(conn, "w/", tokens)) == set(tokens)
    assert on(lambda conn: ops.complete(conn, "w/0.0", done)) == dict.fromkeys(done, "done")
    errors = [f"boom {t.job_id}" for t in failed]
    assert on(lambda conn: ops.fail(conn, "w/0.0", failed, errors)) == dict.fromkeys(failed, "failed")
    retried = on(lambda conn: ops.retry(conn, "w/0.0", again, [f"err {t.job_id}" for t in again], [60.0] * 5))
    assert retried == dict.fromkeys(again, "pending")
    assert on(lambda conn: ops.snooze(conn, "w/0.0", snoozed, [60.0] * 5)) == dict.fromkeys(snoozed, "pending")
    notes = [f"lost {t.job_id}" for t in back]
    notes[0] = ""  # an empty note leaves last_error as it was
    released = on(lambda conn: ops.release(conn, "w/0.0", back, refund=True, errors=notes))
    assert released == dict.fromkeys(back, "pending")
    found = rows(engine)
    # Each part's values went with its own tokens.
    assert [found[t.job_id].last_error for t in failed] == errors
    assert [found[t.job_id].last_error for t in again] == [f"err {t.job_id}" for t in again]
    assert [found[t.job_id].last_error for t in back] == [None, *notes[1:]]
    assert {(found[t.job_id].status, found[t.job_id].attempts, found[t.job_id].max_attempts)
            for t in [*snoozed, *back]} == {("pending", 1, DEFAULT_MAX_ATTEMPTS + 1)}
    assert on(lambda conn: ops.owned_tokens(conn, "w/", tokens)) == set()


def test_complete_then_claim_over_several_statements_completes_all_and_claims_once(
    engine: Engine, on: On, small_parts: int
) -> None:
    add(engine, 5, queue="a")
    tokens = claim_directly(engine, "w/0.0")
    nxt = add(engine, 3, queue="a")
    ops = on.ops()
    request = ops.claim_request("w/0.0", 10)
    done, claimed = on(lambda conn: ops.complete_then_claim(conn, tokens, request))
    assert done == dict.fromkeys(tokens, "done")
    assert tokens_of(claimed) == [(i, 1) for i in nxt]


def test_a_heartbeat_of_thousands_of_tokens_spans_parts_and_extends_them_all(engine: Engine, on: On) -> None:
    count = 2 * ops_queue.TOKENS_PER_STATEMENT + 1
    add(engine, count, queue="a")
    tokens = claim_directly(engine, "w/0.0", limit=count)
    _shorten_leases(engine)
    ops = on.ops(lease=600.0)
    assert on(lambda conn: ops.extend_leases(conn, "w/", tokens)) == set(tokens)
    assert min(_lease_left(engine, [t.job_id for t in tokens]).values()) > 500
    assert on(lambda conn: ops.owned_tokens(conn, "w/", tokens)) == set(tokens)
