"""One start/stop shape for every background loop of a worker.

The claim loop, the heartbeat, the sweeper, the completer and the listener differ only in
what one round does. Each is a daemon thread that runs ``tick()``, waits ``interval``
seconds (or until woken), and on an error logs it and backs off instead of dying: a lost
database connection must never take a worker down.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Final

from .sql import Backoff

log = logging.getLogger("sqla_queue.worker")

#: How long loops back off after consecutive errors: 0.1 s, 0.2 s, … up to 10 s.
ERROR_BACKOFF: Final = Backoff(base=0.1, factor=2.0, cap=10.0, jitter=0.2)


class BackgroundLoop:
    """Run ``tick()`` every ``interval`` seconds in a daemon thread until stopped.

    ``tick()`` may return a number of seconds to wait instead of ``interval`` (0 means
    "run again at once"). ``wake()`` cuts the current wait short.
    """

    name = "loop"

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._failures = 0

    # -- the part each loop defines ----------------------------------------------------

    def tick(self) -> float | None:
        raise NotImplementedError

    def on_error(self, exc: BaseException) -> None:
        """Called after ``tick()`` raised; drop broken connections here."""

    def close(self) -> None:
        """Called once in the loop's thread after it stopped."""

    # -- the shared shape --------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"{self.name} already started")
        self._thread = threading.Thread(target=self._run, name=f"sqla_queue-{self.name}", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float | None = None) -> None:
        """Ask the loop to stop and wait up to ``timeout`` seconds for its thread."""
        self._stop.set()
        self._wake.set()
        self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def sleep(self, seconds: float) -> bool:
        """Wait ``seconds`` unless woken or stopped; True if the loop should go on."""
        if seconds > 0:
            self._wake.wait(seconds)
        self._wake.clear()
        return not self._stop.is_set()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    delay = self.tick()
                except Exception as exc:  # noqa: BLE001 - a loop must survive anything
                    self._failures += 1
                    delay = ERROR_BACKOFF.delay(self._failures).total_seconds()
                    log.warning(
                        "%s: %s: %s (retrying in %.2fs)",
                        self.name,
                        type(exc).__name__,
                        str(exc).strip().splitlines()[0] if str(exc).strip() else "",
                        delay,
                    )
                    self.on_error(exc)
                else:
                    if self._failures:
                        log.info("%s: recovered after %d error(s)", self.name, self._failures)
                    self._failures = 0
                    if delay is None:
                        delay = max(self.interval - (time.monotonic() - started), 0.0)
                if not self.sleep(delay):
                    break
        finally:
            try:
                self.close()
            except Exception:  # noqa: BLE001
                log.debug("%s: error while closing", self.name, exc_info=True)
