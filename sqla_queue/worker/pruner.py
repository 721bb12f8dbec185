"""The pruner: deletes finished jobs past their retention, in bounded batches.

Off unless the worker is given a ``retention``. Each pass deletes batch after batch
(``retention_batch`` rows, each its own short transaction) until a batch comes back
short, then waits ``retention_interval``. Every batch takes the table's advisory lock
first, tried and never waited for, so with many workers at most one prunes a table at a
time (the others delete nothing that round). Only finished rows are touched, locked ones
skipped: pruning never waits for a claim, nor makes one wait.
"""

from __future__ import annotations

import logging

from ..ops import RetentionOps
from .context import WorkerContext
from .service import Reconnecting, Service

__all__ = ["Pruner"]

log = logging.getLogger("sqla_queue.worker")

#: A batch stuck longer than this (behind a table lock, a hung server) is cut short.
PRUNE_DEADLINE = 30.0


class Pruner(Service):
    name = "pruner"
    link: Reconnecting

    def __init__(self, ctx: WorkerContext, ops: RetentionOps) -> None:
        config, driver = ctx.config, ctx.driver
        super().__init__(config.retention_interval, reconnect_backoff=config.reconnect_backoff,
                         runtime=driver.runtime)
        self.driver = driver
        self.stats = ctx.stats
        self.ops = ops
        self.link = Reconnecting(driver, "sqla_queue pruner")

    def tick(self) -> float | None:
        conn = self.link.connect()
        with self.driver.deadline(conn, PRUNE_DEADLINE):
            deleted = self.ops.prune(conn)
        if deleted:
            self.stats.add("pruned", deleted)
            log.debug("pruner: %d finished job(s) deleted", deleted)
        return 0.0 if deleted >= self.ops.limit and not self.stopping else None
