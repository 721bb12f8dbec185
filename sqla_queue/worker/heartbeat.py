"""The heartbeat: keeps the leases of every held job, on a connection of its own.

One statement per beat extends every token (arrays: any number of jobs). It skips rows
another transaction has locked (a handler updating its own job row) instead of waiting
for them, and asks which of the skipped tokens are still owned, so only a job that is
really gone is reported lost. While a claim is in flight, the same statement also
extends the worker's jobs whose lease was set since that claim began: the rows of a
claim whose answer waits unread (an event loop blocked by a handler) are the worker's
before their tokens reach the ledger, and must not lapse meanwhile. Each beat runs
under a deadline: a hung connection is cut and replaced. If no beat succeeded for a
whole lease, the sweeper may already have handed the jobs to others: the worker stops
claiming and treats what it holds as lost. A lost job's end passes the completer's
:meth:`~.completer.Completer.settle`, as every job's end does.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from importlib.metadata import PackageNotFoundError, version

from ..driver import AsyncDriver
from ..model import ClaimToken
from ..ops import WorkerRecord
from ..registry import LISTED_JOBS
from .completer import Completer, Settled
from .context import WorkerContext
from .ledger import Held
from .service import Reconnecting, Service
from .watchdog import tell_cancelled

__all__ = ["Heartbeat"]

log = logging.getLogger("sqla_queue.worker")


class Heartbeat(Service):
    name = "heartbeat"
    own_thread = True
    link: Reconnecting

    def __init__(self, ctx: WorkerContext, completer: Completer) -> None:
        config, driver = ctx.config, ctx.driver
        super().__init__(config.effective_heartbeat, reconnect_backoff=config.reconnect_backoff, runtime=driver.runtime)
        self.config = config
        self.ledger = ctx.ledger
        self.driver = driver
        self.owner = ctx.owner
        self.stats = ctx.stats
        self.ops = ctx.ops
        self.signal = ctx.signal
        #: Every job's end passes its settle: a lost one too.
        self.completer = completer
        # Every executor claims under a name of its own, each starting with "{owner}/".
        self._owners = f"{ctx.owner}/"
        self.link = Reconnecting(driver, "sqla_queue heartbeat")
        self._last_ok = time.monotonic()
        #: What the workers table says of this worker, if the queue table has one.
        self._record = WorkerRecord(
            ctx.owner, socket.gethostname()[:255], os.getpid(), config.queues, config.concurrency,
            "asyncio" if isinstance(driver, AsyncDriver) else "thread", _version(),
        ) if ctx.ops.records_workers else None
        self._record_failed_at = 0.0

    def tick(self) -> None:
        self._check_health()
        held = self.ledger.live()
        since = self.ledger.claims_since()
        if held or since is not None or not self.ledger.healthy:  # recover only on a beat that reached the table
            lost = self._beat(held, since)
            if lost:  # a cancelled row is not running any more either: its handler is told
                conn = self.link.connect()
                with self.driver.deadline(conn, self.config.heartbeat_deadline):
                    told = tell_cancelled(self.ops, conn, [h for h in held if h.token in lost and h.started])
                lost -= {h.token for h in told}
            gone = [h for h in held if h.token in lost and self.ledger.mark_lost(h) is not None]
            # Marked, not forgotten: the executor running each lets go of it when its handler returns.
            self.completer.settle([Settled(h, "lost", None, why="lease lost (re-claimed or swept)") for h in gone],
                                  forgotten=True)
        self._last_ok = time.monotonic()
        if self._record is not None:
            self._record_self()
        if not self.ledger.healthy:
            log.info("heartbeat: the database answers again; claiming resumes")
            self.ledger.set_healthy(True)
            self.signal.wake(self.config.concurrency)  # the executors idle until woken meanwhile
        self.stats.add("heartbeats")

    def _beat(self, held: list[Held], since: float | None) -> set[ClaimToken]:
        tokens = [h.token for h in held]
        # Each job's progress as its handler last recorded it (the same again is harmless).
        progress = [h.progress for h in held] if self.ops.stores_progress else None
        conn = self.link.connect()
        window = None
        if since is not None:
            # The claim's leases were set on the server after it was sent; half a beat
            # of margin covers the two connections' latencies. No more: a lease one beat
            # set is out of the next one's window unless a claim then in flight is older
            # than half a beat, so a job the worker let go still lapses.
            window = time.monotonic() - since + self.interval / 2
        with self.driver.deadline(conn, self.config.heartbeat_deadline):
            extended = self.ops.extend_leases(conn, self._owners, tokens, since=window, progress=progress)
            missing = [t for t in tokens if t not in extended]
            if not missing:
                return set()
            owned = self.ops.owned_tokens(conn, self._owners, missing)
        return {t for t in missing if t not in owned}

    def _record_self(self) -> None:
        """This worker's row in the workers table, seen now, with what it holds. Never the
        beat's failure: the leases are extended already, and a failed record only makes
        the row older until the next beat."""
        assert self._record is not None
        held = self.ledger.held()
        record = self._record._replace(running=len(held), jobs=tuple(h.token[0] for h in held[:LISTED_JOBS]))
        try:
            conn = self.link.connect()
            with self.driver.deadline(conn, self.config.heartbeat_deadline):
                self.ops.record_worker(conn, record)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            now = time.monotonic()
            if now - self._record_failed_at > 60:
                self._record_failed_at = now
                log.warning("heartbeat: could not record this worker in the workers table (%s)", exc)

    def _check_health(self) -> None:
        if self.ledger.healthy and time.monotonic() - self._last_ok > self.config.lease:
            held = self.ledger.held()
            self.ledger.set_healthy(False)
            lost = self.ledger.lose(held)
            log.error("heartbeat: no beat succeeded for a whole lease (%.1fs): claiming stops and "
                      "the %d held job(s) are treated as lost", self.config.lease, len(lost))
            self.completer.settle(
                [Settled(h, "lost", None, why="lease lost (no heartbeat for a whole lease)") for h in lost],
                forgotten=True,
            )

    def on_error(self, exc: BaseException) -> None:
        super().on_error(exc)
        self._check_health()


def _version() -> str:
    try:
        return version("sqla-queue")[:32]
    except PackageNotFoundError:
        return "unknown"
