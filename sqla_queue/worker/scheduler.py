"""The scheduler: enqueues the jobs of periodic schedules, each tick exactly once.

Every worker given schedules runs one; none is a leader. At each tick of a schedule, each
scheduler opens a transaction on its own connection, claims the tick by moving the
schedule's watermark row forward (:meth:`~sqla_queue.ops.ScheduleOps.claim_tick`) and, if
its update matched, inserts the tick's job before committing. The others wait on that
row's lock, then match nothing; if the claiming worker dies before its commit, its
transaction rolls back with the job, and the next claim (the waiting worker's) enqueues
the tick instead. A tick is claimed if and only if its job exists.

Both the wait and the transaction are bounded (:data:`TICK_LOCK_TIMEOUT`,
:data:`TICK_IDLE_TIMEOUT`): a worker frozen inside its claim (SIGSTOP, a paused VM) would
otherwise hold the row, and stall the schedule on every worker, for as long as it stays
frozen. The server ends its transaction instead, and another worker claims the tick.

Ticks come from the worker's clock (:attr:`Scheduler.clock`), each job runs from its
tick on (``run_after``). After an outage the latest missed tick is enqueued, and as many
earlier ones as the schedule's ``backfill``; a schedule seen for the first time starts
with its next tick.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import suppress
from datetime import UTC, datetime
from typing import Any

import psycopg
from sqlalchemy import func, select
from sqlalchemy.exc import DBAPIError

from ..ops import ScheduleOps
from ..periodic import Schedule
from .context import WorkerContext
from .service import Reconnecting, Service

__all__ = ["Scheduler"]

log = logging.getLogger("sqla_queue.worker")

#: Longest sleep between two looks at the clock (a clock set forward is noticed by then).
MAX_WAIT = 30.0
#: A claim and its inserts stuck longer than this (behind a lock, a hung server) are cut short.
CLAIM_DEADLINE = 15.0
#: Longest wait for a watermark row another worker holds (``lock_timeout``): the claim
#: gives up and is tried again soon, so one held row does not stall every schedule.
TICK_LOCK_TIMEOUT = 1.0
#: Longest time the tick's transaction may sit idle between statements
#: (``idle_in_transaction_session_timeout``): a worker stopped inside it (SIGSTOP, a
#: paused VM) has its transaction ended by the server, which releases the watermark
#: row and rolls its job back, so another worker claims the tick.
TICK_IDLE_TIMEOUT = 3.0
#: How soon a claim that found the watermark row held is tried again.
BUSY_RETRY = 0.25


def utc_now() -> datetime:
    return datetime.now(UTC)


class Scheduler(Service):
    name = "scheduler"
    link: Reconnecting

    def __init__(self, ctx: WorkerContext, ops: ScheduleOps, schedules: Sequence[Schedule]) -> None:
        config, driver = ctx.config, ctx.driver
        super().__init__(MAX_WAIT, reconnect_backoff=config.reconnect_backoff, runtime=driver.runtime)
        self.driver = driver
        self.stats = ctx.stats
        self.ops = ops
        self.schedules = tuple(schedules)
        #: What "now" is: a test may replace it (an aware datetime).
        self.clock: Callable[[], datetime] = utc_now
        #: The latest tick of each schedule this scheduler handled (claimed, or found
        #: claimed): it is not asked again before the next one.
        self.handled: dict[str, datetime] = {}
        #: Schedules whose watermark row another worker held at the last pass: the
        #: next pass comes after :data:`BUSY_RETRY`, not at the next tick.
        self.busy: set[str] = set()
        self.link = Reconnecting(driver, "sqla_queue scheduler")

    def check(self) -> None:
        """Fail fast when the watermark table is missing (see :func:`~sqla_queue.schedules_table`)."""
        self.ops.check_table(self.driver)

    def tick(self) -> float:
        self.run_due(self.clock())
        if self.busy:
            return BUSY_RETRY
        now = self.clock()
        soonest = min(schedule.next_tick(now) for schedule in self.schedules)
        return min(max((soonest - now).total_seconds(), 0.0), MAX_WAIT)

    def run_due(self, now: datetime) -> dict[str, list[Any]]:
        """Claim the latest tick at or before ``now`` of every schedule not handled yet;
        returns, per schedule claimed here, the keys of the jobs it enqueued."""
        enqueued: dict[str, list[Any]] = {}
        for schedule in self.schedules:
            tick = schedule.latest_tick(now)
            seen = self.handled.get(schedule.name)
            if seen is not None and seen >= tick:
                continue
            try:
                keys = self._claim(schedule, tick)
            except Exception as exc:
                if _lock_not_available(exc):
                    # Another worker holds the watermark row: it commits (then the
                    # tick is found claimed) or its transaction ends (then it is ours).
                    log.debug("scheduler: schedule %r: watermark held by another worker; trying again",
                              schedule.name)
                    self.busy.add(schedule.name)
                    continue
                self.busy.discard(schedule.name)
                if self.driver.is_connection_error(exc):
                    raise  # the service reconnects; the tick is tried again
                # A mistake of the schedule's own (its values callable raised, a value the
                # table refuses): nothing was written; the next tick tries again.
                log.error("scheduler: schedule %r: tick %s not enqueued: %s: %s",
                          schedule.name, tick.isoformat(), type(exc).__name__, exc)
                self.link.reset()
                self.handled[schedule.name] = tick
                continue
            self.busy.discard(schedule.name)
            self.handled[schedule.name] = tick
            if keys is not None:
                enqueued[schedule.name] = keys
                if keys:
                    self.stats.add("scheduled", len(keys))
                    log.info("scheduler: schedule %r: tick %s enqueued (%d job(s))",
                             schedule.name, tick.isoformat(), len(keys))
        return enqueued

    def _claim(self, schedule: Schedule, tick: datetime) -> list[Any] | None:
        """Claim ``tick`` and insert its jobs in one transaction: the keys inserted, or
        None when the tick was claimed already."""
        conn = self.link.connect()
        with self.driver.deadline(conn, CLAIM_DEADLINE):
            conn.set_autocommit(False)
            sa = conn.sa
            trans = sa.begin()
            try:
                sa.execute(_BOUNDS)
                claimed, previous = self.ops.claim_tick(sa, schedule.name, tick)
                keys: list[Any] = []
                if claimed and previous is not None:
                    keys = [self.ops.enqueue_tick(sa, schedule, missed) for missed in schedule.missed(previous, tick)]
                trans.commit()
            finally:
                with suppress(Exception):
                    if trans.is_active:
                        trans.rollback()
                try:
                    conn.set_autocommit(True)
                except Exception:  # noqa: BLE001 - a broken connection: make a new one
                    self.link.reset()
        return keys if claimed else None


#: The bounds of a tick's transaction, for that transaction only (``set_config(…, true)``
#: is ``SET LOCAL``): how long its claim waits for a held watermark row, and how long
#: it may sit idle before the server ends it.
_BOUNDS = select(
    func.set_config("lock_timeout", f"{int(TICK_LOCK_TIMEOUT * 1000)}ms", True),
    func.set_config("idle_in_transaction_session_timeout", f"{int(TICK_IDLE_TIMEOUT * 1000)}ms", True),
)


def _lock_not_available(exc: BaseException) -> bool:
    """The claim gave up waiting for a watermark row (SQLSTATE 55P03)."""
    cause = exc.orig if isinstance(exc, DBAPIError) else exc
    return isinstance(cause, psycopg.errors.LockNotAvailable)
