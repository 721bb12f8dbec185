"""LISTEN for committed jobs and wake an idle executor.

The listener holds one dedicated autocommit connection (a connection idle in a
transaction receives nothing). NOTIFY is not durable: notifications sent while the
connection is down are lost, so after every (re)connect it wakes an executor once, and
idle executors poll on their own timer regardless.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from ..driver import DbConnection, Driver
from .config import WorkerConfig
from .service import Service
from .sweeper import SWEPT_PREFIX
from .work_signal import WorkSignal

__all__ = ["Listener"]

log = logging.getLogger("sqla_queue.worker")


class Listener(Service):
    name = "listener"

    def __init__(
        self, config: WorkerConfig, driver: Driver, channel: str, signal: WorkSignal,
        *, queues: Collection[str] | None = None, timeout: float = 0.25,
        on_swept: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(0.0, reconnect_backoff=config.reconnect_backoff, runtime=driver.runtime)
        self.driver = driver
        self.channel = channel
        self.signal = signal
        self.queues = set(queues) if queues is not None else None
        self.timeout = timeout
        #: Called when a sweeper says it returned jobs of these queues (isolated now).
        self.on_swept = on_swept
        self._conn: DbConnection | None = None
        #: Connections made so far; above 1 means it reconnected.
        self.connections = 0

    def tick(self) -> float:
        conn = self._conn
        if conn is None or conn.broken:
            self.close()
            self._conn = conn = self.driver.connect("sqla_queue listener", listen=self.channel)
            self.connections += 1
            if self.connections > 1:
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
        conn = self._conn
        if conn is not None:
            self.driver.abort(conn, quiet=True)

    def on_error(self, exc: BaseException) -> None:
        self.close()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
