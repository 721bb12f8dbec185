"""The completer: the one path by which every outcome reaches the database.

Outcomes are recorded in batches, one fenced statement per kind (a call of the
operations layer, :mod:`sqla_queue.ops`, tokens as arrays), on the executor's own
connection. A statement that moves fewer tokens than it was given tells which leases
were lost meanwhile. One retry policy covers the database: connection errors are
retried (the statements are fenced, so a repeat cannot do harm) until the lease would
have lapsed anyway; when an earlier try may have landed (its answer lost with its
connection), the rows the repeat did not move are read, and those in the state it would
have left them in count as recorded, not lost; any other error falls back to recording
each job alone with a minimal error text, and a job that still cannot be recorded is let
go, so its lease expires and the sweeper returns it. Every statement runs under the
executors' deadline (``statement_deadline``), so a connection that stops answering is
dropped and the statement retried on a new one. Each statement is fenced by the lease
owner its jobs were claimed under (their executor's). Whatever happened, each job's end
passes :meth:`Completer.settle`, once. The one statement that records done outcomes with
the next claim is the executor's (:class:`~.executor.CompleteThenClaim`): the completer
hands it those outcomes and settles what it moved (:meth:`Completer.settle_completed`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ..current import CANCELLED
from ..driver import DbConnection
from ..model import ClaimToken
from ..ops import Moved, TokenState
from ..runtime import sleep
from .context import WorkerContext
from .hooks import JobEvent, JobOutcome
from .ledger import Held
from .outcome import Kind, Outcome
from .watchdog import tell_cancelled

__all__ = ["Completer"]

log = logging.getLogger("sqla_queue.worker")


class Completer:
    def __init__(self, ctx: WorkerContext) -> None:
        self.config = config = ctx.config
        self.ledger = ctx.ledger
        self.driver = ctx.driver
        self.ops = ctx.ops
        self.owner = ctx.owner
        self.stats = ctx.stats
        self.hooks = ctx.hooks
        self.signal = ctx.signal
        self._deadline = config.statement_deadline

    def record(
        self,
        connect: Callable[[], DbConnection],
        outcomes: Sequence[Outcome],
        *,
        claim_owner: str | None = None,
    ) -> list[Outcome]:
        """Record ``outcomes``; ``connect()`` gives the (re)connected connection to use.

        ``claim_owner``: the owner of the claim the caller runs next. Done outcomes, all
        claimed under it, are then not recorded here but returned (still held, marked
        finishing, the lost ones settled), for the caller to record with that claim in
        one statement (the executor's ``ops.complete_then_claim``, one round trip) and
        hand back what it moved (:meth:`settle_completed`), or its error
        (:meth:`complete_after_failure`). Returns those ([] when none is left to the
        caller: every outcome was recorded here)."""
        by_kind: dict[tuple[Kind, bool], list[Outcome]] = {}
        committed: list[Outcome] = []
        lost: list[Held] = []
        cancelled: list[Outcome] = []
        # The hot path: every outcome done (as the loop below would sort it), no call a job.
        done = [o for o in outcomes if o.kind is Kind.DONE and o.held.stopped != CANCELLED and not o.held.lost]
        if len(done) < len(outcomes):  # some other outcome: sort them all
            done = []
            for outcome in outcomes:
                kind = outcome.kind
                if kind is Kind.CANCELLED or outcome.held.stopped == CANCELLED:
                    # Told after its handler returned: the row says cancelled all the same.
                    cancelled.append(outcome)
                elif outcome.held.lost or kind is Kind.LOST:
                    lost.append(outcome.held)
                elif kind is Kind.DONE:
                    done.append(outcome)
                elif kind is Kind.COMMITTED:
                    committed.append(outcome)
                else:
                    by_kind.setdefault((kind, outcome.refund), []).append(outcome)
        if committed:  # recorded by the handler's own transaction
            self.settle([Settled(o.held, "done", o) for o in committed])
        if cancelled:  # recorded by the cancel itself
            self.settle([Settled(o.held, "cancelled", o) for o in cancelled])
        if lost:
            self._refused_by_cancel(connect, [h for h in lost if not h.lost])  # refused by a cancel?
            self._lost(lost, "lease lost while running")
        for (kind, refund), group in by_kind.items():
            sure = [o for o in group if not o.unsure]
            unsure = [o for o in group if o.unsure]
            if sure:
                self._record_kind(connect, kind, sure, refund=refund)
            if unsure:  # a transactional commit whose answer was lost: the row says
                self._record_kind(connect, kind, unsure, refund=refund, maybe_landed=True)
        if not done:
            return []
        # One statement is fenced by one owner: the claim's (an older name claims apart).
        if claim_owner is None or [o for o in done if o.held.owner != claim_owner]:
            self._record_kind(connect, Kind.DONE, done)
            return []
        alive = set(self.ledger.finishing([o.held for o in done]))
        self._lost([o.held for o in done if o.held not in alive], "lease lost while running")
        return [o for o in done if o.held in alive]

    def settle_completed(
        self, connect: Callable[[], DbConnection], outcomes: list[Outcome], moved: Moved, sent: float
    ) -> None:
        """The caller's statement (sent at ``sent``) recorded the done ``outcomes``
        :meth:`record` returned, and moved ``moved``: settle them (the tokens it did not
        move were lost, or refused by a cancel)."""
        self._refused_by_cancel(connect, [o.held for o in outcomes if o.held.token not in moved])
        self._settle(Kind.DONE, outcomes, moved, sent)

    def complete_after_failure(
        self, connect: Callable[[], DbConnection], outcomes: list[Outcome], exc: Exception
    ) -> None:
        """The caller's statement recording the done ``outcomes`` :meth:`record`
        returned raised ``exc``; it is never retried (what else it did may have committed
        unseen): they are recorded the usual way."""
        log.warning("recording %d done outcome(s) with the next claim failed (%s)", len(outcomes), exc)
        for o in outcomes:
            o.held.finishing = False
        # A cut connection may have committed the completion unseen: read back what
        # the repeat does not move before calling any of it lost.
        self._record_kind(connect, Kind.DONE, outcomes, maybe_landed=self.driver.is_connection_error(exc))

    def hand_back(self, connect: Callable[[], DbConnection], held: Sequence[Held], *, refund: bool) -> None:
        """Jobs back to ``pending`` at once; ``refund`` for those never started."""
        self._record_kind(connect, Kind.RELEASE, [Outcome(h, Kind.RELEASE) for h in held], refund=refund)

    def release_now(self, conn: DbConnection, held: Sequence[Held], *, refund: bool) -> None:
        """Shutdown: ``held`` back to ``pending`` on ``conn``, one statement per owner and
        no retry (the caller bounds the time); an error is the caller's."""
        owners = {h.owner for h in held}
        for owner in owners:
            group = [Outcome(h, Kind.RELEASE) for h in held if h.owner == owner]
            alive = set(self.ledger.finishing([o.held for o in group]))
            outcomes = [o for o in group if o.held in alive]
            if outcomes:
                sent = time.monotonic()
                self._settle(Kind.RELEASE, outcomes, self._run(conn, Kind.RELEASE, outcomes, refund), sent)

    # -- one kind ----------------------------------------------------------------------

    def _record_kind(
        self,
        connect: Callable[[], DbConnection],
        kind: Kind,
        group: list[Outcome],
        *,
        refund: bool = True,
        maybe_landed: bool = False,
    ) -> None:
        """``maybe_landed``: an earlier try of this recording may have committed with its
        answer lost, so rows the statement does not move are read back (see _landed)."""
        owners = {o.held.owner for o in group}
        if len(owners) > 1:  # each statement is fenced by one owner
            for owner in owners:
                self._record_kind(connect, kind, [o for o in group if o.held.owner == owner],
                                  refund=refund, maybe_landed=maybe_landed)
            return
        alive = set(self.ledger.finishing([o.held for o in group]))
        self._lost([o.held for o in group if o.held not in alive], "lease lost while running")
        outcomes = [o for o in group if o.held in alive]
        if not outcomes:
            return
        try:
            moved, sent, retried = self._with_retries(connect, lambda conn: self._run(conn, kind, outcomes, refund))
        except Exception as exc:  # noqa: BLE001 - fall back to one job at a time
            if len(outcomes) > 1 or kind in (Kind.RETRY, Kind.FAIL):
                log.warning("recording %d %s outcome(s) failed (%s); one at a time", len(outcomes), kind.value, exc)
                for outcome in outcomes:
                    self._record_alone(connect, outcome, refund, maybe_landed)
                return
            log.error("job %s: could not record %s (%s); its lease will expire",
                      outcomes[0].held.token.job_id, kind.value, exc)
            self.ledger.lose([o.held for o in outcomes])
            return
        if retried or maybe_landed:
            moved = self._landed(connect, kind, outcomes, moved, refund)
        self._refused_by_cancel(connect, [o.held for o in outcomes if o.held.token not in moved])
        self._settle(kind, outcomes, moved, sent)

    def _record_alone(
        self, connect: Callable[[], DbConnection], outcome: Outcome, refund: bool, maybe_landed: bool = False
    ) -> None:
        attempts = [outcome]
        if outcome.kind in (Kind.RETRY, Kind.FAIL):
            safe = Outcome(outcome.held, outcome.kind, "the error text could not be stored", outcome.delay)
            attempts.append(safe)
        for candidate in attempts:

            def run(conn: DbConnection, c: Outcome = candidate) -> Moved:
                return self._run(conn, c.kind, [c], refund)

            try:
                moved, sent, retried = self._with_retries(connect, run)
            except Exception as exc:  # noqa: BLE001
                log.warning("job %s: recording %s failed: %s", outcome.held.token.job_id, candidate.kind.value, exc)
                continue
            if retried or maybe_landed:
                moved = self._landed(connect, candidate.kind, [candidate], moved, refund)
            self._refused_by_cancel(connect, [candidate.held] if candidate.held.token not in moved else [])
            self._settle(candidate.kind, [candidate], moved, sent)
            return
        log.error("job %s: no outcome could be recorded; its lease will expire", outcome.held.token.job_id)
        self.ledger.lose([outcome.held])

    def _run(self, conn: DbConnection, kind: Kind, outcomes: list[Outcome], refund: bool) -> Moved:
        tokens = [o.held.token for o in outcomes]
        owner = outcomes[0].held.owner  # one owner per statement (see _record_kind)
        ops = self.ops
        progress = progress_of(outcomes) if ops.stores_progress else None
        if kind is Kind.DONE:
            if ops.stores_results:
                return ops.complete(conn, owner, tokens, [o.result for o in outcomes], progress)
            return ops.complete(conn, owner, tokens, progress=progress)
        if kind is Kind.RETRY:
            return ops.retry(conn, owner, tokens, [o.error for o in outcomes], [o.delay for o in outcomes], progress)
        if kind is Kind.FAIL:
            return ops.fail(conn, owner, tokens, [o.error for o in outcomes], progress)
        if kind is Kind.RELEASE:
            errors = [o.error for o in outcomes] if refund and any(o.error for o in outcomes) else None
            return ops.release(conn, owner, tokens, refund=refund, errors=errors, progress=progress)
        if kind is Kind.SNOOZE:
            return ops.snooze(conn, owner, tokens, [o.delay for o in outcomes], progress)
        raise AssertionError(kind)

    def _with_retries(
        self, connect: Callable[[], DbConnection], work: Callable[[DbConnection], Any]
    ) -> tuple[Any, float, bool]:
        """``work``'s result, when its successful try began, and whether an earlier try
        failed (it may have landed all the same). Connection errors are retried until
        about a lease has passed; the rest raise."""
        give_up = time.monotonic() + self.config.lease
        failures = 0
        while True:
            conn: DbConnection | None = None
            try:
                conn = connect()
                began = time.monotonic()
                with self.driver.deadline(conn, self._deadline):
                    return work(conn), began, failures > 0
            except Exception as exc:
                if not self.driver.is_connection_error(exc) or time.monotonic() >= give_up:
                    raise
                if conn is not None:
                    # A connection that still looks sound (one to a read-only standby)
                    # is no place to try again: the next try connects anew.
                    conn.close()
                failures += 1
                delay = min(0.05 * 2**failures, self.config.reconnect_backoff)
                log.warning("recording outcomes: %s; retrying in %.2fs", type(exc).__name__, delay)
                sleep(delay)

    def _landed(
        self,
        connect: Callable[[], DbConnection],
        kind: Kind,
        outcomes: list[Outcome],
        moved: Moved,
        refund: bool,
    ) -> Moved:
        """``moved`` by a statement that went through on a retry, plus each outcome it did
        not move that an earlier try had recorded (that answer was lost with its
        connection): the job is in the state ``kind`` leaves it in, by this owner and
        attempt. The rest stay missed: lost."""
        missed = [o for o in outcomes if o.held.token not in moved]
        if not missed:
            return moved
        ids = [o.held.token.job_id for o in missed]
        try:
            states, _, _ = self._with_retries(connect, lambda conn: self.ops.token_states(conn, ids))
        except Exception as exc:  # noqa: BLE001 - count them lost, as the fence said
            log.warning("could not read back %d outcome(s) after a retry (%s)", len(missed), exc)
            return moved
        by_pk = {state.job_id: state for state in states}
        found = dict(moved)
        for o in missed:
            state = by_pk.get(o.held.token.job_id)
            status = None if state is None else _landed_as(kind, o, state, o.held.owner, refund)
            if status is not None:
                found[o.held.token] = status
        return found

    # -- bookkeeping -------------------------------------------------------------------

    def _settle(self, kind: Kind, outcomes: list[Outcome], moved: Moved, sent: float) -> None:
        """What a fenced statement of ``kind`` did to ``outcomes``: each token in ``moved``
        was recorded (with the status it was left in), the others had been re-claimed or
        swept. ``sent``: when the statement went out (a retry's wake-up counts from then)."""
        results: list[Settled] = []
        missed: list[Held] = []
        append = results.append
        if kind is Kind.DONE:  # the hot path: a tuple per job and no call
            done = [o for o in outcomes if o.held.token in moved]
            if len(done) < len(outcomes):
                missed = [o.held for o in outcomes if o.held.token not in moved]
            for o in done:
                if o.unsure:
                    _commit_landed(o.held.token)
            results = [_new_settled(Settled, (o.held, "done", o, None, "")) for o in done]
        else:
            for o in outcomes:
                status = moved.get(o.held.token)
                if status is None:
                    missed.append(o.held)
                elif o.unsure and status == "done":
                    _commit_landed(o.held.token)
                    append(Settled(o.held, "done", o))
                elif kind is Kind.RELEASE:
                    append(Settled(o.held, "released", o))
                elif kind is Kind.RETRY and status != "failed":
                    append(Settled(o.held, "retried", o, wake_at=sent + o.delay))
                elif kind is Kind.SNOOZE:
                    append(Settled(o.held, "snoozed", o, wake_at=sent + o.delay))
                else:
                    append(Settled(o.held, "failed", o))
        self.settle(results)
        if missed:
            self._lost(missed, "re-claimed or swept before its outcome was recorded", settled=True)

    def _lost(self, held: list[Held], why: str, *, settled: bool = False) -> None:
        """Jobs whose lease is gone: settled as lost, those not already known lost
        counted and logged. ``settled``: a fenced statement matched none of their rows
        (see Ledger.lose). A job whose row was found cancelled on its attempt (told after
        its handler returned, see :meth:`_refused_by_cancel`) is not lost but cancelled: the
        cancel is what refused its outcome."""
        cancelled = [h for h in held if h.stopped == CANCELLED]
        if cancelled:
            held = [h for h in held if h.stopped != CANCELLED]
            newly = self.ledger.lose(cancelled, settled=True)  # no longer running under its owner
            self.settle([Settled(h, "cancelled", None) for h in newly], forgotten=True)
        newly = self.ledger.lose(held, settled=settled)
        self.settle([Settled(h, "lost", None, why=why) for h in newly], forgotten=True)

    def _refused_by_cancel(self, connect: Callable[[], DbConnection], held: list[Held]) -> None:
        """Of jobs whose outcome the database refused, mark those whose row reads
        ``cancelled`` on their attempt (a cancel that committed after their handler
        returned, before anyone told the worker), so they are counted as cancelled, not
        lost. One read, only when something was refused; if it fails they count as lost."""
        held = [h for h in held if h.stopped is None]
        if not held:
            return
        try:
            conn = connect()
            with self.driver.deadline(conn, self._deadline):
                tell_cancelled(self.ops, conn, held, running=False)
        except Exception as exc:  # noqa: BLE001 - they count as lost, as the fence said
            log.debug("could not read back %d refused outcome(s) (%s)", len(held), exc)

    def settle(self, results: Sequence[Settled], *, forgotten: bool = False) -> None:
        """The one place every job's end in this worker passes: done (by the completer's
        statement or the handler's own transaction), retried, failed, handed back,
        snoozed or lost. It hands their ends to the worker's hooks (:class:`~.hooks.Hooks`:
        the counters, the log lines, the observers) and then forgets the jobs, in that
        order: whoever sees a job leave :meth:`~sqla_queue.Worker.held` (or the worker go
        idle) finds it counted. ``forgotten``: the ledger has let go of them already (lost
        jobs), or their executor will when their handler returns (the jobs the heartbeat
        found lost)."""
        if not results:
            return
        hooks = self.hooks
        every = hooks.wants_every_end()  # else only the ends that log above DEBUG
        counts: dict[str, int] = {}
        events: list[JobEvent] = []
        append = events.append
        event = hooks.event
        for r in results:
            status = r.status
            if status in counts:
                counts[status] += 1
            else:
                counts[status] = 1
            o = r.outcome
            if status == "done" or status == "released":  # the hot path: no event unless wanted
                if every:
                    append(event(r.held, _OUTCOMES[status], _first(o.error) if o is not None else ""))
            elif o is None:
                append(event(r.held, _OUTCOMES[status], r.why))
            elif status == "retried" or status == "snoozed":  # back to pending after a delay
                if r.wake_at is not None:
                    self.signal.wake_at(r.wake_at)
                append(event(r.held, _OUTCOMES[status], _first(o.error), o.delay, o.error))
            else:
                append(event(r.held, _OUTCOMES[status], _first(o.error), None, o.error))
        hooks.count(counts)
        hooks.finished(events)
        if not forgotten:
            self.ledger.remove([r.held for r in results])


#: Settled.status -> the outcome observers see.
_OUTCOMES = {o.value: o for o in JobOutcome}


class Settled(NamedTuple):
    """How one job's run ended in this worker: ``done``, ``retried``, ``failed`` (dead
    letter), ``released`` (handed back), ``snoozed``, ``cancelled`` or ``lost`` (its lease
    was gone): each the name of the :class:`~sqla_queue.WorkerStats` counter it adds to."""

    held: Held
    status: str
    outcome: Outcome | None
    wake_at: float | None = None
    why: str = ""


#: Settled's fields all given: the tuple made without NamedTuple's keyword handling.
_new_settled = tuple.__new__

def _landed_as(kind: Kind, outcome: Outcome, state: TokenState, owner: str, refund: bool) -> str | None:
    """The status ``outcome``'s statement left the job in, if ``state`` is what it left;
    None if someone else moved it (a sweep, another worker)."""
    _, attempts, status, lease_owner, isolated, last_error = state
    attempt = outcome.held.token.attempt
    ours = lease_owner == owner and attempts == attempt  # a dead letter keeps its owner
    if outcome.unsure and status == "done" and ours:
        return "done"  # the handler's transaction committed the completion itself
    if kind is Kind.DONE:
        return "done" if status == "done" and ours else None
    if kind is Kind.FAIL:
        return "failed" if status == "failed" and ours else None
    released = status == "pending" and lease_owner is None
    if kind is Kind.RETRY:
        if status == "failed" and ours:
            return "failed"
        # Back to pending with this error: a sweep writes its own and marks the job isolated.
        return "pending" if released and attempts == attempt and not isolated and last_error == outcome.error else None
    if kind is Kind.RELEASE or kind is Kind.SNOOZE:
        swept = (last_error or "").startswith(f"lease expired: worker {owner} did not finish attempt {attempt} ")
        # No attempt is ever given back (``max_attempts`` grows instead): the row keeps it.
        return "pending" if released and attempts == attempt and not swept else None
    return None


def progress_of(outcomes: Sequence[Outcome]) -> list[str | None] | None:
    """Each job's progress as its handler last recorded it (None: unchanged), or None
    when none of them recorded any."""
    found = [o.held.progress for o in outcomes]
    return found if any(p is not None for p in found) else None


def _commit_landed(token: ClaimToken) -> None:
    """The handler's transaction, whose answer was lost, had committed the job done."""
    log.info("job %s attempt %d: its commit had landed; done", token.job_id, token.attempt)


def _first(text: str) -> str:
    return text.splitlines()[0] if text else ""
