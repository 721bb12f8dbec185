""":class:`QueueOps`: every statement the worker runs on one queue table, compiled once,
its parameters bound and its rows decoded.

The claim's rows are read on the hot path: one token, one model instance and one small
tuple per row, the values of a statement built as one dict per call."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final, cast

from sqlalchemy import Connection

from .. import sql as q
from ..activity import MARK_QUEUE, RESOLUTIONS, declared_activity_table, due_range
from ..driver import DbConnection, Driver, RowError, Statement, WorkerStartError, take_turn
from ..jsontext import dialect_json_serializer, progress_encoder
from ..loader import RowLoader
from ..model import (
    TIMEOUT_COLUMNS,
    flow_rules,
    has_workflows,
    progress_column,
    queue_table,
    result_column,
)
from ..registry import declared_workers_table
from ..rules import takes_turns
from ..sql import ClaimToken, is_solitary
from .protocol import (
    Claimed,
    ClaimRequest,
    ClaimSeen,
    ClaimStart,
    CursorStart,
    Moved,
    Progress,
    RowProblem,
    SweepResult,
    SweptJob,
    TokenState,
    WorkerRecord,
)

#: ``ClaimToken(pk, attempt)`` and ``Claimed(...)`` without the named tuples' Python-level ``__new__``.
_new_tuple = tuple.__new__


def _nothing() -> None:
    pass


def _seconds_between(start: Any, end: Any) -> float:
    """Seconds from ``start`` to ``end`` (the claim's timestamps: datetimes, or the
    text a driver left undecoded)."""
    try:
        return max(float((end - start).total_seconds()), 0.0)
    except (TypeError, AttributeError):
        return 0.0


def _int_array(values: list[Any]) -> Any:
    """Integers as a PostgreSQL array literal (``'{1,2,3}'``, cast by the statement):
    psycopg dumps a list element by element in Python, the literal is built in C (the
    check too: no Python call per element)."""
    if not values or set(map(type, values)) == _ONLY_INT:
        return "{" + ",".join(map(str, values)) + "}"
    return values


_ONLY_INT: Final = {int}


#: Tokens one statement takes at most (a call with more runs one statement per part).
#: The token statements join the tokens to the table; a plan that does it by nested loop
#: (a generic plan, or statistics that say almost no job runs: both ordinary) costs the
#: square of their number, and a heartbeat of 12,000 tokens took over a minute so. In
#: parts of this size the worst plan measured about 0.17 s a part with 12,000 jobs
#: running (linear in the tokens), and the best one costs a round trip more per part.
TOKENS_PER_STATEMENT: Final = 500


def _jsonable(key: Any) -> Any:
    """A job's key as JSON takes it: an integer as it is, anything else (a UUID) as text."""
    return key if isinstance(key, int) else str(key)


def _results(results: Sequence[str | None] | None, tokens: Sequence[ClaimToken]) -> list[str | None]:
    """One result per token: those given, or none at all."""
    if results is None:
        return [None] * len(tokens)
    if len(results) != len(tokens):
        raise ValueError(f"one result per token: {len(tokens)} tokens, {len(results)} results")
    return list(results)


def parts(count: int) -> list[slice]:
    """The slices of ``count`` tokens one statement each takes: at least one (empty
    when there are none), so every call still reaches the table once."""
    step = TOKENS_PER_STATEMENT
    return [slice(i, i + step) for i in range(0, max(count, 1), step)]


def token_values(owner: str, tokens: Sequence[tuple[Any, int]]) -> dict[str, Any]:
    """The owner and tokens of a token statement, as its parameters."""
    return {
        q.OWNER_PARAM: owner,
        q.IDS_PARAM: _int_array([t[0] for t in tokens]),
        q.ATTEMPTS_PARAM: _int_array([t[1] for t in tokens]),
    }


#: A ``run_after`` for the start of a queue read from its head (any will do).
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)


def _integer_key(pk: Any) -> bool:
    """Whether the key's Python values sort as the server sorts them (integers do)."""
    try:
        return issubclass(pk.type.python_type, int)
    except NotImplementedError:
        return False


