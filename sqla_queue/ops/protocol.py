"""The shape of the operations layer: what the worker's services call (:class:`Operations`)
and the values it takes and gives back (claim requests, claimed rows, token states, sweep
results, worker records). An in-memory stand-in implements the same protocol
(``tests/fakes.py``), so the services' logic is tested without a database."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeAlias

from sqlalchemy import Connection

from ..driver import DbConnection, Statement
from ..sql import ClaimToken

#: What a statement that moves tokens moved: each token it matched, and the status it left
#: the job in (``done``, ``failed``, ``pending``). A token missing from it was not moved:
#: its lease was lost.
Moved: TypeAlias = dict[ClaimToken, str]

#: Each token's progress as JSON text (None: unchanged), or None: no token's changes.
Progress: TypeAlias = "Sequence[str | None] | None"

#: Where a claim starts its index scan: after ``(priority, run_after, pk)``, a key of the
#: claim's order (the last job claimed, in the worker's cursor: see
#: :mod:`sqla_queue.worker.cursor`).
CursorStart: TypeAlias = tuple[int, Any, Any]
#: A claim's start: ``{None: key}``, or one key per queue served (``{queue: key}``, a
#: queue missing from it starts at its head) when the claims serve several
#: (:attr:`Operations.after_per_queue`).
ClaimStart: TypeAlias = Mapping[str | None, CursorStart]


class ClaimSeen(Protocol):
    """Told where a claim's rows lay: the ``(priority, run_after, pk, queue)`` of each job
    it took, whether it started from the head of the index (no start given), and the
    seconds its statement took."""

    def __call__(self, keys: Sequence[tuple[int, Any, Any, str]], *, from_head: bool, took: float) -> None: ...


@dataclass(frozen=True)
class ClaimRequest:
    """A claim to run: for whom, how many, which kind, and what the operations object
    that made it runs (its statements and their values, opaque to the caller)."""

    #: The lease owner it claims for (an executor's own name; see the worker's ledger).
    owner: str
    limit: int
    isolated: bool = False
    #: Keys the claim passes over (rows no claim can update), or None.
    skip: Sequence[Any] | None = None
    #: The one key the claim takes, if it is claimable (None: any).
    key: Any = None
    #: Its mark among the claims in flight (see :meth:`~sqla_queue.worker.ledger.Ledger.begin_claim`).
    in_flight: int = 0
    statement: Statement | None = None
    values: Mapping[str, Any] | None = None
    #: The same claim behind a completion, as one statement (None: it cannot follow one).
    after_completion: Statement | None = None
    #: It starts after a key (``claim_request(after=...)``), not at the head of the index.
    from_cursor: bool = False
    #: Told where its rows lay once it ran (``claim_request(seen=...)``), or None.
    seen: ClaimSeen | None = None


class RowProblem(NamedTuple):
    """Why a claimed row did not become a model instance: ``what`` failed, and how."""

    what: str
    error: BaseException


class Claimed(NamedTuple):
    """A claimed row: its token, the model instance (None if the row could not be read or
    loaded: ``problem`` says why), whether it must run with no other job in its worker
    (an isolated job whose lease expired on its last two attempts), and the seconds its
    attempt may run (None: no deadline)."""

    token: ClaimToken
    job: Any
    problem: RowProblem | None
    solitary: bool
    timeout: float | None = None


class TokenState(NamedTuple):
    """A job's row as :func:`~sqla_queue.sql.token_states` reads it, to tell whether a
    statement whose answer was lost had landed."""

    job_id: Any
    attempt: int
    status: str
    lease_owner: str | None
    isolated: bool
    last_error: str | None


class SweptJob(NamedTuple):
    """One job a sweep moved: its key, the status it left it in, its queue, the attempt
    whose lease expired, and its task (None on a table without one)."""

    job_id: Any
    status: str
    queue: str
    attempt: int
    task: str | None


class SweepResult(NamedTuple):
    """What one sweep did: how many expired leases it moved, how many of those went back to
    ``pending`` (isolated), the keys dead-lettered, the queues (sorted) to wake, and each
    job moved."""

    total: int
    back: int
    dead: list[Any]
    queues: list[str]
    jobs: Sequence[SweptJob] = ()


class WorkerRecord(NamedTuple):
    """A worker as the workers table records it (see :func:`~sqla_queue.workers_table`)."""

    name: str
    host: str
    pid: int
    queues: tuple[str, ...] | None
    concurrency: int
    runtime: str
    version: str
    running: int = 0
    jobs: tuple[Any, ...] = ()


class Operations(Protocol):
    """What the worker's services do to the queue table: :class:`QueueOps`, or a stand-in.

    ``conn`` is the connection to run on (the services pick and reconnect it, and bound
    every call but the claims by a deadline of their own); every transition after a
    claim is fenced by owner and attempt.
    """

    #: The NOTIFY channel of the queue table (under the engine's schema map).
    channel: str

    @property
    def claims_after(self) -> bool:
        """Whether an ordinary claim can start after a key (``claim_request(after=...)``):
        keys that Python sorts as the server does (integers)."""

    @property
    def claims_take_turns(self) -> bool:
        """Whether the table's claims take turns (flow rules that count what runs or
        starts): one at a time per table, each under its lock."""

    @property
    def stores_results(self) -> bool:
        """Whether the table keeps results: completions take each job's."""

    @property
    def stores_progress(self) -> bool:
        """Whether the table keeps progress: beats and outcomes take each job's
        (``progress=``, JSON texts, None for unchanged)."""

    @property
    def records_workers(self) -> bool:
        """Whether the table has a workers table its workers record themselves in."""

    def record_worker(self, conn: DbConnection, record: WorkerRecord) -> None:
        """Insert or update the worker's row, seen now."""

    def forget_worker(self, conn: DbConnection, name: str) -> None:
        """Delete the worker's row."""

    def prune_workers(self, conn: DbConnection, older_than: float) -> int:
        """Delete the rows not seen for ``older_than`` seconds; how many."""

    @property
    def records_activity(self) -> bool:
        """Whether the table has an activity table its workers record the table's activity in."""

    def record_activity(self, conn: DbConnection) -> int:
        """Record the buckets of the activity table that have ended and are not recorded
        yet (a bounded number per statement), and delete its rows past their keep; how many
        buckets it recorded."""

    @property
    def settles_edges(self) -> bool:
        """Whether the table keeps workflows: its sweeper settles the children parents left
        to count down (:func:`~sqla_queue.sql.settle_edges`)."""

    def settle_edges(self, conn: DbConnection, *, limit: int) -> int:
        """Count down, release or cancel the children that up to ``limit`` ended parents
        left to count down; how many parents it settled."""

    def on_owed(self) -> None:
        """Called after a commit that left children to count down (the worker wakes its
        sweeper, which settles them)."""

    @property
    def after_per_queue(self) -> bool:
        """Whether that start is one key per queue served (several queues, each an index
        range of its own), else one key (under None)."""

    def check_table(self) -> None:
        """Fail fast if the table is missing or lacks the queue columns; learn its column types."""

    def claim_request(
        self, owner: str, limit: int, *, isolated: bool = False, skip: Sequence[Any] | None = None,
        key: Any = None, in_flight: int = 0, after: ClaimStart | None = None, seen: ClaimSeen | None = None,
    ) -> ClaimRequest:
        """A claim for ``owner`` of up to ``limit`` jobs (an isolated one takes one; with
        ``key``, that job only), passing over ``skip``. An ordinary claim (not isolated,
        no ``skip`` or ``key``) starts after ``after`` (None: at the head), and tells
        ``seen`` where its rows lay once it ran."""

    def fetch_claimed(self, conn: DbConnection, request: ClaimRequest) -> list[Claimed]:
        """Run ``request`` (under the statement deadline); each row claimed, read one by
        one if one cannot be read."""

    def complete_then_claim(
        self, conn: DbConnection, tokens: Sequence[ClaimToken], request: ClaimRequest,
        results: Sequence[str | None] | None = None, progress: Progress = None,
    ) -> tuple[Moved, list[Claimed]]:
        """``tokens`` done under ``request.owner`` (with ``results``) and ``request``
        claimed, in one statement (one transaction): what was completed, and what was
        claimed."""

    def claim_candidates(
        self, conn: DbConnection, *, isolated: bool, limit: int, skip: Sequence[Any]
    ) -> list[Any]:
        """The keys the claim would take next, in its order, without claiming them."""

    def fail_unclaimable(self, conn: DbConnection, key: Any, error: str) -> bool:
        """Dead-letter the pending job ``key`` no claim can update; whether it was."""

    def release_lost_claims(self, conn: DbConnection, owner: str, keep: Sequence[ClaimToken]) -> list[Any]:
        """Back to pending, attempt not counted, every job running under ``owner`` but ``keep``."""

    def next_due(self, conn: DbConnection) -> float | None:
        """Seconds until the next delayed job falls due (None: none waits)."""

    def complete(
        self, conn: DbConnection, owner: str, tokens: Sequence[ClaimToken], results: Sequence[str | None] | None = None,
        progress: Progress = None,
    ) -> Moved:
        """``done`` for every token ``owner`` still holds, with each one's result (JSON
        text or None) on a table that keeps results."""

    def retry(
        self, conn: DbConnection, owner: str, tokens: Sequence[ClaimToken], errors: Sequence[str],
        delays: Sequence[float], progress: Progress = None,
    ) -> Moved:
        """Failed attempts: ``pending`` after each delay (seconds), or ``failed`` when exhausted."""

    def fail(
        self, conn: DbConnection, owner: str, tokens: Sequence[ClaimToken], errors: Sequence[str],
        progress: Progress = None,
    ) -> Moved:
        """Dead-letter now."""

    def snooze(
        self, conn: DbConnection, owner: str, tokens: Sequence[ClaimToken], delays: Sequence[float],
        progress: Progress = None,
    ) -> Moved:
        """Snoozed: ``pending`` after each delay (seconds), the attempt not counted."""

    def release(
        self, conn: DbConnection, owner: str, tokens: Sequence[ClaimToken], *, refund: bool,
        errors: Sequence[str] | None = None, progress: Progress = None,
    ) -> Moved:
        """Back to ``pending`` at once; ``refund``: the attempt not counted (``max_attempts``
        grows by one; ``attempts`` is never given back). ``errors``: each token's
        ``last_error`` (empty: unchanged)."""

    def token_states(self, conn: DbConnection, job_ids: Sequence[Any]) -> list[TokenState]:
        """The rows of ``job_ids``, read without locking."""

    def extend_leases(
        self, conn: DbConnection, owner_prefix: str, tokens: Sequence[ClaimToken], *, since: float | None = None,
        progress: Progress = None,
    ) -> set[ClaimToken]:
        """The heartbeat: extend the tokens held by owners starting with ``owner_prefix``,
        stepping over locked rows, and (``since``, seconds) the jobs leased that recently;
        with each token's progress, on a table that keeps it."""

    def owned_tokens(self, conn: DbConnection, owner_prefix: str, tokens: Sequence[ClaimToken]) -> set[ClaimToken]:
        """Which of ``tokens`` owners starting with ``owner_prefix`` still hold."""

    def sweep(self, conn: DbConnection, *, limit: int) -> SweepResult:
        """Expired leases back to ``pending`` (isolated), or ``failed`` when exhausted;
        with a heartbeat known, also the jobs of workers whose session ended."""

    def hold_worker_lock(self, conn: DbConnection, owner: str) -> bool:
        """Take the session lock of the worker ``owner`` on ``conn`` (kept for its life):
        True once held, False while another session still holds it."""

    def complete_in_transaction(
        self, sa: Connection, owner: str, token: ClaimToken, result: str | None = None, progress: str | None = None
    ) -> bool:
        """The transactional completion, in the transaction ``sa`` (the handler's) is in."""

    def committed(self, token: ClaimToken) -> None:
        """The transaction of ``token``'s transactional completion committed: what the
        completion left for after its commit (children to count) is asked for now."""

    def result_encoder(self, limit: int) -> Callable[[Any], str | None]:
        """A handler's return value as the JSON text the completion stores (None: none),
        or :class:`~sqla_queue.ResultNotStorable`; ``limit``: the most characters."""

    def progress_encoder(self, limit: int) -> Callable[[Any], str | None]:
        """A job's progress as the JSON text its beats and outcome store, or
        :class:`~sqla_queue.ResultNotStorable`; ``limit``: the most characters."""
