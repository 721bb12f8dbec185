"""Claiming: when to claim, how many, and the isolated-job policy.

Every executor thread claims for itself, on its own connection, when it has nothing to
run: there is no shared claim loop to hand jobs across threads. Idle threads wait on the
:class:`WorkSignal`, which a NOTIFY, a due timer (a delayed job, a retry) or the poll
interval ends. Jobs whose last lease expired (``isolated``: their worker may have died
running them) are claimed one at a time, and a worker runs at most one at once, beside
its ordinary jobs: a job that kills its worker costs an attempt only to the ordinary jobs
running with it, never to another isolated job, so a poison job cannot take innocent
ones down with it attempt after attempt.
"""

from __future__ import annotations

import heapq
import logging
import time
from typing import Any

from .. import sql as q
from ..driver import ClaimRequest, DbConnection, Driver, RowError
from ..model import QueueTable
from ..runtime import Condition, Semaphore
from ..sql import ClaimToken
from .config import WorkerConfig
from .ledger import Held, Ledger
from .loader import RowLoader
from .outcome import describe_error, storable

__all__ = ["Producer", "WorkSignal"]

#: Most threads of one worker claiming at the same moment. Concurrent SKIP LOCKED claims
#: step over each other's freshly locked rows, so past a few they cost more than they get:
#: the other threads run their jobs meanwhile, and record them without claiming.
CONCURRENT_CLAIMS = 4

#: ``ClaimToken(pk, attempt)`` without the named tuple's Python-level ``__new__``.
_new_token = tuple.__new__

log = logging.getLogger("sqla_queue.worker")

#: The pause before claiming again a job that is due but was not claimed (seconds).
MISSED_DUE_PAUSE = 0.002


class WorkSignal:
    """Wakes idle executor threads: one per NOTIFY, at due times, or at the poll."""

    def __init__(self, threads: int) -> None:
        self._cond = Condition()
        #: Pending wake-ups, never more than there are threads to wake: a busy thread
        #: claims again anyway, and piled-up tokens would cost as many empty claims.
        self._threads = threads
        self._tokens = 0
        self._due: list[float] = []
        self._stopped = False
        self.idle = 0
        #: Bumped by every wake-up; lets one idle thread per wake-up ask for due times.
        self.generation = 0

    def wake(self, count: int = 1) -> None:
        with self._cond:
            self._tokens = min(self._tokens + count, self._threads)
            self.generation += 1
            self._cond.notify(count)

    def wake_at(self, when: float) -> None:
        """Wake one idle thread at ``when`` (``time.monotonic()``)."""
        with self._cond:
            if len(self._due) > 1024:  # bounded: keep the soonest
                self._due = heapq.nsmallest(512, self._due)
                heapq.heapify(self._due)
            if not any(abs(due - when) < 0.005 for due in self._due):
                heapq.heappush(self._due, when)
            self._cond.notify(1)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def next_due(self) -> float | None:
        with self._cond:
            return self._due[0] if self._due else None

    def wait(self, poll: float) -> None:
        """Idle until woken, a due time, the poll, or stop."""
        with self._cond:
            self.idle += 1
            try:
                deadline = time.monotonic() + poll
                while not self._stopped:
                    if self._tokens:
                        self._tokens -= 1
                        return
                    now = time.monotonic()
                    if self._due and self._due[0] <= now:
                        heapq.heappop(self._due)
                        self.generation += 1
                        return
                    if now >= deadline:
                        self.generation += 1
                        return
                    until = min(deadline, self._due[0]) if self._due else deadline
                    self._cond.wait(until - now)
            finally:
                self.idle -= 1

    def quiet(self, threads: int, within: float) -> bool:
        """Every thread idle, no wake-up pending, and nothing due within ``within``."""
        with self._cond:
            due_soon = bool(self._due) and self._due[0] - time.monotonic() <= within
            return self.idle == threads and not self._tokens and not due_soon


