"""An in-memory stand-in for the operations layer (:class:`sqla_queue.ops.Operations`),
for unit tests of the services without a database.

It keeps jobs as plain records and applies the same rules as the statements: every
transition after a claim is fenced by status, owner and attempt, a retry dead-letters an
exhausted job, a release may leave the attempt uncounted. Faults are injected per method: a call
may raise, after its effect landed (an answer lost with its connection) or before.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

import psycopg

from sqla_queue.activity import RESOLUTIONS, due_range
from sqla_queue.driver import Driver
from sqla_queue.jsontext import ResultEncoder, dialect_json_serializer, progress_encoder
from sqla_queue.ops import (
    Claimed,
    ClaimRequest,
    ClaimSeen,
    ClaimStart,
    Moved,
    Operations,
    SweepResult,
    SweptJob,
    TokenState,
)
from sqla_queue.sql import ClaimToken, is_solitary

__all__ = ["Fault", "FakeConn", "FakeDriver", "FakeJob", "FakeOps", "connection_lost", "rejected"]


def connection_lost() -> psycopg.OperationalError:
    """What psycopg raises when the server or the link goes away."""
    return psycopg.OperationalError("server closed the connection unexpectedly")


def rejected() -> psycopg.Error:
    """An error of the statement itself (a value the server refuses), not of the connection."""
    return psycopg.errors.CharacterNotInRepertoire("invalid byte sequence for encoding")


class Fault(NamedTuple):
    """Raise ``error`` from the next call; ``lands``: after its effect was applied."""

    error: BaseException
    lands: bool = False


@dataclass
class FakeJob:
    id: int
    queue: str = "default"
    status: str = "pending"
    attempts: int = 0
    max_attempts: int = 5
    priority: int = 0
    lease_owner: str | None = None
    lease_expires_at: float | None = None
    isolated: bool = False
    last_error: str | None = None
    #: ``time.monotonic()`` before which no claim takes it (set by a snooze only).
    run_after: float = 0.0
    created_at: datetime | None = None
    #: The result's JSON text, on a fake that keeps results; its progress's likewise.
    result: str | None = None
    progress: str | None = None


class FakeConn:
    """A connection that is only ever closed."""

    def __init__(self) -> None:
        self.closed = False
        self.broken = False

    def close(self) -> None:
        self.closed = True


class FakeDriver:
    """What a service asks of the driver besides the operations: deadlines and error kinds."""

    is_connection_error = staticmethod(Driver.is_connection_error)

    def deadline(self, conn: Any, seconds: float) -> AbstractContextManager[None]:
        return nullcontext()


@dataclass
class FakeOps:
    """:class:`~sqla_queue.ops.Operations` in memory."""

    queues: Sequence[str] | None = None
    lease: float = 30.0
    channel: str = "fake_jobs"
    jobs: dict[int, FakeJob] = field(default_factory=dict)
    #: Faults to raise, in order, by method name.
    faults: dict[str, list[Fault]] = field(default_factory=dict)
    #: Error texts the "server" refuses (raises :func:`rejected`).
    rejects: Callable[[str], bool] = lambda error: False
    #: Every call made, by method name.
    calls: list[str] = field(default_factory=list)
    #: Claims may start after a key (``claim_request(after=...)``), as on a table with
    #: integer keys; off by default, so a worker's claims take the whole order every time.
    claims_after: bool = False
    #: Claims take turns, as on a table with flow rules (the worker's batches may grow larger).
    claims_take_turns: bool = False
    #: The table keeps results (ResultMixin): completions store each job's JSON text.
    stores_results: bool = False
    #: The table keeps progress: beats and outcomes store each job's JSON text.
    stores_progress: bool = False
    #: The table has a workers table: the records, by name.
    records_workers: bool = False
    workers: dict[str, Any] = field(default_factory=dict)

    def record_worker(self, conn: Any, record: Any) -> None:
        self.calls.append("record_worker")
        self.workers[record.name] = record

    def forget_worker(self, conn: Any, name: str) -> None:
        self.calls.append("forget_worker")
        self.workers.pop(name, None)

    def prune_workers(self, conn: Any, older_than: float) -> int:
        return 0

    #: No workflows here: nothing is ever left to count down.
    settles_edges: bool = False

    def settle_edges(self, conn: Any, *, limit: int) -> int:
        return 0

    def on_owed(self) -> None:
        pass

    def committed(self, token: ClaimToken) -> None:
        pass

    #: The table has an activity table: the latest bucket recorded, per bucket width.
    records_activity: bool = False
    activity_marks: dict[int, datetime] = field(default_factory=dict)

    def record_activity(self, conn: Any) -> int:
        def record() -> int:
            now, recorded = datetime.now(UTC), 0
            for resolution in RESOLUTIONS:
                due = due_range(now, self.activity_marks.get(resolution.seconds), resolution)
                if due is not None:
                    since, until, _ = due
                    width = timedelta(seconds=resolution.seconds)
                    recorded += (until - since) // width
                    self.activity_marks[resolution.seconds] = until - width
            return recorded

        return int(self._call("record_activity", record))

    @property
    def after_per_queue(self) -> bool:
        return self.queues is not None and len(set(self.queues)) > 1

    def add(self, n: int = 1, **values: Any) -> list[int]:
        first = max(self.jobs, default=0) + 1
        for job_id in range(first, first + n):
            self.jobs[job_id] = FakeJob(job_id, **values)
        return list(range(first, first + n))

    def _call(self, name: str, apply: Callable[[], Any]) -> Any:
        self.calls.append(name)
        planned = self.faults.get(name)
        fault = planned.pop(0) if planned else None
        if fault is None:
            return apply()
        if fault.lands:
            apply()
        raise fault.error

    def _held(self, owner: str, token: tuple[Any, int], *, prefix: bool = False) -> FakeJob | None:
        job = self.jobs.get(token[0])
        if job is None or job.status != "running" or job.attempts != token[1] or job.lease_owner is None:
            return None
        if job.lease_owner != owner and not (prefix and job.lease_owner.startswith(owner)):
            return None
        return job

    # -- Operations ----------------------------------------------------------------------

    def check_table(self) -> None:
        self.calls.append("check_table")

    def claim_request(
        self, owner: str, limit: int, *, isolated: bool = False, skip: Sequence[Any] | None = None,
        key: Any = None, in_flight: int = 0, after: ClaimStart | None = None, seen: ClaimSeen | None = None,
    ) -> ClaimRequest:
        limit = 1 if isolated or key is not None else limit
        if isolated or key is not None or skip is not None:
            return ClaimRequest(owner, limit, isolated, None if key is not None else skip, key, in_flight)
        if after is not None and not self.claims_after:
            raise ValueError("claims of this table cannot start after a key")
        # The start rides in ``values``, as the real one's bound parameters do.
        return ClaimRequest(owner, limit, False, None, None, in_flight, None, {"after": after},
                            from_cursor=after is not None, seen=seen)

    def _order(self, job: FakeJob) -> tuple[int, datetime, int]:
        """A job's place in the claim's order, as a start key compares it: priority
        first, then when it fell due, then its key."""
        return -job.priority, datetime.fromtimestamp(job.run_after, UTC), job.id

    def _after(self, job: FakeJob, after: ClaimStart | None) -> bool:
        """Whether ``job`` sorts after the claim's start (a queue without one: any)."""
        if after is None:
            return True
        start = after.get(job.queue if self.after_per_queue else None)
        return start is None or self._order(job) > (-start[0], start[1], start[2])

    def _claim(self, request: ClaimRequest) -> list[Claimed]:
        skip = set(request.skip or ())
        after = (request.values or {}).get("after")
        due = sorted(
            (j for j in self.jobs.values()
             if j.status == "pending" and j.isolated == request.isolated and j.id not in skip
             and j.run_after <= time.monotonic()
             and (self.queues is None or j.queue in self.queues)
             and (request.key is None or j.id == request.key)
             and self._after(j, after)),
            key=self._order,
        )[:request.limit]
        if request.seen is not None:
            keys = [(j.priority, datetime.fromtimestamp(j.run_after, UTC), j.id, j.queue) for j in due]
            request.seen(keys, from_head=not request.from_cursor, took=0.0)
        claimed = []
        for job in due:
            job.status, job.attempts, job.lease_owner = "running", job.attempts + 1, request.owner
            job.lease_expires_at = time.monotonic() + self.lease
            solitary = request.isolated and is_solitary(job.isolated, job.last_error)
            claimed.append(Claimed(ClaimToken(job.id, job.attempts), replace(job), None, solitary))
        return claimed

    def fetch_claimed(self, conn: Any, request: ClaimRequest) -> list[Claimed]:
        result: list[Claimed] = self._call("fetch_claimed", lambda: self._claim(request))
        return result

    def complete_then_claim(
        self, conn: Any, tokens: Sequence[ClaimToken], request: ClaimRequest,
        results: Sequence[str | None] | None = None, progress: Sequence[str | None] | None = None,
    ) -> tuple[Moved, list[Claimed]]:
        def both() -> tuple[Moved, list[Claimed]]:
            return self._noted(self._complete(request.owner, tokens, results), tokens, progress), self._claim(request)

        result: tuple[Moved, list[Claimed]] = self._call("complete_then_claim", both)
        return result

    def claim_candidates(self, conn: Any, *, isolated: bool, limit: int, skip: Sequence[Any]) -> list[Any]:
        pending = sorted((j for j in self.jobs.values() if j.status == "pending" and j.isolated == isolated
                          and j.id not in set(skip)), key=lambda j: (-j.priority, j.id))
        return [j.id for j in pending[:limit]]

    def fail_unclaimable(self, conn: Any, key: Any, error: str) -> bool:
        job = self.jobs.get(key)
        if job is None or job.status != "pending":
            return False
        job.status, job.last_error = "failed", error
        return True

    def release_lost_claims(self, conn: Any, owner: str, keep: Sequence[ClaimToken]) -> list[Any]:
        kept = {(t[0], t[1]) for t in keep}
        back = [j for j in self.jobs.values()
                if j.status == "running" and j.lease_owner == owner and (j.id, j.attempts) not in kept]
        for job in back:
            job.status, job.lease_owner, job.lease_expires_at = "pending", None, None
            job.max_attempts += 1
        return [j.id for j in back]

    def next_due(self, conn: Any) -> float | None:
        return None

    def _complete(
        self, owner: str, tokens: Sequence[ClaimToken], results: Sequence[str | None] | None = None
    ) -> Moved:
        moved: Moved = {}
        if results is not None:
            assert len(results) == len(tokens)
        for n, token in enumerate(tokens):
            job = self._held(owner, token)
            if job is not None:
                job.status, job.lease_expires_at = "done", None
                if self.stores_results and results is not None:
                    job.result = results[n]
                moved[token] = "done"
        return moved

    def complete(
        self, conn: Any, owner: str, tokens: Sequence[ClaimToken], results: Sequence[str | None] | None = None,
        progress: Sequence[str | None] | None = None,
    ) -> Moved:
        result: Moved = self._call("complete", lambda: self._noted(self._complete(owner, tokens, results), tokens,
                                                                   progress))
        return result

    def _noted(self, moved: Any, tokens: Sequence[Any], progress: Sequence[str | None] | None) -> Any:
        """Each moved token's progress stored (None: unchanged), as the statements do."""
        if progress is not None and self.stores_progress:
            for token, value in zip(tokens, progress, strict=True):
                if token in moved and value is not None:
                    self.jobs[token[0]].progress = value
        return moved

    def retry(
        self, conn: Any, owner: str, tokens: Sequence[ClaimToken], errors: Sequence[str], delays: Sequence[float],
        progress: Sequence[str | None] | None = None,
    ) -> Moved:
        def apply() -> Moved:
            if any(self.rejects(e) for e in errors):
                raise rejected()
            moved: Moved = {}
            for token, error in zip(tokens, errors, strict=True):
                job = self._held(owner, token)
                if job is None:
                    continue
                job.last_error, job.lease_expires_at, job.isolated = error, None, False
                if job.attempts >= job.max_attempts:
                    job.status = "failed"
                else:
                    job.status, job.lease_owner = "pending", None
                moved[token] = job.status
            return moved

        result: Moved = self._call("retry", lambda: self._noted(apply(), tokens, progress))
        return result

    def fail(
        self, conn: Any, owner: str, tokens: Sequence[ClaimToken], errors: Sequence[str],
        progress: Sequence[str | None] | None = None,
    ) -> Moved:
        def apply() -> Moved:
            if any(self.rejects(e) for e in errors):
                raise rejected()
            moved: Moved = {}
            for token, error in zip(tokens, errors, strict=True):
                job = self._held(owner, token)
                if job is not None:
                    job.status, job.last_error, job.lease_expires_at = "failed", error, None
                    moved[token] = "failed"
            return moved

        result: Moved = self._call("fail", lambda: self._noted(apply(), tokens, progress))
        return result

    def snooze(
        self, conn: Any, owner: str, tokens: Sequence[ClaimToken], delays: Sequence[float],
        progress: Sequence[str | None] | None = None,
    ) -> Moved:
        def apply() -> Moved:
            moved: Moved = {}
            for token, delay in zip(tokens, delays, strict=True):
                job = self._held(owner, token)
                if job is not None:
                    job.status, job.lease_owner, job.lease_expires_at, job.isolated = "pending", None, None, False
                    job.max_attempts += 1
                    job.run_after = time.monotonic() + delay
                    moved[token] = "pending"
            return moved

        result: Moved = self._call("snooze", lambda: self._noted(apply(), tokens, progress))
        return result

    def release(
        self, conn: Any, owner: str, tokens: Sequence[ClaimToken], *, refund: bool,
        errors: Sequence[str] | None = None, progress: Sequence[str | None] | None = None,
    ) -> Moved:
        def apply() -> Moved:
            moved: Moved = {}
            notes = list(errors) if errors is not None and refund else [""] * len(tokens)
            for token, note in zip(tokens, notes, strict=True):
                job = self._held(owner, token)
                if job is not None:
                    job.status, job.lease_owner, job.lease_expires_at = "pending", None, None
                    job.max_attempts += 1 if refund else 0
                    job.last_error = note or job.last_error
                    moved[token] = "pending"
            return moved

        result: Moved = self._call("release", lambda: self._noted(apply(), tokens, progress))
        return result

    def token_states(self, conn: Any, job_ids: Sequence[Any]) -> list[TokenState]:
        def apply() -> list[TokenState]:
            found = [self.jobs[i] for i in job_ids if i in self.jobs]
            return [TokenState(j.id, j.attempts, j.status, j.lease_owner, j.isolated, j.last_error) for j in found]

        result: list[TokenState] = self._call("token_states", apply)
        return result

    def extend_leases(
        self, conn: Any, owner_prefix: str, tokens: Sequence[ClaimToken], *, since: float | None = None,
        progress: Sequence[str | None] | None = None,
    ) -> set[ClaimToken]:
        def apply() -> set[ClaimToken]:
            extended = set()
            for token in tokens:
                job = self._held(owner_prefix, token, prefix=True)
                if job is not None:
                    job.lease_expires_at = time.monotonic() + self.lease
                    extended.add(token)
            return extended

        result: set[ClaimToken] = self._call("extend_leases", lambda: self._noted(apply(), tokens, progress))
        return result

    def owned_tokens(self, conn: Any, owner_prefix: str, tokens: Sequence[ClaimToken]) -> set[ClaimToken]:
        return {t for t in tokens if self._held(owner_prefix, t, prefix=True) is not None}

    def sweep(self, conn: Any, *, limit: int) -> SweepResult:
        now = time.monotonic()
        expired = [j for j in self.jobs.values()
                   if j.status == "running" and j.lease_expires_at is not None and j.lease_expires_at < now][:limit]
        for job in expired:
            job.status = "failed" if job.attempts >= job.max_attempts else "pending"
            job.lease_owner, job.lease_expires_at, job.isolated = None, None, True
        return SweepResult(len(expired), sum(1 for j in expired if j.status == "pending"),
                     [j.id for j in expired if j.status == "failed"], sorted({j.queue for j in expired}),
                     [SweptJob(j.id, j.status, j.queue, j.attempts, None) for j in expired])

    #: The workers whose session lock is held (the fake has no sessions: held for ever).
    session_locks: set[str] = field(default_factory=set)

    def hold_worker_lock(self, conn: Any, owner: str) -> bool:
        self.session_locks.add(owner)
        return True

    def result_encoder(self, limit: int) -> Callable[[Any], str | None]:
        return ResultEncoder(dialect_json_serializer(None), limit)

    def progress_encoder(self, limit: int) -> Callable[[Any], str | None]:
        return progress_encoder(dialect_json_serializer(None), limit)

    def complete_in_transaction(
        self, sa: Any, owner: str, token: ClaimToken, result: str | None = None, progress: str | None = None
    ) -> bool:
        return bool(self._noted(self._complete(owner, [token], [result]), [token], [progress]))


def _conforms(ops: FakeOps) -> Operations:
    return ops  # mypy checks that the fake has the shape of the real one
