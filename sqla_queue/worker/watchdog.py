"""The watchdog: tells handlers their attempt is over, on a thread of its own.

Two things end an attempt while its handler runs, and the handler must be told (see
:mod:`sqla_queue.current`):

- its **deadline** (a timeout, set when the job was claimed and stored in its row): at
  that moment the watchdog tells the handler (an ``async def`` one is cancelled), and the
  executor records the attempt as failed, ``timed out after N s``, retried or
  dead-lettered by the usual rules. A plain handler's thread cannot be stopped: if it
  has not returned shortly after, the watchdog logs it as stuck. Its executor waits for
  it (so the worker never runs more handlers than its concurrency), its completion is
  refused, and its lease, which no heartbeat extends past the deadline, lapses there:
  the sweeper ends the attempt as timed out if the handler has not returned by then.
- a **cancel** (:func:`sqla_queue.cancel`): a worker that listens learns it from the
  cancel's NOTIFY (:mod:`.listener`), and every worker from its heartbeat, whose
  statement misses a cancelled row; a worker that does not listen also reads the state
  of its jobs every ``poll_interval`` here, so it notices within a poll.

The database has the last word: a job is told it was cancelled only once its row says
so, on the attempt the worker holds.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Sequence

from ..current import CANCELLED, TIMED_OUT, timeout_text
from ..driver import DbConnection
from ..ops import Operations
from .context import WorkerContext
from .ledger import Held
from .service import Reconnecting, Service

__all__ = ["STUCK_AFTER", "Watchdog", "tell_cancelled"]

log = logging.getLogger("sqla_queue.worker")

#: Seconds after its deadline a handler still running is logged as stuck.
STUCK_AFTER = 1.0
#: The longest the watchdog sleeps with nothing to do (it is woken for new deadlines).
IDLE_SECONDS = 60.0


def tell_cancelled(ops: Operations, conn: DbConnection, held: Sequence[Held], *, running: bool = True) -> list[Held]:
    """Tell the attempts of ``held`` whose rows read ``cancelled`` on the attempt they
    hold (the row has the last word); returns them, those told already included.
    ``running=False``: their handlers are over (their outcome was refused), and telling
    them only marks them cancelled, so that they are counted so and not as lost."""
    if not held:
        return []
    states = {state.job_id: state for state in ops.token_states(conn, [h.token.job_id for h in held])}
    told = []
    for h in held:
        state = states.get(h.token.job_id)
        if state is not None and state.status == CANCELLED and state.attempt == h.token.attempt:
            if h.tell(CANCELLED) and running:
                log.info("job %s attempt %d: cancelled; its handler is told to stop", h.token.job_id, h.token.attempt)
            told.append(h)  # told now or before (by the poll, the listener): cancelled, never lost
    return told


class Watchdog(Service):
    name = "watchdog"
    own_thread = True
    link: Reconnecting

    def __init__(self, ctx: WorkerContext) -> None:
        config, driver = ctx.config, ctx.driver
        super().__init__(IDLE_SECONDS, reconnect_backoff=config.reconnect_backoff, runtime=driver.runtime)
        self.ledger = ctx.ledger
        self.ops = ctx.ops
        self.driver = driver
        self.stats = ctx.stats
        #: Poll the held jobs' rows for cancels this often (None: the listener tells).
        self.poll = None if config.listen else config.poll_interval
        self._next_poll = time.monotonic()
        self.link = Reconnecting(driver, "sqla_queue watchdog")
        self._lock = threading.Lock()
        #: (when, n, held, stuck check?): deadlines, then the checks for stuck handlers.
        self._due: list[tuple[float, int, Held, bool]] = []
        self._order = itertools.count()

    def watch(self, held: Held) -> None:
        """``held`` starts running: tell its handler at its deadline."""
        assert held.deadline is not None
        with self._lock:
            first = not self._due or held.deadline < self._due[0][0]
            heapq.heappush(self._due, (held.deadline, next(self._order), held, False))
        if first:
            self.wake()

    def tick(self) -> float:
        now = time.monotonic()
        while True:
            with self._lock:
                if not self._due or self._due[0][0] > now:
                    break
                _, _, held, stuck_check = heapq.heappop(self._due)
            self._due_now(held, stuck_check, now)
        if self.poll is not None and now >= self._next_poll:
            self._next_poll = now + self.poll
            self._hear_cancels()
        with self._lock:
            nxt = self._due[0][0] if self._due else now + IDLE_SECONDS
        if self.poll is not None:
            nxt = min(nxt, self._next_poll)
        return max(nxt - time.monotonic(), 0.0)

    def _due_now(self, held: Held, stuck_check: bool, now: float) -> None:
        context = held.context
        running = context is not None and context.running
        if stuck_check:
            if running and held.stopped == TIMED_OUT:
                self.stats.add("stuck")
                log.warning(
                    "job %s attempt %d: its handler is still running %.1fs past its deadline (%s); a thread "
                    "cannot be stopped: its completion will be refused, and its executor is busy until it "
                    "returns", held.token.job_id, held.token.attempt, now - (held.deadline or now),
                    timeout_text(held.timeout or 0.0),
                )
            return
        if not running or held.lost:
            return  # over already
        if held.tell(TIMED_OUT, timeout_text(held.timeout or 0.0)):
            log.warning("job %s attempt %d %s; its handler is told to stop", held.token.job_id,
                        held.token.attempt, timeout_text(held.timeout or 0.0))
            with self._lock:
                heapq.heappush(self._due, (now + STUCK_AFTER, next(self._order), held, True))

    def _hear_cancels(self) -> None:
        held = [h for h in self.ledger.live() if h.started]
        if not held:
            return
        conn = self.link.connect()
        with self.driver.deadline(conn, max(self.poll or 0.0, 1.0)):
            tell_cancelled(self.ops, conn, held)