class Producer:
    """Claims for an executor thread: statements compiled once, rows loaded one by one."""

    def __init__(
        self,
        config: WorkerConfig,
        ledger: Ledger,
        driver: Driver,
        qt: QueueTable,
        model: type[Any],
        owner: str,
        signal: WorkSignal,
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.signal = signal
        self.owner = owner
        # The model, not its table: a single-table-inheritance subclass claims its own rows.
        claims = model
        self._claim = driver.compile(q.claim_template(claims, queues=config.queues))
        self._claim_isolated = driver.compile(q.claim_template(claims, queues=config.queues, isolated=True))
        self._after_completion = driver.compile(q.complete_many_if_owner_then_claim(claims, queues=config.queues))
        self._isolated_after_completion = driver.compile(
            q.complete_many_if_owner_then_claim(claims, queues=config.queues, isolated=True)
        )
        self._next_due = driver.compile(q.next_run_after(claims, queues=config.queues))
        columns = list(qt.table.c)
        where = {id(c): n for n, c in enumerate(columns)}  # by identity: == makes SQL
        self._pk_index = where[id(qt.pk)]
        self._attempt_index = where[id(qt.c.attempts)]
        self._loader = RowLoader(model, columns, driver.dialect)
        self._lease = float(config.lease)
        self._gate = Semaphore(CONCURRENT_CLAIMS)
        self._isolated_after = 0.0  # monotonic time of the next look for isolated jobs
        self._checked_generation = -1

    def use_type_codes(self, type_codes: dict[str, int]) -> None:
        """The type codes of the claimed rows' columns (see :meth:`Driver.check_table`)."""
        self._loader.use_type_codes(type_codes)

    def look_for_isolated(self) -> None:
        """Look for isolated jobs at the next claim (the sweeper just made some)."""
        self._isolated_after = 0.0

    def request(self, limit: int) -> ClaimRequest | None:
        """The claim to run next: an isolated job when one may be waiting and this worker
        runs none, else up to ``limit`` ordinary jobs; None while leases are unhealthy."""
        if not self.ledger.healthy:
            return None
        if time.monotonic() >= self._isolated_after and self.ledger.take_isolated_slot():
            return ClaimRequest(
                self._claim_isolated, self._values(1), isolated=True, after_completion=self._isolated_after_completion,
                in_flight=self.ledger.claim_began(),
            )
        return ClaimRequest(self._claim, self._values(limit), after_completion=self._after_completion,
                            in_flight=self.ledger.claim_began())

    def accept(self, request: ClaimRequest, rows: list[tuple[Any, ...] | RowError]) -> list[Held]:
        """The held jobs of a claim's rows, added to the ledger."""
        try:
            if request.isolated:
                if not rows:
                    self.ledger.give_back_isolated_slot()
                    self._isolated_after = time.monotonic() + self.config.poll_interval
                else:
                    log.info("job %s: its last lease expired; running it alone", _token_of(rows[0], self))
            held = [self._held(row, request.isolated) for row in rows]
            self.ledger.add(held)
        finally:
            self.ledger.claim_ended(request.in_flight)
        return held

    def claim(self, conn: DbConnection, limit: int) -> list[Held]:
        with self._gate:
            request = self.request(limit)
            if request is None:
                return []
            try:
                rows = self.fetch(conn, request)
            except BaseException:
                self.unclaimed(request)
                raise
            held = self.accept(request, rows)
        if not held and request.isolated:
            return self.claim(conn, limit)  # no isolated job: ordinary ones, now
        return held

    def unclaimed(self, request: ClaimRequest) -> None:
        """``request`` did not run (or its rows were not read): free what it reserved."""
        self.ledger.claim_ended(request.in_flight)
        if request.isolated:
            self.ledger.give_back_isolated_slot()

    def try_enter(self) -> bool:
        """A place among the threads claiming now, if one is free (see CONCURRENT_CLAIMS)."""
        return self._gate.acquire(blocking=False)

    def leave(self) -> None:
        self._gate.release()

    def fetch(self, conn: DbConnection, request: ClaimRequest) -> list[tuple[Any, ...] | RowError]:
        return conn.fetch_claimed(request.statement, request.values, self._pk_index, self._attempt_index)

    @property
    def indexes(self) -> tuple[int, int]:
        """Where the key and the attempt are in a claimed row."""
        return self._pk_index, self._attempt_index

    def _values(self, limit: int) -> dict[str, Any]:
        return {q.OWNER_PARAM: self.owner, q.LIMIT_PARAM: limit, q.LEASE_PARAM: self._lease}

    def _held(self, row: tuple[Any, ...] | RowError, isolated: bool) -> Held:
        limit = self.config.max_error_length
        if isinstance(row, RowError):
            error = storable(f"cannot read the row: {describe_error(row.error, limit)}", limit)
            return Held(ClaimToken(row.pk, row.attempt), load_error=error, isolated=isolated)
        token = _new_token(ClaimToken, (row[self._pk_index], row[self._attempt_index]))
        try:
            job = self._loader.load(row)
        except Exception as exc:  # noqa: BLE001 - this row fails alone
            error = storable(f"cannot load the row as the model: {describe_error(exc, limit)}", limit)
            return Held(token, load_error=error, isolated=isolated)
        return Held(token, job=job, isolated=isolated)

    def wait_for_work(self, conn: DbConnection) -> None:
        """Nothing to claim: learn when the next delayed job falls due, then idle."""
        signal = self.signal
        if signal.generation != self._checked_generation:
            self._checked_generation = signal.generation
            rows = conn.execute(self._next_due, {})
            seconds = rows[0][0] if rows else None
            if seconds is not None:
                # Due already, yet the claim just missed it: another claim holds it, or
                # it fell due a moment after ours. Look again shortly, not in a loop.
                signal.wake_at(time.monotonic() + max(float(seconds), MISSED_DUE_PAUSE))
        signal.wait(self.config.poll_interval)


def _token_of(row: tuple[Any, ...] | RowError, producer: Producer) -> Any:
    return row.pk if isinstance(row, RowError) else row[producer.indexes[0]]