class QueueOps:
    """The statements one worker runs on one queue table, compiled once, as typed calls.

    ``model``: the mapped class (a single-table-inheritance subclass claims its own rows);
    ``queues``: the queues claimed (None: all); ``lease``: seconds a claim or a heartbeat
    leases a job for; ``statement_deadline``: the seconds after which the caller gives a
    statement up, past which a claim the server runs late claims nothing
    (:func:`~sqla_queue.sql.still_fresh`).
    """

    def __init__(
        self,
        driver: Driver,
        model: Any,
        *,
        queues: Sequence[str] | None = None,
        lease: float = 30.0,
        heartbeat: float | None = None,
        statement_deadline: float = 30.0,
        timeout: float | None = None,
        task_timeouts: Mapping[str, float] | None = None,
    ) -> None:
        qt = queue_table(model)
        table = qt.table
        self.driver = driver
        self.table = table
        self.model = model
        self.queues = tuple(queues) if queues is not None else None
        self.lease = float(lease)
        #: The workers' heartbeat interval: the sweep also returns the jobs of workers
        #: whose session ended (see sql.sweep_expired). None: expired leases only.
        self.heartbeat = None if heartbeat is None else float(heartbeat)
        self.statement_deadline = float(statement_deadline)
        self.channel = driver.channel(table)
        #: The claim's deadline of jobs without a timeout of their own (see sql._timeout_of).
        self._timeouts: dict[str, Any] = {}
        if q.has_timeouts(qt):
            self._timeouts[q.TIMEOUT_PARAM] = timeout
            if qt.is_task_table:
                named = dict(task_timeouts or {})
                self._timeouts[q.TASK_NAMES_PARAM] = list(named)
                self._timeouts[q.TASK_TIMEOUTS_PARAM] = [float(v) for v in named.values()]
        compile_ = self._compile
        # Every claim is guarded (fresh=True): one its caller gave up on (the deadline
        # dropped its connection) claims nothing if the server runs it later.
        self._claims: dict[bool, tuple[Statement, Statement]] = {
            isolated: (
                compile_(q.claim_template(model, queues=queues, isolated=isolated, fresh=True)),
                compile_(q.complete_many_if_owner_then_claim(model, queues=queues, isolated=isolated, fresh=True)),
            )
            for isolated in (False, True)
        }
        #: Claims after a key (``claim_request(after=...)``): integer keys, not isolated;
        #: several queues start each after a key of its own, in the order of the queues given.
        self._cursor_claims: tuple[Statement, Statement] | None = None
        self._cursor_queues = list(dict.fromkeys(queues)) if queues is not None and len(set(queues)) > 1 else None
        #: A table with flow rules: its claims take turns on this advisory lock, and start
        #: from the head (the rules pass over full keys there; see sql.flow_lock).
        self._flow_turn = (
            take_turn(q.flow_lock_key(table, driver.schema_translate_map), self.statement_deadline)
            if takes_turns(flow_rules(table)) else None
        )
        self.claims_take_turns = self._flow_turn is not None
        #: The table keeps results: its completions take each job's (see ResultMixin).
        self.stores_results = result_column(table) is not None
        #: The table keeps progress: its beats and outcomes take each job's.
        self.stores_progress = progress_column(table) is not None
        #: Its workers record themselves in its workers table (compiled if declared).
        self.records_workers = declared_workers_table(table) is not None
        self._workers = (
            (compile_(q.record_worker(table)), compile_(q.forget_worker(table)), compile_(q.prune_workers(table)))
            if self.records_workers else None
        )
        #: Its workers record the table's activity in its activity table (compiled if declared).
        self.records_activity = declared_activity_table(table) is not None
        self._activity = (
            (
                compile_(q.activity_marks(table)),
                [(r, compile_(q.record_activity(table, seconds=r.seconds))) for r in RESOLUTIONS],
                compile_(q.prune_activity(table)),
            )
            if self.records_activity else None
        )
        self.settles_edges = has_workflows(table)
        self._settles: dict[int, Statement] = {}
        self.on_owed: Callable[[], None] = _nothing
        #: The worker's finishing statements that return a last column of kept children
        #: (see ``sql.children_taken``), by id; and the transactional completions that kept some.
        self._owing: set[int] = set()
        self._owed_in_transaction: set[ClaimToken] = set()
        self.claims_after = _integer_key(qt.pk) and not flow_rules(table)
        self.after_per_queue = self._cursor_queues is not None
        if self.claims_after:
            self._cursor_claims = (
                compile_(q.claim_template(model, queues=queues, fresh=True, after=True)),
                compile_(q.complete_many_if_owner_then_claim(model, queues=queues, fresh=True, after=True)),
            )
        #: A table with workflows: the finishing statements for jobs without children
        #: (see ``sql.for_leaves``), by the statement they stand in for, and the claimed
        #: tokens known to be such jobs (the child_ids column, read at the claim).
        self._leaf_twins: dict[int, Statement] = {}
        self._leaves: set[ClaimToken] = set()
        self._child_ids_index: int | None = None
        if has_workflows(table):
            with q.for_leaves():
                for wrapped, leaf in (
                    (self._claims[False][1], q.complete_many_if_owner_then_claim(
                        model, queues=queues, isolated=False, fresh=True)),
                    (self._claims[True][1], q.complete_many_if_owner_then_claim(
                        model, queues=queues, isolated=True, fresh=True)),
                ):
                    self._leaf_twins[id(wrapped)] = compile_(leaf)
                if self._cursor_claims is not None:
                    self._leaf_twins[id(self._cursor_claims[1])] = compile_(
                        q.complete_many_if_owner_then_claim(model, queues=queues, fresh=True, after=True)
                    )
        self._next_due = compile_(q.next_run_after(model, queues=queues))
        self._release_lost = compile_(q.release_lost_claims(table))
        self._fail_unclaimable = compile_(q.fail_unclaimable(table))
        self._done = compile_(q.complete_many_if_owner(table))
        self._retry = compile_(q.retry_many_if_owner(table))
        self._fail = compile_(q.fail_many_if_owner(table))
        #: Run by SQLAlchemy on the handler's connection (its own cache compiles it once).
        self._complete_one = q.complete_template(table, single=True)
        self._complete_one_leaf = self._complete_one
        if has_workflows(table):
            with q.for_leaves():
                twins: tuple[tuple[Statement, Any], ...] = (
                    (self._done, q.complete_many_if_owner(table)),
                    (self._retry, q.retry_many_if_owner(table)),
                    (self._fail, q.fail_many_if_owner(table)),
                )
                for wrapped, leaf in twins:
                    self._leaf_twins[id(wrapped)] = compile_(leaf)
                self._complete_one_leaf = q.complete_template(table, single=True)
            self._child_ids_index = list(table.c).index(table.c.child_ids)
            self._owing = {id(self._done), id(self._retry), id(self._fail)}
        self._snooze = compile_(q.snooze_many_if_owner(table))
        self._release = {
            refund: compile_(q.release_many_if_owner(table, refund_attempt=refund)) for refund in (True, False)
        }
        self._release_noted = compile_(q.release_many_if_owner(table, refund_attempt=True, with_errors=True))
        self._states = compile_(q.token_states(table))
        # Every executor claims under a name of its own, each starting with the worker's.
        self._extend = compile_(q.extend_unlocked_leases_if_owner(table, owner_prefix=True))
        self._owned = compile_(q.owned_tokens(table, owner_prefix=True))
        #: Statements for the rare cases, compiled when first needed.
        self._rare: dict[tuple[str, bool], Statement] = {}
        self._sweeps: dict[int, Statement] = {}
        self._worker_lock: Statement | None = None
        columns = list(table.c)
        where = {id(c): n for n, c in enumerate(columns)}  # by identity: == makes SQL
        self._pk_index = where[id(qt.pk)]
        self._attempt_index = where[id(qt.c.attempts)]
        self._isolated_index = where[id(qt.c.isolated)]
        self._priority_index = where[id(qt.c.priority)]
        self._run_after_index = where[id(qt.c.run_after)]
        self._queue_index = where[id(qt.c.queue)]
        self._last_error_index = where[id(qt.c.last_error)]
        #: Where the claim's started_at and deadline_at are (None: no timeouts).
        self._deadline_index: tuple[int, int] | None = (
            (where[id(qt.c.started_at)], where[id(qt.c.deadline_at)]) if q.has_timeouts(qt) else None
        )
        self._loader = RowLoader(qt.mapped_class or model, columns, driver.dialect)

    def check_table(self) -> None:
        """Fail fast (:class:`~sqla_queue.driver.WorkerStartError`) when the table is
        missing or lacks the queue columns; load claimed rows with the types the server
        reports for its columns."""
        types = self.driver.check_table(self.table)
        if self._deadline_index is not None:
            missing = [name for name in TIMEOUT_COLUMNS if name not in types]
            if missing:
                raise WorkerStartError(
                    f"table {self.driver.table_name(self.table)!r} lacks the columns {', '.join(missing)} "
                    f"of timeouts and cancels, which the model has: migrate it (Alembic autogenerate "
                    f"adds them: nullable, no index)"
                )
        self._loader.use_type_codes(types)

    # -- claims ------------------------------------------------------------------------

    def claim_request(
        self, owner: str, limit: int, *, isolated: bool = False, skip: Sequence[Any] | None = None,
        key: Any = None, in_flight: int = 0, after: ClaimStart | None = None, seen: ClaimSeen | None = None,
    ) -> ClaimRequest:
        """A claim for ``owner`` of up to ``limit`` jobs; an isolated claim takes one.
        ``skip``: keys to pass over; ``key``: claim that job only, if it is claimable.
        An ordinary claim (neither) starts its index scan after ``after`` (None: at the
        head; only where :attr:`claims_after`), and tells ``seen`` where its rows lay."""
        if isolated:
            limit = 1
        values = {q.OWNER_PARAM: owner, q.LIMIT_PARAM: limit, q.LEASE_PARAM: self.lease,
                  q.FRESH_PARAM: self.statement_deadline, **self._timeouts}
        if key is not None:
            values[q.LIMIT_PARAM] = limit = 1
            values[q.KEY_PARAM] = key
            by_key = self._statement("by_key", isolated)
            return ClaimRequest(owner, limit, isolated, None, key, in_flight, by_key, values)
        if skip is not None:
            values[q.SKIP_PARAM] = list(skip)
            claim, behind = self._statement("claim", isolated), self._statement("after_completion", isolated)
            return ClaimRequest(owner, limit, isolated, skip, None, in_flight, claim, values, behind)
        if isolated:
            claim, behind = self._claims[True]
            return ClaimRequest(owner, limit, True, None, None, in_flight, claim, values, behind)
        if after is not None:
            if self._cursor_claims is None:
                raise ValueError(f"claims of {self.table.name!r} cannot start after a key: its key is not an integer")
            self._bind_cursor(values, after)
            claim, behind = self._cursor_claims
            return ClaimRequest(owner, limit, False, None, None, in_flight, claim, values, behind, True, seen)
        claim, behind = self._claims[False]
        return ClaimRequest(owner, limit, False, None, None, in_flight, claim, values, behind, False, seen)

    def _bind_cursor(self, values: dict[str, Any], start: ClaimStart) -> None:
        """The cursor claim's start: one key, or one per queue served (a queue no job was
        claimed from yet starts at its head)."""
        names = self._cursor_queues
        if names is None:
            values[q.AFTER_PRIORITY_PARAM], values[q.AFTER_RUN_AFTER_PARAM], values[q.AFTER_KEY_PARAM] = start[None]
            return
        head: CursorStart = (q.HEAD_PRIORITY, _EPOCH, 0)
        each = [start.get(name, head) for name in names]
        values[q.AFTER_PRIORITIES_PARAM] = [s[0] for s in each]
        values[q.AFTER_RUN_AFTERS_PARAM] = [s[1] for s in each]
        values[q.AFTER_KEYS_PARAM] = [s[2] for s in each]

    def fetch_claimed(self, conn: DbConnection, request: ClaimRequest) -> list[Claimed]:
        """Run the claim ``request``; a row that cannot be read or loaded comes back with
        its problem, the others as model instances.

        The call is cut short after ``statement_deadline`` (its connection dropped, see
        :meth:`~sqla_queue.driver.Driver.deadline`); the rows are loaded after it, so the
        model's own code (a reconstructor, a slow type) never counts against it."""
        assert request.statement is not None and request.values is not None
        began = time.perf_counter()
        with self.driver.deadline(conn, self.statement_deadline):
            rows = conn.fetch_claimed(
                request.statement, request.values, self._pk_index, self._attempt_index, self._flow_turn
            )
        self._note(rows, request, time.perf_counter() - began)
        return self._claimed(rows, request.isolated)

    def _note(self, rows: Sequence[tuple[Any, ...] | RowError], request: ClaimRequest, took: float) -> None:
        """Tell the request's ``seen`` where the rows a claim took lay, and the ``took``
        seconds of its statement (the worker's cursor moves past them)."""
        seen = request.seen
        if seen is None:
            return
        priority, run_after, pk, queue = self._priority_index, self._run_after_index, self._pk_index, self._queue_index
        seen(
            [
                (row[priority], row[run_after], row[pk], row[queue])
                for row in rows  # the exact types first: no call for what psycopg gives
                if type(row) is not RowError
                and (type(row[run_after]) is datetime or isinstance(row[run_after], datetime))
            ],
            from_head=not request.from_cursor,
            took=took,
        )

    def complete_then_claim(
        self, conn: DbConnection, tokens: Sequence[ClaimToken], request: ClaimRequest,
        results: Sequence[str | None] | None = None, progress: Progress = None,
    ) -> tuple[Moved, list[Claimed]]:
        """Record ``tokens`` done under ``request.owner`` (with ``results`` as
        :meth:`complete` does) and run the claim ``request``, in one statement: one round
        trip, one transaction, one commit. Returns the tokens completed and the rows
        claimed. Under the deadline as :meth:`fetch_claimed`."""
        if self._flow_turn is not None:
            # A claim that takes turns holds the table's lock while it runs: the
            # completion commits first, on its own, so the lock is held for the claim
            # only, and the claim's count sees the keys the completion freed.
            return self.complete(conn, request.owner, tokens, results, progress), self.fetch_claimed(conn, request)
        stmt = request.after_completion
        assert stmt is not None and request.values is not None
        done: dict[Any, str] = {}  # keyed by plain (pk, attempt) tuples: equal to the tokens
        if self.stores_results:
            results = _results(results, tokens)
        if not self.stores_progress:
            progress = None
        if len(tokens) > TOKENS_PER_STATEMENT:  # the claim goes with the last part
            cut = -TOKENS_PER_STATEMENT
            done.update(self.complete(
                conn, request.owner, tokens[:cut], results[:cut] if results is not None else None,
                progress[:cut] if progress is not None else None,
            ))
            tokens = tokens[cut:]
            results = results[cut:] if results is not None else None
            progress = progress[cut:] if progress is not None else None
        stmt = self._for(stmt, tokens)
        values = token_values(request.owner, tokens)
        if results is not None:
            values[q.RESULTS_PARAM] = list(results)
        if progress is not None:
            values[q.PROGRESS_PARAM] = list(progress)
        values.update(request.values)
        pk, attempt = self._pk_index, self._attempt_index
        began = time.perf_counter()
        with self.driver.deadline(conn, self.statement_deadline):
            rows = conn.fetch_claimed(stmt, values, pk, attempt, self._flow_turn)
        took = time.perf_counter() - began
        # The last column tells a completed token's row from a claimed one.
        claimed = [row for row in rows if type(row) is RowError or not row[-1]]
        if len(claimed) < len(rows):
            completed = [row for row in rows if type(row) is not RowError and row[-1]]
            done.update({(row[pk], row[attempt]): "done" for row in completed})
            kept = self._child_ids_index  # on a table with workflows, the children each kept
            if kept is not None and any(row[kept] is not None for row in completed):
                self.on_owed()
        self._note(claimed, request, took)
        return cast(Moved, done), self._claimed(claimed, request.isolated)

    def _claimed(self, rows: list[tuple[Any, ...] | RowError], isolated: bool) -> list[Claimed]:
        pk, attempt = self._pk_index, self._attempt_index
        load = self._loader.load
        deadline = self._deadline_index
        found: list[Claimed] = []
        append = found.append
        for row in rows:
            if type(row) is RowError:
                problem = RowProblem("cannot read the row", row.error)
                append(_new_tuple(Claimed, (ClaimToken(row.pk, row.attempt), None, problem, False, None)))
                continue
            token = _new_tuple(ClaimToken, (row[pk], row[attempt]))
            solitary = isolated and is_solitary(row[self._isolated_index], row[self._last_error_index])
            timeout = None
            if deadline is not None and row[deadline[1]] is not None:
                timeout = _seconds_between(row[deadline[0]], row[deadline[1]])
            try:
                job = load(row)
            except Exception as exc:  # noqa: BLE001 - this row fails alone
                problem = RowProblem("cannot load the row as the model", exc)
                append(_new_tuple(Claimed, (token, None, problem, solitary, timeout)))
                continue
            append(_new_tuple(Claimed, (token, job, None, solitary, timeout)))
        children = self._child_ids_index
        if children is not None:  # the jobs no job waits for (see _for)
            self._note_leaves([c.token for c, row in zip(found, rows, strict=True)
                               if type(row) is not RowError and row[children] is None])
        return found

    #: The most tokens of jobs without children remembered; past it they are forgotten,
    #: which only costs their finishing statements the release (tokens a worker never
    #: finishes, whose leases it lost, are never taken out otherwise).
    LEAVES_KEPT = 100_000

    def _note_leaves(self, tokens: list[ClaimToken]) -> None:
        if len(self._leaves) + len(tokens) > self.LEAVES_KEPT:
            self._leaves.clear()
        self._leaves.update(tokens)

    def _for(self, stmt: Statement, tokens: Sequence[ClaimToken]) -> Statement:
        """``stmt``, or for tokens all of jobs without children, its twin without the
        release; the tokens are forgotten either way (their attempt ends here)."""
        leaves = self._leaves
        if not leaves:  # a table without workflows, or none noted
            return stmt
        twin = self._leaf_twins.get(id(stmt))
        chosen = twin if twin is not None and leaves.issuperset(tokens) else stmt
        leaves.difference_update(tokens)  # a snooze or a release (no twin) ends the attempt too
        return chosen

    def claim_candidates(
        self, conn: DbConnection, *, isolated: bool, limit: int, skip: Sequence[Any]
    ) -> list[Any]:
        """The keys the claim would take next, in its order, without claiming or locking
        them, passing over ``skip``."""
        rows = conn.execute(self._statement("candidates", isolated), {q.LIMIT_PARAM: limit, q.SKIP_PARAM: list(skip)})
        return [row[0] for row in rows]

    def fail_unclaimable(self, conn: DbConnection, key: Any, error: str) -> bool:
        """Dead-letter the pending job ``key``, which no claim can update, with ``error``;
        False when its row cannot be updated this way either (or is no longer pending)."""
        return bool(conn.execute(self._fail_unclaimable, {q.KEY_PARAM: key, q.ERROR_PARAM: error}))

    def release_lost_claims(self, conn: DbConnection, owner: str, keep: Sequence[ClaimToken]) -> list[Any]:
        """Back to ``pending``, attempt not counted, every job running under ``owner`` except
        the tokens ``keep`` (nothing once the statement is older than the deadline).
        Returns the keys given back."""
        values = token_values(owner, keep)
        values[q.FRESH_PARAM] = self.statement_deadline
        return [row[0] for row in conn.execute(self._release_lost, values)]

    def next_due(self, conn: DbConnection) -> float | None:
        """Seconds until the next delayed job of the queues falls due (zero or less: due
        already), None when none waits."""
        rows = conn.execute(self._next_due, {})
        seconds = rows[0][0] if rows else None
        return None if seconds is None else float(seconds)

    # -- outcomes ----------------------------------------------------------------------

    def complete(
        self, conn: DbConnection, owner: str, tokens: Sequence[ClaimToken], results: Sequence[str | None] | None = None,
        progress: Progress = None,
    ) -> Moved:
        """``done`` for every token ``owner`` still holds; on a table that keeps results,
        with each token's (``results``: JSON texts, None for none; None: none at all);
        on one that keeps progress, with each token's (``progress``: None for unchanged)."""
        lists = self._progress(progress)
        if self.stores_results:
            lists[q.RESULTS_PARAM] = _results(results, tokens)
        return self._move(conn, self._done, owner, tokens, "done", lists)

    def _progress(self, progress: Progress) -> dict[str, Sequence[Any]]:
        """The progress list of a transition, if the table keeps it and any is given."""
        if progress is None or not self.stores_progress:
            return {}
        return {q.PROGRESS_PARAM: progress}

    def retry(
        self, conn: DbConnection, owner: str, tokens: Sequence[ClaimToken], errors: Sequence[str],
        delays: Sequence[float], progress: Progress = None,
    ) -> Moved:
        """Each token back to ``pending`` after its delay (seconds) with its error, or
        ``failed`` once its attempts are used up: the status each was left in."""
        lists = {q.ERRORS_PARAM: errors, q.DELAYS_PARAM: delays, **self._progress(progress)}
        return self._move(conn, self._retry, owner, tokens, None, lists)

    def fail(
        self, conn: DbConnection, owner: str, tokens: Sequence[ClaimToken], errors: Sequence[str],
        progress: Progress = None,
    ) -> Moved:
        """Dead-letter each token now, with its error."""
        lists = {q.ERRORS_PARAM: errors, **self._progress(progress)}
        return self._move(conn, self._fail, owner, tokens, "failed", lists)

    def snooze(
        self, conn: DbConnection, owner: str, tokens: Sequence[ClaimToken], delays: Sequence[float],
        progress: Progress = None,
    ) -> Moved:
        """Each token back to ``pending`` after its delay (seconds), its attempt not
        counted (a snooze spends none)."""
        lists = {q.DELAYS_PARAM: delays, **self._progress(progress)}
        return self._move(conn, self._snooze, owner, tokens, "pending", lists)

    def release(
        self, conn: DbConnection, owner: str, tokens: Sequence[ClaimToken], *, refund: bool,
        errors: Sequence[str] | None = None, progress: Progress = None,
    ) -> Moved:
        """Back to ``pending`` at once; ``refund``: the attempt not counted (jobs never
        started, a connection the worker lost), ``max_attempts`` growing by one instead
        of ``attempts`` going back, so no token is handed out twice. ``errors`` (with
        ``refund`` only): each token's ``last_error``, empty for unchanged."""
        lists = self._progress(progress)
        if errors is not None and refund:
            return self._move(conn, self._release_noted, owner, tokens, "pending", {q.ERRORS_PARAM: errors, **lists})
        return self._move(conn, self._release[refund], owner, tokens, "pending", lists)

    def _move(
        self, conn: DbConnection, stmt: Statement, owner: str, tokens: Sequence[ClaimToken], status: str | None,
        lists: Mapping[str, Sequence[Any]] | None = None,
    ) -> Moved:
        """Run a transition over ``tokens``, one statement per part, each with its slice
        of ``lists`` (one value per token). ``status``: what every moved token was left
        in, or None when each row says (its third column)."""
        moved: Moved = {}
        stmt = self._for(stmt, tokens)
        for part in parts(len(tokens)):
            values = token_values(owner, tokens[part])
            for name, per_token in (lists or {}).items():
                values[name] = list(per_token[part])
            rows = conn.execute(stmt, values)
            if id(stmt) in self._owing:
                if any(row[-1] is not None for row in rows):
                    self.on_owed()
                rows = [row[:-1] for row in rows]
            if status is None:
                moved.update({cast(ClaimToken, (row[0], row[1])): row[2] for row in rows})
            else:
                moved.update(dict.fromkeys(cast(list[ClaimToken], rows), status))
        return moved

    def token_states(self, conn: DbConnection, job_ids: Sequence[Any]) -> list[TokenState]:
        """The state of the jobs ``job_ids``, read without locking: did a statement whose
        answer was lost land?"""
        rows = conn.execute(self._states, {q.IDS_PARAM: _int_array(list(job_ids))})
        return [TokenState(*row) for row in rows]

    def complete_in_transaction(
        self, sa: Connection, owner: str, token: ClaimToken, result: str | None = None, progress: str | None = None
    ) -> bool:
        """The fenced completion of ``token``, on the SQLAlchemy connection the handler's
        transaction runs on, so it commits with the handler's writes or not at all (with
        ``result``, its JSON text, on a table that keeps results). False when the lease
        was lost: roll back."""
        values = {q.OWNER_PARAM: owner, q.JOB_PARAM: token[0], q.ATTEMPT_PARAM: token[1]}
        if self._child_ids_index is not None:
            values[q.CHANNEL_PARAM] = self.channel
        if self.stores_results:
            values[q.RESULT_PARAM] = result
        if self.stores_progress:
            values[q.ONE_PROGRESS_PARAM] = progress
        leaf = token in self._leaves
        self._leaves.discard(token)
        row = sa.execute(self._complete_one_leaf if leaf else self._complete_one, values).first()
        if row is None:
            return False
        if not leaf and self._child_ids_index is not None and row[-1] is not None:
            if len(self._owed_in_transaction) >= self.LEAVES_KEPT:  # transactions that never committed
                self._owed_in_transaction.clear()
            self._owed_in_transaction.add(token)  # see committed()
        return True

    def committed(self, token: ClaimToken) -> None:
        """After the handler's transaction committed: children its completion kept are
        settled now (see ``on_owed``)."""
        if self._owed_in_transaction:
            try:
                self._owed_in_transaction.remove(token)
            except KeyError:
                return
            self.on_owed()

    def result_encoder(self, limit: int) -> Callable[[Any], str | None]:
        """A handler's return value as the JSON text the completion stores (the engine's
        ``json_serializer``, checked against the result column), or
        :class:`~sqla_queue.ResultNotStorable`."""
        column = result_column(self.table)
        if column is None:
            raise TypeError(f"table {self.table.name!r} keeps no results")
        return q.result_encoder(column, dialect_json_serializer(self.driver.dialect), limit)

    def progress_encoder(self, limit: int) -> Callable[[Any], str | None]:
        """A job's progress as the JSON text its beats and outcome store, or
        :class:`~sqla_queue.ResultNotStorable`."""
        if progress_column(self.table) is None:
            raise TypeError(f"table {self.table.name!r} keeps no progress")
        return progress_encoder(dialect_json_serializer(self.driver.dialect), limit)

    # -- the workers table ---------------------------------------------------------------

    def record_worker(self, conn: DbConnection, record: WorkerRecord) -> None:
        """Insert or update the worker's row in the workers table, seen now."""
        assert self._workers is not None
        values = {f"sqla_queue_worker_{k}": v for k, v in record._asdict().items()}
        values["sqla_queue_worker_queues"] = None if record.queues is None else json.dumps(list(record.queues))
        values["sqla_queue_worker_jobs"] = json.dumps([_jsonable(j) for j in record.jobs])
        conn.execute(self._workers[0], values)

    def forget_worker(self, conn: DbConnection, name: str) -> None:
        """Delete the worker's row (it stops)."""
        assert self._workers is not None
        conn.execute(self._workers[1], {"sqla_queue_worker_name": name})

    def prune_workers(self, conn: DbConnection, older_than: float) -> int:
        """Delete the rows no heartbeat updated for ``older_than`` seconds."""
        assert self._workers is not None
        return len(conn.execute(self._workers[2], {"sqla_queue_older_than": older_than}))

    # -- the activity table --------------------------------------------------------------

    def record_activity(self, conn: DbConnection) -> int:
        """Record each resolution's ended buckets not recorded yet (from the latest mark,
        at most a chunk: see :func:`~sqla_queue.activity.due_range`), then delete the rows
        past their keep. The server's clock decides what has ended. Returns the buckets
        recorded (the marks written: 0 when another worker recorded them first)."""
        assert self._activity is not None
        marks, records, prune = self._activity
        ((now, *latest),) = conn.execute(marks, {})
        recorded = 0
        for (resolution, record), mark in zip(records, latest, strict=True):
            due = due_range(now, mark, resolution)
            if due is None:
                continue
            since, until, sample = due
            values = {q.ACTIVITY_SINCE_PARAM: since, q.ACTIVITY_UNTIL_PARAM: until, q.ACTIVITY_SAMPLE_PARAM: sample}
            rows = conn.execute(record, values)
            recorded += sum(1 for _, queue in rows if queue == MARK_QUEUE)
        if recorded:
            conn.execute(prune, {})
        return recorded

    # -- leases ------------------------------------------------------------------------

    def extend_leases(
        self, conn: DbConnection, owner_prefix: str, tokens: Sequence[ClaimToken], *, since: float | None = None,
        progress: Progress = None,
    ) -> set[ClaimToken]:
        """Extend by the lease the tokens held by owners whose names start with
        ``owner_prefix``, stepping over rows another transaction has locked; ``since``
        (seconds): also every job of those owners whose lease was set that recently (a
        claim whose answer is not read yet), asked once, with the first part. Returns the
        tokens extended."""
        extended: set[ClaimToken] = set()
        for part in parts(len(tokens)):
            values = token_values(owner_prefix, tokens[part])
            values[q.LEASE_PARAM] = self.lease
            if progress is not None and self.stores_progress:
                values[q.PROGRESS_PARAM] = list(progress[part])
            if since is not None:
                values[q.SINCE_PARAM] = since
                since = None
            extended.update(cast(list[ClaimToken], conn.execute(self._extend, values)))
        return extended

    def owned_tokens(self, conn: DbConnection, owner_prefix: str, tokens: Sequence[ClaimToken]) -> set[ClaimToken]:
        """Which of ``tokens`` owners starting with ``owner_prefix`` still hold, read
        without locking."""
        owned: set[ClaimToken] = set()
        for part in parts(len(tokens)):
            owned.update(cast(list[ClaimToken], conn.execute(self._owned, token_values(owner_prefix, tokens[part]))))
        return owned

    def _compile(self, stmt: Any) -> Statement:
        """``stmt`` compiled by the driver, waking this worker's channel (see
        ``sql.CHANNEL_PARAM``) if it wakes any."""
        compiled = self.driver.compile(stmt)
        if compiled.defaults.get(q.CHANNEL_PARAM, self.channel) == self.channel:
            return compiled
        return dataclasses.replace(compiled, defaults={**compiled.defaults, q.CHANNEL_PARAM: self.channel})

    def settle_edges(self, conn: DbConnection, *, limit: int) -> int:
        """The children ended parents left to count down, counted (see ``sql.settle_edges``)."""
        stmt = self._settles.get(limit)
        if stmt is None:
            stmt = self._settles[limit] = self._compile(q.settle_edges(self.table, limit=limit))
        return len(conn.execute(stmt, {}))

    def sweep(self, conn: DbConnection, *, limit: int) -> SweepResult:
        """Up to ``limit`` expired leases back to ``pending`` (isolated), or ``failed``
        when their attempts are used up."""
        stmt = self._sweeps.get(limit)
        if stmt is None:
            lease = None if self.heartbeat is None else self.lease
            stmt = self._sweeps[limit] = self._compile(
                q.sweep_expired(self.table, limit=limit, lease=lease, heartbeat=self.heartbeat)
            )
        rows = conn.execute(stmt, {})
        return SweepResult(
            len(rows),
            sum(1 for row in rows if row[1] == "pending"),
            [row[0] for row in rows if row[1] == "failed"],
            sorted({row[2] for row in rows}),
            [SweptJob(row[0], row[1], row[2], row[3], row[4] if len(row) > 4 else None) for row in rows],
        )

    def hold_worker_lock(self, conn: DbConnection, owner: str) -> bool:
        """Take the session lock of the worker ``owner`` (its name ends with
        :data:`SESSION_MARK`) on ``conn``, the connection it keeps for its life: True
        once held, False while another session (its previous connection, not yet ended
        on the server) still holds it."""
        if self._worker_lock is None:
            self._worker_lock = self.driver.compile(q.hold_worker_lock())
        rows = conn.execute(self._worker_lock, {q.OWNER_PARAM: owner})
        return bool(rows and rows[0][0])

    # -- the rare statements -----------------------------------------------------------

    def _statement(self, kind: str, isolated: bool) -> Statement:
        found = self._rare.get((kind, isolated))
        if found is None:
            model, queues = self.model, self.queues
            if kind == "claim":
                stmt: Any = q.claim_template(model, queues=queues, isolated=isolated, skip=True, fresh=True)
            elif kind == "after_completion":
                stmt = q.complete_many_if_owner_then_claim(
                    model, queues=queues, isolated=isolated, skip=True, fresh=True
                )
            elif kind == "candidates":
                stmt = q.claim_candidates(model, queues=queues, isolated=isolated)
            else:
                stmt = q.claim_template(model, queues=queues, isolated=isolated, by_key=True, fresh=True)
            found = self._rare[(kind, isolated)] = self._compile(stmt)
        return found
