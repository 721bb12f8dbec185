"""The start/stop shape every background service of a worker shares.

A service is one or more loops, each on a thread or an asyncio task (the driver's
:mod:`~sqla_queue.runtime` decides), written once as blocking code. The periodic ones run ``tick()``, wait
``interval`` seconds (or until woken), and on an error log it and back off, up to the
configured reconnect cap, instead of dying: a lost database must never take a worker down.
Each loop's dedicated connection is a :class:`Reconnecting` one: made again, on its next
use, once it broke.
"""

from __future__ import annotations

import logging
import time
from typing import Any, ClassVar

from ..driver import DbConnection, Driver
from ..retry import Backoff
from ..runtime import Condition, Event, Runtime, Strand, ThreadRuntime

log = logging.getLogger("sqla_queue.worker")


def error_backoff(cap: float) -> Backoff:
    """0.05 s, 0.1 s, 0.2 s ... up to ``cap``: quick to retry a blip, never sleeping long
    after the database is back."""
    return Backoff(base=min(0.05, cap), factor=2.0, cap=cap, jitter=0.2)


class Reconnecting:
    """A dedicated connection of the driver's, made on first use and again on the use
    after it broke (closed, known broken by psycopg, or cut by a deadline); ``listen``:
    the channel it LISTENs on from each connect."""

    def __init__(self, driver: Driver, purpose: str, *, listen: str | None = None) -> None:
        self.driver = driver
        self.purpose = purpose
        self.listen = listen
        self.conn: DbConnection | None = None
        #: Connections made so far; above 1 means it reconnected.
        self.connections = 0

    def connect(self) -> DbConnection:
        """The connection, a new one if there was none or it broke."""
        conn = self.conn
        if conn is None or conn.broken:
            self.reset()
            if self.listen is None:
                conn = self.driver.connect(self.purpose)
            else:
                conn = self.driver.connect(self.purpose, listen=self.listen)
            self.conn = conn
            self.connections += 1
        return conn

    def reset(self) -> None:
        """Close the connection (if any): the next :meth:`connect` makes a new one."""
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()


class Service:
    """``start()``, ``wake()``, ``stop(timeout)``: the same for every service."""

    name: ClassVar[str] = "service"

    #: Runs on a thread of its own even in an asyncio worker, out of reach of handlers
    #: that block the event loop.
    own_thread: ClassVar[bool] = False

    def __init__(self, interval: float, *, reconnect_backoff: float = 2.0, runtime: Runtime | None = None) -> None:
        self.interval = interval
        self.backoff = error_backoff(reconnect_backoff)
        self.runtime: Runtime = runtime if runtime is not None else ThreadRuntime()
        self._stop = Event()
        self._wake = Event()
        self._threads: list[Strand] = []
        self.failures = 0
        #: Rounds completed without error; tests wait on it instead of sleeping.
        self.rounds = 0
        self._rounds_changed = Condition()

    # -- the part each service defines -------------------------------------------------

    def tick(self) -> float | None:
        """One round; may return how long to wait before the next (0: at once)."""
        raise NotImplementedError

    #: The service's own connection, if it has one: dropped after an error of a round,
    #: closed when the service ends.
    link: Reconnecting | None = None

    def on_error(self, exc: BaseException) -> None:
        """Called after ``tick()`` raised: the connection is dropped (the next round makes
        a new one), as a statement that failed may have left it in any state."""
        if self.link is not None:
            self.link.reset()

    def close(self) -> None:
        """Called once in the service's thread after it stopped."""
        if self.link is not None:
            self.link.reset()

    # -- the shared shape --------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def start(self) -> None:
        if self._threads:
            raise RuntimeError(f"{self.name} already started")
        self._spawn(self._run, f"sqla_queue-{self.name}")

    def _spawn(self, target: Any, name: str, *args: object) -> None:
        self._threads.append(self.runtime.spawn(target, name, *args, own_thread=self.own_thread))

    def wake(self) -> None:
        self._wake.set()

    def request_stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def stop(self, timeout: float | None = None) -> bool:
        """Ask the service to stop and wait up to ``timeout`` seconds; True if it did."""
        self.request_stop()
        return self.join(timeout)

    def join(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        others = [t for t in self._threads if not t.is_current()]  # never wait for ourselves
        for strand in others:
            strand.join(None if deadline is None else max(deadline - time.monotonic(), 0))
        return not any(t.is_alive() for t in others)

    def sleep(self, seconds: float) -> bool:
        """Wait ``seconds`` unless woken or stopped; True if the service should go on."""
        if seconds > 0:
            self._wake.wait(seconds)
        self._wake.clear()
        return not self._stop.is_set()

    def wait_rounds(self, count: int, timeout: float) -> bool:
        """Block until ``rounds`` reaches ``count`` (a test hook); False on timeout."""
        with self._rounds_changed:
            return self._rounds_changed.wait_for(lambda: self.rounds >= count, timeout)

    def _round_done(self) -> None:
        with self._rounds_changed:
            self.rounds += 1
            self._rounds_changed.notify_all()

    def failed(self, exc: BaseException) -> float:
        """Log an error of a round and return how long to back off."""
        self.failures += 1
        delay = self.backoff.delay(self.failures).total_seconds()
        text = str(exc).strip()
        log.warning(
            "%s: %s: %s (retrying in %.2fs)",
            self.name,
            type(exc).__name__,
            text.splitlines()[0] if text else "",
            delay,
        )
        return delay

    def recovered(self) -> None:
        if self.failures:
            log.info("%s: recovered after %d error(s)", self.name, self.failures)
        self.failures = 0

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    delay = self.tick()
                except Exception as exc:  # noqa: BLE001 - a service must survive anything
                    if self._stop.is_set():
                        break  # stop() cut a call short: not an error worth a log line
                    delay = self.failed(exc)
                    try:
                        self.on_error(exc)
                    except Exception:
                        log.debug("%s: error in on_error", self.name, exc_info=True)
                else:
                    self.recovered()
                    self._round_done()
                    if delay is None:
                        delay = max(self.interval - (time.monotonic() - started), 0.0)
                if not self.sleep(delay):
                    break
        finally:
            try:
                self.close()
            except Exception:
                log.debug("%s: error while closing", self.name, exc_info=True)
