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
owner its jobs were claimed under (their executor's).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..driver import DbConnection
from ..ops import Claimed, ClaimRequest, Moved, TokenState
from ..runtime import sleep
from .context import WorkerContext
from .ledger import Held
from .outcome import Kind, Outcome

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
        self.signal = ctx.signal
        self._deadline = config.statement_deadline

    def record(
        self,
        connect: Callable[[], DbConnection],
        outcomes: Sequence[Outcome],
        *,
        then: ClaimRequest | None = None,
    ) -> list[Claimed] | None:
        """Record ``outcomes``; ``connect()`` gives the (re)connected connection to use.

        ``then``: a claim to run in the same statement as the ``done`` one (one
        transaction, one round trip); its rows are returned (None when it was not run:
        claim yourself)."""
        done_kind = Kind.DONE
        done_list: list[Outcome] = []
        by_kind: dict[Kind, list[Outcome]] = {}
        committed: list[Held] = []
        lost: list[Held] = []
        for outcome in outcomes:
            kind = outcome.kind
            if outcome.held.lost or kind is Kind.LOST:
                lost.append(outcome.held)
            elif kind is done_kind:
                done_list.append(outcome)
            elif kind is Kind.COMMITTED:
                committed.append(outcome.held)
            else:
                by_kind.setdefault(kind, []).append(outcome)
        if done_list:
            by_kind[done_kind] = done_list
        if committed:
            self.ledger.remove(committed)
            self.stats.add("done", len(committed))
        if lost:
            self._lost(lost, "lease lost while running")
        done = by_kind.pop(Kind.DONE, None)
        for kind, group in by_kind.items():
            sure = [o for o in group if not o.unsure]
            unsure = [o for o in group if o.unsure]
            if sure:
                self._record_kind(connect, kind, sure)
            if unsure:  # a transactional commit whose answer was lost: the row says
                self._record_kind(connect, kind, unsure, maybe_landed=True)
        if done is None:
            return None
        if then is None:
            self._record_kind(connect, Kind.DONE, done)
            return None
        return self._done_then_claim(connect, done, then)

    def _done_then_claim(
        self,
        connect: Callable[[], DbConnection],
        group: list[Outcome],
        claim: ClaimRequest,
    ) -> list[Claimed] | None:
        if any(o.held.owner != claim.owner for o in group):  # claimed under an older name
            self._record_kind(connect, Kind.DONE, group)
            return None
        alive = set(self.ledger.finishing([o.held for o in group]))
        self._lost([o.held for o in group if o.held not in alive], "lease lost while running")
        outcomes = [o for o in group if o.held in alive]
        if not outcomes:
            return None
        tokens = [o.held.token for o in outcomes]
        # Sent once, not retried: if the connection drops, the claim may have committed
        # unseen. Its rows are given back before the next claim (Producer.recover), and
        # the completion is recorded again on its own (fenced: a repeat does no harm).
        try:
            conn = connect()
            sent = time.monotonic()
            moved, claimed = self.ops.complete_then_claim(conn, tokens, claim)  # under the statement deadline
        except Exception as exc:  # noqa: BLE001 - record the usual way, claim apart
            cut = self.driver.is_connection_error(exc)
            if cut:
                self.ledger.claim_unknown(claim.owner)
            log.warning("recording %d done outcome(s) with the next claim failed (%s)", len(outcomes), exc)
            for o in outcomes:
                o.held.finishing = False
            # A cut connection may have committed the completion unseen: read back what
            # the repeat does not move before calling any of it lost.
            self._record_kind(connect, Kind.DONE, outcomes, maybe_landed=cut)
            return None
        self._settle(Kind.DONE, outcomes, moved, sent)
        return claimed

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
            self._settle(candidate.kind, [candidate], moved, sent)
            return
        log.error("job %s: no outcome could be recorded; its lease will expire", outcome.held.token.job_id)
        self.ledger.lose([outcome.held])

    def _run(self, conn: DbConnection, kind: Kind, outcomes: list[Outcome], refund: bool) -> Moved:
        tokens = [o.held.token for o in outcomes]
        owner = outcomes[0].held.owner  # one owner per statement (see _record_kind)
        if kind is Kind.DONE:
            return self.ops.complete(conn, owner, tokens)
        if kind is Kind.RETRY:
            return self.ops.retry(conn, owner, tokens, [o.error for o in outcomes], [o.delay for o in outcomes])
        if kind is Kind.FAIL:
            return self.ops.fail(conn, owner, tokens, [o.error for o in outcomes])
        if kind is Kind.RELEASE:
            return self.ops.release(conn, owner, tokens, refund=refund)
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
        """``moved``: the tokens the statement moved, and the status each was left in.
        ``sent``: when the statement went out. The server stamped a retry's ``run_after``
        from its clock as the statement ran, so the wake-up counts from then, not from the
        answer, which a slow write or commit may have held back."""
        recorded = [o for o in outcomes if o.held.token in moved]
        missed = [o.held for o in outcomes if o.held.token not in moved]
        self.ledger.remove(o.held for o in recorded)
        if missed:
            self._lost(missed, "re-claimed or swept before its outcome was recorded", settled=True)
        committed = [o for o in recorded if o.unsure and moved[o.held.token] == "done"]
        if committed:  # the transactional commit had landed after all (see Outcome.unsure)
            self.stats.add("done", len(committed))
            for o in committed:
                log.info("job %s attempt %d: its commit had landed; done", o.held.token.job_id, o.held.token.attempt)
            landed = {id(o) for o in committed}
            recorded = [o for o in recorded if id(o) not in landed]
        if kind is Kind.DONE:
            self.stats.add("done", len(recorded))
        elif kind is Kind.FAIL:
            self.stats.add("failed", len(recorded))
            for o in recorded:
                log.error("job %s attempt %d dead-lettered: %s",
                          o.held.token.job_id, o.held.token.attempt, _first(o.error))
        elif kind is Kind.RELEASE:
            self.stats.add("released", len(recorded))
        elif kind is Kind.RETRY:
            for o in recorded:
                status = moved[o.held.token]
                if status == "failed":
                    self.stats.add("failed")
                    log.error("job %s attempt %d failed for good (dead letter): %s",
                              o.held.token.job_id, o.held.token.attempt, _first(o.error))
                else:
                    self.stats.add("retried")
                    self.signal.wake_at(sent + o.delay)
                    log.warning("job %s attempt %d failed: %s; retrying in %.1fs",
                                o.held.token.job_id, o.held.token.attempt, _first(o.error), o.delay)

    def _lost(self, held: list[Held], why: str, *, settled: bool = False) -> None:
        """Forget jobs whose lease is gone; count and log those not already known lost.
        ``settled``: a fenced statement matched none of their rows (see Ledger.lose)."""
        newly = self.ledger.lose(held, settled=settled)
        if newly:
            self.stats.add("lost", len(newly))
        for h in newly:
            log.warning("job %s attempt %d: %s; its result was not recorded", h.token.job_id, h.token.attempt, why)


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
    if kind is Kind.RELEASE:
        swept = (last_error or "").startswith(f"lease expired: worker {owner} did not finish attempt {attempt} ")
        left = attempt - 1 if refund else attempt
        return "pending" if released and attempts == left and not swept else None
    return None


def _first(text: str) -> str:
    return text.splitlines()[0] if text else ""
