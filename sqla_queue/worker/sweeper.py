"""The sweeper: returns the jobs of dead workers (expired leases) to ``pending``.

Swept jobs are marked ``isolated`` (their worker may have died running them) or
dead-lettered when their attempts are used up. It wakes this worker's executors to look
for isolated jobs at once, and NOTIFYs the queues it swept (marked with
:data:`SWEPT_PREFIX`, and plain for workers that only know queue names) so the executors
of every worker claim the returned jobs without waiting for their poll.
"""

from __future__ import annotations

import logging

from .. import sql as q
from ..driver import DbConnection, Driver
from ..model import QueueTable
from .config import WorkerConfig
from .producer import Producer
from .service import Service
from .stats import WorkerStats
from .work_signal import WorkSignal

__all__ = ["SWEPT_PREFIX", "Sweeper"]

log = logging.getLogger("sqla_queue.worker")

SWEEP_LIMIT = 1000
#: Marks a NOTIFY payload ``SWEPT_PREFIX + queue``: jobs of that queue were just swept.
SWEPT_PREFIX = "sqla_queue.swept:"
#: A sweep stuck longer than this (behind a table lock, a hung server) is cut short.
SWEEP_DEADLINE = 10.0


class Sweeper(Service):
    name = "sweeper"

    def __init__(
        self,
        config: WorkerConfig,
        driver: Driver,
        qt: QueueTable,
        stats: WorkerStats,
        producer: Producer,
        signal: WorkSignal,
    ) -> None:
        super().__init__(config.sweep_interval, reconnect_backoff=config.reconnect_backoff, runtime=driver.runtime)
        self.driver = driver
        self.stats = stats
        self.producer = producer
        self.signal = signal
        self.channel = driver.channel(qt.table)
        table = qt.table
        sweep = q.sweep_expired(table, limit=SWEEP_LIMIT).returning(table.c.queue)
        self._sweep = driver.compile(sweep)
        self._conn: DbConnection | None = None

    def tick(self) -> float | None:
        conn = self._conn
        if conn is None or conn.broken:
            self.close()
            self._conn = conn = self.driver.connect("sqla_queue sweeper")
        with self.driver.deadline(conn, SWEEP_DEADLINE):
            swept = conn.execute(self._sweep, {})
            if swept:
                queues = sorted({row[2] for row in swept})
                # The queue names wake idle workers; the marked ones also tell them that
                # isolated jobs wait (a claim of one each, at once, not at the next poll).
                self.driver.notify(conn, self.channel, [*queues, *(SWEPT_PREFIX + queue for queue in queues)])
        if swept:
            self.stats.add("swept", len(swept))
            back = sum(1 for row in swept if row[1] == "pending")
            dead = [row[0] for row in swept if row[1] == "failed"]
            log.warning(
                "sweeper: %d expired lease(s): %d back to pending (isolated), %d dead-lettered %s",
                len(swept), back, len(dead), dead[:20] if dead else "",
            )
            self.producer.look_for_isolated()
            self.signal.wake()
        return 0.0 if len(swept) == SWEEP_LIMIT else None

    def on_error(self, exc: BaseException) -> None:
        self.close()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
