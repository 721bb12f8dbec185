"""The work signal: how idle executors learn there may be work.

One object per worker, shared by the services that learn of work (the listener's NOTIFY,
the completer's retry times, the sweeper's returned jobs) and the executors that wait for
it. It knows nothing of the database: wake-ups are counted, due times kept in a heap.
"""

from __future__ import annotations

import heapq
import time

from ..runtime import Condition

__all__ = ["WorkSignal"]


class WorkSignal:
    """Wakes idle executor threads: one per NOTIFY, at due times, or at the poll."""

    def __init__(self, threads: int) -> None:
        self._cond = Condition()
        #: Pending wake-ups, never more than there are threads to wake: a busy thread
        #: claims again anyway, and piled-up tokens would cost as many empty claims.
        self._threads = threads
        self._tokens = 0
        self._due: list[float] = []
        self._stopped = False
        self.idle = 0
        #: Bumped by every wake-up, due time and poll; lets one idle thread per wake-up
        #: ask for due times.
        self.generation = 0
        #: Bumped by wake() alone (a NOTIFY, returned or retried jobs): news of jobs.
        self.woken = 0
        #: Bumped by every due time that woke a thread: its claim may find the job not due
        #: yet (the due time is the client's estimate of the server's ``run_after``).
        self.dues = 0

    def wake(self, count: int = 1) -> None:
        with self._cond:
            self._tokens = min(self._tokens + count, self._threads)
            self.generation += 1
            self.woken += 1
            self._cond.notify(count)

    def wake_at(self, when: float) -> None:
        """Wake one idle thread at ``when`` (``time.monotonic()``)."""
        with self._cond:
            if len(self._due) > 1024:  # bounded: keep the soonest
                self._due = heapq.nsmallest(512, self._due)
                heapq.heapify(self._due)
            if not any(abs(due - when) < 0.005 for due in self._due):
                heapq.heappush(self._due, when)
            self._cond.notify(1)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def next_due(self) -> float | None:
        with self._cond:
            return self._due[0] if self._due else None

    def wait(self, poll: float) -> None:
        """Idle until woken, a due time, the poll, or stop."""
        with self._cond:
            self.idle += 1
            try:
                deadline = time.monotonic() + poll
                while not self._stopped:
                    if self._tokens:
                        self._tokens -= 1
                        return
                    now = time.monotonic()
                    if self._due and self._due[0] <= now:
                        heapq.heappop(self._due)
                        self.generation += 1
                        self.dues += 1
                        return
                    if now >= deadline:
                        self.generation += 1
                        return
                    until = min(deadline, self._due[0]) if self._due else deadline
                    self._cond.wait(until - now)
            finally:
                self.idle -= 1

    def quiet(self, threads: int, within: float) -> bool:
        """Every thread idle, no wake-up pending, and nothing due within ``within``."""
        with self._cond:
            due_soon = bool(self._due) and self._due[0] - time.monotonic() <= within
            return self.idle == threads and not self._tokens and not due_soon
