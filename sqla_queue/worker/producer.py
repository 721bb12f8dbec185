"""Claiming: when to claim, how many, and the isolated-job policy.

Every executor thread claims for itself, on its own connection, when it has nothing to
run: there is no shared claim loop to hand jobs across threads. Idle threads wait on the
:class:`WorkSignal`, which a NOTIFY, a due timer (a delayed job, a retry) or the poll
interval ends. Ordinary claims start after the last job claimed: the producer keeps the
worker's :class:`~.cursor.ClaimCursor` and hands each claim its start, which the
operations layer only binds (:mod:`.cursor`).

Jobs whose last lease expired (``isolated``: their worker may have died running them) are
claimed alone, one per claim and never in a batch, but many at once: each executor of
every surviving worker takes one, so a dead worker's jobs all run again within about one
run time of the sweep. A job whose lease expired on two attempts in a row
(:func:`~sqla_queue.sql.is_solitary`) then runs with no other job in its worker: the
worker stops claiming, hands back its unstarted jobs and lets its running ones finish
first. So a job that kills its worker every time burns its own attempts, and an innocent
job loses at most two to it: once running beside it as an ordinary job, once beside it
while both were isolated.

Each executor claims under an owner name of its own (see :mod:`.ledger`): when a claim's
answer is lost with its connection, :meth:`Producer.recover` gives the rows it took back
with their attempt refunded, since their handlers never started. A claim that fails on a
row its UPDATE cannot change (a trigger that raises, a ``NOT VALID`` CHECK the row
violates) is made again one row at a time, and that row alone is passed over (and
dead-lettered with the database's message where an update of it is possible).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import psycopg

from ..driver import DbConnection, Driver
from ..jsontext import MAX_PROGRESS_SIZE
from ..model import ClaimToken
from ..ops import Claimed, ClaimRequest, RowProblem
from ..runtime import Semaphore
from .context import WorkerContext
from .cursor import ClaimCursor, spaced_by_cost
from .ledger import Held
from .outcome import describe_error, storable

__all__ = ["Producer"]

#: Most threads of one worker claiming at the same moment. Concurrent SKIP LOCKED claims
#: step over each other's freshly locked rows, so past a few they cost more than they get:
#: the other threads run their jobs meanwhile, and record them without claiming.
CONCURRENT_CLAIMS = 4

log = logging.getLogger("sqla_queue.worker")

#: The pause before claiming again a job that is due but was not claimed (seconds).
MISSED_DUE_PAUSE = 0.002
#: Seconds between two lookups of the next due time, at least. Every wake-up may bring a
#: delayed job, so the lookup follows wake-ups, but at 800 a second it would run 800
#: times a second; the wake-ups of one pause share the lookup made at its end.
NEXT_DUE_PAUSE = 0.05
#: The lookup reads the pending index, whose dead entries a held snapshot keeps (at 800
#: jobs/s, 2 ms a lookup after two minutes): the pause after one grows with its cost
#: (:func:`~.cursor.spaced_by_cost`), up to this.
MAX_NEXT_DUE_PAUSE = 0.5

#: How long a row no claim can update is passed over before it is tried again.
SKIP_SECONDS = 60.0
#: Most rows passed over at once: beyond that, the trouble is not a row's.
MAX_SKIPPED = 1000
#: Error classes that are not a row's fault (connection, transaction rollback, resources,
#: object state such as a lock timeout, operator intervention, system and internal errors).
_NOT_THE_ROWS_FAULT = frozenset({"08", "40", "53", "55", "57", "58", "XX"})


class Producer:
    """Claims for an executor thread: statements compiled once, rows loaded one by one."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.config = config = ctx.config
        self.ledger = ctx.ledger
        self.signal = ctx.signal
        self.owner = ctx.owner
        self.driver = ctx.driver
        self.ops = ctx.ops
        self._deadline = config.statement_deadline
        #: Keys of rows no claim can update, passed over until the time given.
        self._skip: dict[Any, float] = {}
        self._gate = Semaphore(CONCURRENT_CLAIMS)
        self._isolated_after = 0.0  # monotonic time of the next look for isolated jobs
        self._checked_generation = -1
        self._checked_woken = -1
        self._checked_dues = -1
        self._next_lookup = 0.0  # monotonic time the next due time may be looked up
        #: Where the ordinary claims start, shared by the executors (None: from the head,
        #: where the operations cannot start a claim after a key).
        self.cursor = ClaimCursor(per_queue=self.ops.after_per_queue) if self.ops.claims_after else None
        #: How a handler's progress is encoded, on a table that keeps it (None: it keeps none).
        self._progress = self.ops.progress_encoder(MAX_PROGRESS_SIZE) if self.ops.stores_progress else None

    def look_for_isolated(self) -> None:
        """Look for isolated jobs at the next claim (the sweeper just made some)."""
        self._isolated_after = 0.0

    def request(self, limit: int, owner: str) -> ClaimRequest | None:
        """The claim to run next, for the executor named ``owner``: an isolated job when
        one may be waiting and no other isolated claim is out, else up to ``limit``
        ordinary jobs; None while leases are unhealthy or a solitary job is held.
        A request that is returned must end in :meth:`accept` or :meth:`unclaimed`."""
        mark = self.ledger.begin_claim() if self.ledger.healthy else None
        if mark is None:
            return None
        skip = self._skipped()
        if time.monotonic() >= self._isolated_after and self.ledger.take_isolated_slot():
            return self.ops.claim_request(owner, 1, isolated=True, skip=skip, in_flight=mark)
        cursor = self.cursor
        if cursor is None or skip is not None:
            return self.ops.claim_request(owner, limit, skip=skip, in_flight=mark)
        return self.ops.claim_request(owner, limit, in_flight=mark, after=cursor.start(), seen=cursor.claimed)

    def accept(self, request: ClaimRequest, rows: list[Claimed]) -> list[Held]:
        """The held jobs of a claim's rows, added to the ledger."""
        try:
            held = self._held(rows, request)
            self.ledger.add(held)
        finally:
            self.ledger.end_claim(request.in_flight)
        if request.isolated:
            self.ledger.give_back_isolated_slot()
            if not held:
                self._isolated_after = time.monotonic() + self.config.poll_interval
            elif held[0].solitary:
                log.warning("job %s: its lease expired on its last two attempts; running it with no other "
                            "job in this worker", held[0].token.job_id)
            else:
                log.info("job %s: its last lease expired; running it alone in its batch", held[0].token.job_id)
                self.signal.wake()  # there may be more: another executor takes the next
        return held

    def claim(self, conn: DbConnection, limit: int, owner: str) -> list[Held]:
        """Claim for the executor named ``owner`` on its connection ``conn``."""
        with self._gate:
            request = self.request(limit, owner)
            if request is None:
                return []
            try:
                rows = self.ops.fetch_claimed(conn, request)  # under the statement deadline
            except Exception as exc:
                if self.driver.is_connection_error(exc):
                    self.ledger.claim_unknown(owner)  # it may have committed
                if not _rows_fault(exc, self.driver):
                    self.unclaimed(request)
                    raise
                try:
                    rows = self._claim_one_by_one(conn, request, exc)
                except BaseException:
                    self.unclaimed(request)
                    raise
            except BaseException:
                self.unclaimed(request)
                raise
            held = self.accept(request, rows)
        if not held and request.isolated:
            return self.claim(conn, limit, owner)  # no isolated job: ordinary ones, now
        return held

    def unclaimed(self, request: ClaimRequest) -> None:
        """``request`` did not run (or its rows were not read): free what it reserved."""
        if request.isolated:
            self.ledger.give_back_isolated_slot()
        self.ledger.end_claim(request.in_flight)

    # -- a claim whose answer was lost ---------------------------------------------------

    def recover(self, conn: DbConnection, owner: str) -> None:
        """Give back, attempt refunded, the rows a lost claim under ``owner`` took.

        Only this executor claims under ``owner``, one claim at a time, and it is not
        claiming now: every row running under that name, on another attempt than the
        jobs the worker holds or let go under it, was taken by a claim whose answer
        never arrived, so no handler ever saw it. Raises on a connection error (the
        recovery is made again after reconnecting).
        """
        keep = self.ledger.recovery(owner)
        try:
            with self.driver.deadline(conn, self._deadline):
                released = self.ops.release_lost_claims(conn, owner, keep)
        except Exception as exc:
            if self.driver.is_connection_error(exc):
                raise
            self.ledger.recovered(owner)
            log.error("%s: the rows of a claim whose answer was lost could not be given back (%s); they "
                      "return after their lease", owner, _first_line(exc))
            return
        self.ledger.recovered(owner)
        if released:
            log.warning("%d job(s) claimed by a claim whose answer was lost are pending again, attempt "
                        "refunded: %s", len(released), released[:20])
            self.signal.wake(len(released))

    # -- a claim that fails on one row -------------------------------------------------

    def _claim_one_by_one(self, conn: DbConnection, request: ClaimRequest, error: BaseException) -> list[Claimed]:
        """The claim failed with an error that may be one row's: claim its candidates one
        at a time, and pass over the rows that fail. Raises ``error`` again when the
        trouble is not a row's (the first two candidates fail and none claims)."""
        limit = request.limit
        isolated = request.isolated
        log.warning("%s: the claim failed (%s); claiming one job at a time to find the row it cannot update",
                    request.owner, _first_line(error))
        with self.driver.deadline(conn, self._deadline):
            keys = self.ops.claim_candidates(conn, isolated=isolated, limit=limit + 2, skip=list(self._skip))
        rows: list[Claimed] = []
        failed: list[tuple[Any, BaseException]] = []
        for key in keys:
            if len(rows) >= limit:
                break
            if len(failed) >= 2 and not rows:
                raise error  # every row fails: the claim itself does
            one = self.ops.claim_request(request.owner, 1, isolated=isolated, key=key)
            try:
                rows.extend(self.ops.fetch_claimed(conn, one))
            except Exception as exc:
                if self.driver.is_connection_error(exc):
                    self.ledger.claim_unknown(request.owner)
                    raise
                if not _rows_fault(exc, self.driver):
                    break  # a lock timeout, a cancel: not this row's doing; the rest next time
                failed.append((key, exc))
        if len(failed) >= 2 and not rows:
            raise error
        for key, why in failed:
            self._pass_over(conn, key, why, dead_letter=bool(rows))
        return rows

    def _pass_over(self, conn: DbConnection, key: Any, exc: BaseException, *, dead_letter: bool) -> None:
        """A row the claim cannot update: dead-letter it where an update of it is possible
        (only when other rows did claim, so a claim broken for every row fails none),
        else pass over it for a while. The dead letter is tried even where another
        executor of this worker passes over the row already: that one may have found
        no other row to claim, and a pass-over alone would keep the row pending."""
        reason = _first_line(exc)
        if dead_letter:
            error = storable(f"the claim cannot update this row: {describe_error(exc, self.config.max_error_length)}",
                             self.config.max_error_length)
            try:
                with self.driver.deadline(conn, self._deadline):
                    failed = self.ops.fail_unclaimable(conn, key, error)
            except Exception as fail_exc:  # the row cannot be updated at all
                if self.driver.is_connection_error(fail_exc):
                    raise
                failed = False
            if failed:
                self._skip.pop(key, None)
                log.error("job %s cannot be claimed (%s): dead-lettered", key, reason)
                return
        if self._skip.get(key, 0.0) > time.monotonic():
            return  # another executor of this worker found it first
        if len(self._skip) >= MAX_SKIPPED:
            log.error("job %s cannot be claimed (%s); %d rows are passed over already", key, reason, MAX_SKIPPED)
            return
        self._skip[key] = time.monotonic() + SKIP_SECONDS
        log.error("job %s cannot be claimed: the database says: %s; passing over it for %.0fs",
                  key, reason, SKIP_SECONDS)

    def _skipped(self) -> list[Any] | None:
        """The keys the claim must pass over now (None: none)."""
        if not self._skip:
            return None
        now = time.monotonic()
        for key in [k for k, until in self._skip.items() if until <= now]:
            del self._skip[key]
        return list(self._skip) if self._skip else None

    def try_enter(self) -> bool:
        """A place among the threads claiming now, if one is free (see CONCURRENT_CLAIMS)."""
        return self._gate.acquire(blocking=False)

    def leave(self) -> None:
        self._gate.release()

    def _held(self, rows: list[Claimed], request: ClaimRequest) -> list[Held]:
        isolated, owner = request.isolated, request.owner
        now = time.monotonic()
        held = [
            Held(token, job, None, isolated, solitary, owner)  # positional: the hot path, once per claimed row
            if problem is None and timeout is None
            else self._held_other(token, job, problem, solitary, timeout, isolated, owner, now)
            for token, job, problem, solitary, timeout in rows
        ]
        if self._progress is not None:
            for h in held:
                h.progress_encoder = self._progress
        return held

    def _held_other(self, token: ClaimToken, job: Any, problem: RowProblem | None, solitary: bool,
                    timeout: float | None, isolated: bool, owner: str, now: float) -> Held:
        """The held job of a row with a timeout or a problem (see :meth:`_held`)."""
        deadline = None if timeout is None else now + timeout
        if problem is None:
            return Held(token, job=job, isolated=isolated, solitary=solitary, owner=owner, timeout=timeout,
                        deadline=deadline)
        return Held(token, load_error=self._load_error(problem), isolated=isolated, solitary=solitary,
                    owner=owner, timeout=timeout, deadline=deadline)

    def _load_error(self, problem: RowProblem) -> str:
        limit = self.config.max_error_length
        return storable(f"{problem.what}: {describe_error(problem.error, limit)}", limit)

    def wait_for_work(self, conn: DbConnection) -> None:
        """Nothing to claim: learn when the next delayed job falls due, then idle.

        While no claim may begin (a solitary job held, the leases unhealthy), idle until
        woken or the poll, and no sooner: a job due now, or a claim from the head owed
        since before (:meth:`~.cursor.ClaimCursor.head_claim_at`, which only a claim
        pays), would wake this executor at once to claim nothing, round after round. On
        the event loop such a round never yields, so the loop, and the solitary job's
        own run, would stall for as long as the next-due lookup's spacing. The end of
        the solitary job, or the first healthy beat, wakes the executors."""
        signal = self.signal
        if not self.ledger.claims_open:
            signal.wait(self.config.poll_interval)
            return
        if signal.generation != self._checked_generation:
            now = time.monotonic()
            if now < self._next_lookup:
                # A wake-up during the pause may have brought a delayed job, and a due time
                # whose claim found nothing may have come a moment before the server's
                # ``run_after`` (a retry's wake-up is the client's estimate of it): the
                # lookup at the pause's end. (A poll brought none: the next one looks.)
                if signal.woken != self._checked_woken or signal.dues != self._checked_dues:
                    signal.wake_at(self._next_lookup)
            else:
                self._checked_generation = signal.generation
                self._checked_woken = signal.woken
                self._checked_dues = signal.dues
                with self.driver.deadline(conn, self._deadline):
                    seconds = self.ops.next_due(conn)
                took = time.monotonic() - now
                self._next_lookup = now + spaced_by_cost(took, NEXT_DUE_PAUSE, MAX_NEXT_DUE_PAUSE)
                if seconds is not None:
                    # Due already, yet the claim just missed it: another claim holds it, or
                    # it fell due a moment after ours. Look again shortly, not in a loop.
                    signal.wake_at(time.monotonic() + max(seconds, MISSED_DUE_PAUSE))
        # A job may wait before the claims' cursor: wake for the claim from the head that
        # finds it. Not while rows are passed over: every claim then starts at the head
        # and tells the cursor nothing, so the claim owed would stay owed, and its time,
        # past, would wake this executor at once after every claim that found nothing.
        head_claim = None if self.cursor is None or self._skip else self.cursor.head_claim_at()
        if head_claim is not None:
            signal.wake_at(head_claim)
        signal.wait(self.config.poll_interval)


def _rows_fault(exc: BaseException, driver: Driver) -> bool:
    """Whether a failed claim may have failed on one of its rows (a trigger that raised,
    a constraint the row violates, a value out of range), not for a reason of its own."""
    if driver.is_connection_error(exc) or not isinstance(exc, psycopg.Error):
        return False
    state = exc.sqlstate
    return state is not None and state[:2] not in _NOT_THE_ROWS_FAULT


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
