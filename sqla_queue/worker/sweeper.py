"""The sweeper: returns the jobs of dead workers (expired leases) to ``pending``, and on a
table with workflows counts down the children that parents left to count down (a
:class:`~sqla_queue.control.Settle` message wakes it for those at once).

Swept jobs are marked ``isolated`` (their worker may have died running them) or
dead-lettered when their attempts are used up. It wakes this worker's executors to look
for isolated jobs at once, and NOTIFYs the queues it swept (the control messages of
:func:`~sqla_queue.control.swept_payloads`: a :class:`~sqla_queue.control.Swept` each, and
the plain names for workers that only know queue names) so the executors of every worker
claim the returned jobs without waiting for their poll.

On a queue table with an activity table (:func:`~sqla_queue.activity_table`) it also
records the buckets of time that have ended since the last sweep of any worker: a
statement per bucket size, after the sweep, whose failure never fails the sweep.
"""

from __future__ import annotations

import logging
import time

from ..control import SWEPT_PREFIX, swept_payloads
from ..driver import DbConnection
from ..registry import FORGET_AFTER_LEASES
from .context import WorkerContext
from .hooks import JobEvent, JobOutcome
from .producer import Producer
from .service import Reconnecting, Service

__all__ = ["SWEPT_PREFIX", "Sweeper"]

log = logging.getLogger("sqla_queue.worker")

SWEEP_LIMIT = 1000
#: A sweep stuck longer than this (behind a table lock, a hung server) is cut short.
SWEEP_DEADLINE = 10.0


class Sweeper(Service):
    name = "sweeper"
    link: Reconnecting

    def __init__(self, ctx: WorkerContext, producer: Producer) -> None:
        config, driver = ctx.config, ctx.driver
        super().__init__(config.sweep_interval, reconnect_backoff=config.reconnect_backoff, runtime=driver.runtime)
        self.driver = driver
        self.stats = ctx.stats
        self.hooks = ctx.hooks
        self.owner = ctx.owner
        self.producer = producer
        self.signal = ctx.signal
        self.ops = ctx.ops
        self.channel = ctx.ops.channel
        self.link = Reconnecting(driver, "sqla_queue sweeper")
        self.lease = config.lease
        self._activity_failed_at = self._settle_failed_at = float("-inf")

    def tick(self) -> float | None:
        conn = self.link.connect()
        with self.driver.deadline(conn, SWEEP_DEADLINE):
            if self.ops.records_workers:  # the rows of workers that died without stopping
                self.ops.prune_workers(conn, FORGET_AFTER_LEASES * self.lease)
            swept = self.ops.sweep(conn, limit=SWEEP_LIMIT)
            queues = swept.queues
            if queues:
                self.driver.notify(conn, self.channel, swept_payloads(queues))
        settled = self._settle(conn) if self.ops.settles_edges else 0
        if self.ops.records_activity:
            self._record_activity(conn)
        if swept.total:
            hooks = self.hooks
            hooks.finished([
                JobEvent(hooks.table, j.queue, j.task, j.job_id, j.attempt, JobOutcome.SWEPT,
                         error=f"lease expired; {j.status}", worker=self.owner)
                for j in swept.jobs
            ], count=True)
            dead = swept.dead
            log.warning(
                "sweeper: %d expired lease(s): %d back to pending (isolated), %d dead-lettered %s",
                swept.total, swept.back, len(dead), dead[:20] if dead else "",
            )
            self.producer.look_for_isolated()
            self.signal.wake()
        return 0.0 if SWEEP_LIMIT in (swept.total, settled) else None

    def _settle(self, conn: DbConnection) -> int:
        """Count the children ended parents left to count down (see ``sql.settle_edges``).
        It waits for their rows, so a transaction holding one can cut it short: never the
        sweep's failure, and the next tick (or the next NOTIFY) settles them."""
        try:
            with self.driver.deadline(conn, SWEEP_DEADLINE):
                settled = self.ops.settle_edges(conn, limit=SWEEP_LIMIT)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            now = time.monotonic()
            if now - self._settle_failed_at > 60:
                self._settle_failed_at = now
                log.warning("sweeper: could not settle the children parents left to count down (%s)", exc)
            return 0
        if settled:
            log.debug("sweeper: %d parent(s) counted down their children", settled)
        return settled

    def _record_activity(self, conn: DbConnection) -> None:
        """The activity table's ended buckets. Never the sweep's failure: a bucket not
        recorded now is recorded by the next sweep of any worker."""
        try:
            with self.driver.deadline(conn, SWEEP_DEADLINE):
                recorded = self.ops.record_activity(conn)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            now = time.monotonic()
            if now - self._activity_failed_at > 60:
                self._activity_failed_at = now
                log.warning("sweeper: could not record the activity table (%s)", exc)
            return
        if recorded:
            log.debug("sweeper: %d bucket(s) of activity recorded", recorded)
