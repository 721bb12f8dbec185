"""Counters a worker keeps, readable at any time."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

__all__ = ["WorkerStats"]


@dataclass
class WorkerStats:
    """Counters since the worker started (read them any time; they only grow)."""

    claimed: int = 0
    done: int = 0
    retried: int = 0
    failed: int = 0
    lost: int = 0
    released: int = 0
    #: Jobs whose handler raised ``Snooze``: run again later, no attempt spent.
    snoozed: int = 0
    swept: int = 0
    #: Jobs cancelled while this worker held them.
    cancelled: int = 0
    #: Handlers still running after their deadline had passed (see the watchdog).
    stuck: int = 0
    heartbeats: int = 0
    #: Events not given to the observers: their queue was full (see ``observer_queue_size``).
    hook_dropped: int = 0
    #: Exceptions the observers raised (logged, then ignored).
    hook_errors: int = 0
    #: Periodic jobs this worker enqueued, and finished jobs its pruner deleted.
    scheduled: int = 0
    pruned: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, counter: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, counter, getattr(self, counter) + n)
