"""The operations contract, said through :class:`~sqla_queue.ops.Operations` alone and run
on the real layer (both drivers, PostgreSQL) and on the in-memory fake of
``tests/fakes.py``: what the unit tests learn from the fake is what the database does.
Ordinary claims are asked for as the worker's producer asks: after its claim cursor
(:mod:`sqla_queue.worker.cursor`), where the operations can start a claim after a key."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
from sqlalchemy import Engine, insert

from sqla_queue.activity import MINUTES, QUARTERS
from sqla_queue.ops import ClaimRequest, Operations
from sqla_queue.sql import ClaimToken
from sqla_queue.worker.cursor import ClaimCursor

from .fakes import FakeJob, FakeOps
from .models import ChartJob
from .test_ops import on_driver
from .workers import TASKS

T = TypeVar("T")


class Backend:
    """``ops(...)`` makes an operations object, ``add(n, ...)`` inserts jobs, ``run(fn)``
    runs ``fn(conn)``."""

    def __init__(self, make: Callable[..., Operations], add: Callable[..., list[Any]],
                 run: Callable[[Callable[[Any], Any]], Any]) -> None:
        self.ops, self.add, self._run = make, add, run
        #: The claim cursor of each operations object (by id), as a worker keeps one.
        self._cursors: dict[int, ClaimCursor] = {}

    def claim(self, ops: Operations, owner: str, limit: int) -> ClaimRequest:
        """An ordinary claim as the worker's producer asks for one: after the cursor it
        keeps for ``ops`` (no rescan due within a test), telling it where its rows lay."""
        if not ops.claims_after:
            return ops.claim_request(owner, limit)
        cursor = self._cursors.setdefault(id(ops), ClaimCursor(60.0, per_queue=ops.after_per_queue))
        return ops.claim_request(owner, limit, after=cursor.start(), seen=cursor.claimed)

    def __call__(self, fn: Callable[[Any], T]) -> T:
        result: T = self._run(fn)
        return result

    def states(self, ops: Operations, ids: list[Any]) -> dict[Any, tuple[str, int, str | None]]:
        return {s.job_id: (s.status, s.attempt, s.lease_owner) for s in self(lambda c: ops.token_states(c, ids))}


@pytest.fixture(
    params=[
        pytest.param("thread", marks=pytest.mark.integration),
        pytest.param("asyncio", marks=pytest.mark.integration),
        "fake",
    ]
)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "fake":
        jobs: dict[int, FakeJob] = {}

        def make_fake(**options: Any) -> Operations:
            kept = {k: v for k, v in options.items() if k in ("queues", "lease")}
            recording = options.get("model") is ChartJob  # the test table with an activity table
            return FakeOps(jobs=jobs, claims_after=True, records_activity=recording, **kept)

        def add_fake(n: int, *, queue: str = "a", **values: Any) -> list[int]:
            first = max(jobs, default=0) + 1
            for job_id in range(first, first + n):
                jobs[job_id] = FakeJob(job_id, queue=queue, **values)
            return list(range(first, first + n))

        yield Backend(make_fake, add_fake, lambda fn: fn(None))
        return
    engine: Engine = request.getfixturevalue("engine")

    def add_real(n: int, *, queue: str = "a", **values: Any) -> list[int]:
        with engine.begin() as conn:
            stmt = insert(TASKS).values(queue=queue, task="t", **values).returning(
                TASKS.c.id, sort_by_parameter_order=True)
            return list(conn.scalars(stmt, [{}] * n))

    with on_driver(request.param, engine) as on:
        yield Backend(on.ops, add_real, on)


@pytest.mark.parametrize("queues", [None, ("a",), ("a", "b")])
def test_claims_are_fenced_by_owner_and_attempt(backend: Backend, queues: tuple[str, ...] | None) -> None:
    ids = backend.add(2, queue="a") + backend.add(1, queue="b") + backend.add(1, queue="c")
    ops = backend.ops(queues=queues)
    claimed = backend(lambda c: ops.fetch_claimed(c, backend.claim(ops, "w/0.0", 10)))
    wanted = {(): ids, ("a",): ids[:2], ("a", "b"): ids[:3]}[queues or ()]
    tokens = sorted(c.token for c in claimed)
    assert tokens == [ClaimToken(i, 1) for i in wanted]
    assert backend(lambda c: ops.complete(c, "w/1.0", tokens)) == {}
    assert backend(lambda c: ops.complete(c, "w/0.0", [ClaimToken(i, 2) for i in wanted])) == {}
    assert backend(lambda c: ops.complete(c, "w/0.0", tokens[:1])) == {tokens[0]: "done"}
    assert backend(lambda c: ops.complete(c, "w/0.0", tokens[:1])) == {}
    states = backend.states(ops, wanted)
    assert states[wanted[0]] == ("done", 1, "w/0.0")
    assert {states[i] for i in wanted[1:]} == {("running", 1, "w/0.0")}


def test_retry_fail_and_release_leave_the_states_the_statements_do(backend: Backend) -> None:
    again, exhausted, dead, back, handed = (backend.add(1, max_attempts=m)[0] for m in (3, 1, 3, 3, 3))
    ops = backend.ops()
    claimed = backend(lambda c: ops.fetch_claimed(c, backend.claim(ops, "w", 10)))
    token = {c.token.job_id: c.token for c in claimed}
    moved = backend(lambda c: ops.retry(c, "w", [token[again], token[exhausted]], ["e1", "e2"], [0.0, 0.0]))
    assert moved == {token[again]: "pending", token[exhausted]: "failed"}
    assert backend(lambda c: ops.fail(c, "w", [token[dead]], ["boom"])) == {token[dead]: "failed"}
    assert backend(lambda c: ops.release(c, "w", [token[back]], refund=True)) == {token[back]: "pending"}
    assert backend(lambda c: ops.release(c, "w", [token[handed]], refund=False)) == {token[handed]: "pending"}
    assert backend.states(ops, [again, exhausted, dead, back, handed]) == {
        again: ("pending", 1, None), exhausted: ("failed", 1, "w"), dead: ("failed", 1, "w"),
        back: ("pending", 1, None), handed: ("pending", 1, None),
    }


@pytest.mark.parametrize("n", [1, 3])
def test_snooze_does_not_count_the_attempt_fenced_by_owner_and_attempt(backend: Backend, n: int) -> None:
    ids = backend.add(n + 1, max_attempts=1)
    ops = backend.ops()
    claimed = backend(lambda c: ops.fetch_claimed(c, backend.claim(ops, "w", 10)))
    token = {c.token.job_id: c.token for c in claimed}
    tokens = [token[i] for i in ids[:n]]
    # Another owner, or another attempt, moves nothing.
    assert backend(lambda c: ops.snooze(c, "x", tokens, [0.0] * n)) == {}
    assert backend(lambda c: ops.snooze(c, "w", [ClaimToken(i, 2) for i in ids[:n]], [0.0] * n)) == {}
    delays = [0.0] + [3600.0] * (n - 1)
    assert backend(lambda c: ops.snooze(c, "w", tokens, delays)) == dict.fromkeys(tokens, "pending")
    assert backend(lambda c: ops.snooze(c, "w", tokens, delays)) == {}  # once only
    states = backend.states(ops, ids)
    # max_attempts=1 and yet pending: the snooze spent no attempt (max_attempts grew).
    assert [states[i] for i in ids[:n]] == [("pending", 1, None)] * n
    assert states[ids[n]] == ("running", 1, "w")
    # The first is due at once and claimable again, under a new attempt number (a token
    # names one claim); the others wait.
    again = backend(lambda c: ops.fetch_claimed(c, backend.claim(ops, "w", 10)))
    assert [c.token for c in again] == [ClaimToken(ids[0], 2)]


@pytest.mark.parametrize("skipped", [1, 2])
def test_skipped_keys_isolated_jobs_and_claims_by_key(backend: Backend, skipped: int) -> None:
    ids = backend.add(4)
    lone = backend.add(2, isolated=True)
    ops = backend.ops()
    claimed = backend(lambda c: ops.fetch_claimed(c, ops.claim_request("w", 10, skip=ids[:skipped])))
    assert sorted(c.token.job_id for c in claimed) == ids[skipped:]
    by_key = backend(lambda c: ops.fetch_claimed(c, ops.claim_request("w", 10, isolated=True, key=lone[1])))
    assert [c.token for c in by_key] == [ClaimToken(lone[1], 1)]
    isolated = backend(lambda c: ops.fetch_claimed(c, ops.claim_request("w", 10, isolated=True)))
    assert [c.token for c in isolated] == [ClaimToken(lone[0], 1)]
    assert backend(lambda c: ops.claim_candidates(c, isolated=False, limit=5, skip=[])) == ids[:skipped]


@pytest.mark.parametrize("held", [1, 2])
def test_complete_then_claim_and_the_recovery_of_lost_claims(backend: Backend, held: int) -> None:
    backend.add(held)
    ops = backend.ops()
    first = sorted(c.token for c in backend(lambda c: ops.fetch_claimed(c, backend.claim(ops, "w/0.0", 10))))
    nxt = backend.add(3)
    done, claimed = backend(lambda c: ops.complete_then_claim(c, first, backend.claim(ops, "w/0.0", 10)))
    assert done == dict.fromkeys(first, "done")
    tokens = sorted(c.token for c in claimed)
    assert tokens == [ClaimToken(i, 1) for i in nxt]
    back = backend(lambda c: ops.release_lost_claims(c, "w/0.0", tokens[:1]))
    assert sorted(back) == nxt[1:]
    assert backend.states(ops, nxt) == {nxt[0]: ("running", 1, "w/0.0"), **dict.fromkeys(nxt[1:], ("pending", 1, None))}


def test_the_heartbeat_extends_and_finds_the_tokens_of_an_owner_prefix(backend: Backend) -> None:
    backend.add(3)
    ops = backend.ops()
    a = [c.token for c in backend(lambda c: ops.fetch_claimed(c, backend.claim(ops, "w:1/0.0", 2)))]
    b = [c.token for c in backend(lambda c: ops.fetch_claimed(c, backend.claim(ops, "w:10/0.0", 1)))]
    assert backend(lambda c: ops.extend_leases(c, "w:1/", [*a, *b])) == set(a)
    assert backend(lambda c: ops.owned_tokens(c, "w:10/", [*a, *b])) == set(b)


@pytest.mark.parametrize("queues", [None, ("a", "b")])
def test_a_claim_after_a_key_takes_the_jobs_after_it_and_one_from_the_head_the_rest(
    backend: Backend, queues: tuple[str, ...] | None
) -> None:
    """The start is the caller's; a claim tells ``seen`` where its rows lay (each job's
    ``(priority, run_after, pk, queue)``, and whether it started at the head), and that
    is a start the next claim can take."""
    first, second = backend.add(2, queue="a")
    ops = backend.ops(queues=queues)
    assert ops.claims_after and ops.after_per_queue == (queues is not None)
    seen: list[tuple[list[Any], bool]] = []

    def note(keys: Any, *, from_head: bool, took: float) -> None:
        seen.append((list(keys), from_head))

    head = backend(lambda c: ops.fetch_claimed(c, ops.claim_request("w", 1, seen=note)))
    assert [c.token for c in head] == [ClaimToken(first, 1)]
    ((key,), from_head) = seen[-1]
    assert (key[0], key[2], key[3], from_head) == (0, first, "a", True)
    urgent = backend.add(1, queue="a", priority=5)[0]  # sorts before the start
    start: Any = {("a" if queues else None): key[:3]}
    request = ops.claim_request("w", 10, after=start, seen=note)
    assert request.from_cursor
    assert [c.token for c in backend(lambda c: ops.fetch_claimed(c, request))] == [ClaimToken(second, 1)]
    keys, from_head = seen[-1]
    assert ([k[2] for k in keys], from_head) == ([second], False)
    rest = backend(lambda c: ops.fetch_claimed(c, ops.claim_request("w", 10)))
    assert [c.token for c in rest] == [ClaimToken(urgent, 1)]


def test_the_activity_is_recorded_a_bucket_at_a_time(backend: Backend) -> None:
    """The first recording goes back an hour of minutes and the first chunk of a day of
    quarters; the next one records only what is still due (the quarters' next chunk, and
    a minute if one ended meanwhile)."""
    ops = backend.ops(model=ChartJob)
    assert ops.records_activity and not backend.ops().records_activity
    assert backend(lambda c: ops.record_activity(c)) == MINUTES.backfill + QUARTERS.chunk
    assert backend(lambda c: ops.record_activity(c)) in (QUARTERS.chunk, QUARTERS.chunk + 1)

