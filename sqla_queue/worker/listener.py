"""LISTEN for committed jobs and wake an idle executor.

The listener holds one dedicated autocommit connection (a connection idle in a
transaction receives nothing). NOTIFY is not durable: notifications sent while the
connection is down are lost, so after every (re)connect it wakes an executor once, and
idle executors poll on their own timer regardless.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .context import WorkerContext
from .service import Reconnecting, Service
from .sweeper import SWEPT_PREFIX

__all__ = ["Listener"]

log = logging.getLogger("sqla_queue.worker")


class Listener(Service):
    name = "listener"
    link: Reconnecting

    def __init__(
        self, ctx: WorkerContext, *, timeout: float = 0.25, on_swept: Callable[[], None] | None = None
    ) -> None:
        driver, queues = ctx.driver, ctx.config.queues
        super().__init__(0.0, reconnect_backoff=ctx.config.reconnect_backoff, runtime=driver.runtime)
        self.driver = driver
        self.channel = channel = ctx.ops.channel
        self.signal = ctx.signal
        self.queues = set(queues) if queues is not None else None
        self.timeout = timeout
        #: Called when a sweeper says it returned jobs of these queues (isolated now).
        self.on_swept = on_swept
        self.link = Reconnecting(driver, "sqla_queue listener", listen=channel)

    @property
    def connections(self) -> int:
        """Connections made so far; above 1 means it reconnected."""
        return self.link.connections

    def tick(self) -> float:
        made = self.link.connections
        conn = self.link.connect()
        if self.link.connections != made:
            if self.link.connections > 1:
                log.info("listener: reconnected; polling once for jobs sent meanwhile")
            self.signal.wake()  # jobs committed while we were not listening
        payloads = self.driver.notifies(conn, self.timeout)
        relevant = [p for p in payloads if self.queues is None or p in self.queues]
        swept = [p for p in payloads if p.startswith(SWEPT_PREFIX)]
        if swept and self.on_swept is not None and (
            self.queues is None or any(p[len(SWEPT_PREFIX):] in self.queues for p in swept)
        ):
            self.on_swept()
        if relevant:
            self.signal.wake(len(relevant))
        return 0.0

    def request_stop(self) -> None:
        """Stop at once: the wait for notifications is cut short, not waited out."""
        super().request_stop()
        conn = self.link.conn
        if conn is not None:
            self.driver.abort(conn, quiet=True)
