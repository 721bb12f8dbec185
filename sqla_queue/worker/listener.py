"""LISTEN for committed jobs and wake an idle executor; learn of cancelled jobs.

The listener holds one dedicated autocommit connection (a connection idle in a
transaction receives nothing). NOTIFY is not durable: notifications sent while the
connection is down are lost, so after every (re)connect it wakes an executor once, and
idle executors poll on their own timer regardless.

That connection lives as long as the worker, so it also holds the worker's session
lock (:meth:`~sqla_queue.ops.Operations.hold_worker_lock`), taken again on each new
connection: once the worker's process dies, its sessions end with it and a sweep
returns its jobs without waiting for their leases to run out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..control import Cancel, Swept, Wake, parse
from ..driver import DbConnection
from .context import WorkerContext
from .service import Reconnecting, Service
from .watchdog import tell_cancelled

__all__ = ["Listener"]

#: The longest the read of cancelled jobs' rows, or the taking of the session lock, may take.
CANCEL_CHECK_SECONDS = 10.0

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
        self.ledger = ctx.ledger
        self.ops = ctx.ops
        self.queues = set(queues) if queues is not None else None
        self.timeout = timeout
        #: Called when a sweeper says it returned jobs of these queues (isolated now).
        self.on_swept = on_swept
        self.link = Reconnecting(driver, "sqla_queue listener", listen=channel)
        #: The name whose session lock this connection holds once ``locked`` (see :mod:`.listener`).
        self.owner = ctx.owner
        self.locked = False

    @property
    def connections(self) -> int:
        """Connections made so far; above 1 means it reconnected."""
        return self.link.connections

    def tick(self) -> float:
        made = self.link.connections
        conn = self.link.connect()
        if self.link.connections != made:
            self.locked = False
        if not self.locked:
            self._hold_lock(conn)
        if self.link.connections != made:
            if self.link.connections > 1:
                log.info("listener: reconnected; polling once for jobs sent meanwhile")
            self.signal.wake()  # jobs committed while we were not listening
            self._hear_cancels(conn, None)  # and cancels: their NOTIFYs were lost too
        payloads = self.driver.notifies(conn, self.timeout)
        if not payloads:
            return 0.0
        messages = [parse(p) for p in payloads]
        woken = 0
        swept = False
        cancelled: set[str] = set()
        for message in messages:
            if isinstance(message, Wake):
                woken += self.queues is None or message.queue in self.queues
            elif isinstance(message, Swept):
                swept = swept or self.queues is None or message.queue in self.queues
            elif isinstance(message, Cancel):
                cancelled |= message.ids
        if swept and self.on_swept is not None:
            self.on_swept()
        if woken:
            self.signal.wake(woken)
        if cancelled:
            self._hear_cancels(conn, cancelled)
        return 0.0

    def _hold_lock(self, conn: DbConnection) -> None:
        """Take the worker's session lock on this connection; tried again on the next
        round while its previous connection, ending on the server, still holds it."""
        with self.driver.deadline(conn, CANCEL_CHECK_SECONDS):
            self.locked = self.ops.hold_worker_lock(conn, self.owner)
            self.driver.listen(conn, self.channel)  # the last statement names the channel again

    def _hear_cancels(self, conn: DbConnection, ids: set[str] | None) -> None:
        """Cancels were committed: tell the running attempts of ``ids`` this worker holds
        (None: of every job it runs, after a time it was not listening), once their rows
        say so (the row has the last word)."""
        held = [h for h in self.ledger.live() if h.started and (ids is None or str(h.token.job_id) in ids)]
        if held:
            with self.driver.deadline(conn, CANCEL_CHECK_SECONDS):
                tell_cancelled(self.ops, conn, held)
                self.driver.listen(conn, self.channel)  # the last statement names the channel again

    def request_stop(self) -> None:
        """Stop at once: the wait for notifications is cut short, not waited out."""
        super().request_stop()
        conn = self.link.conn
        if conn is not None:
            self.driver.abort(conn, quiet=True)
