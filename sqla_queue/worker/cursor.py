"""The claim cursor: where the worker's claims start their index scan, and when they
start from the head of the pending index instead.

The policy is the worker's: the operations layer (:mod:`sqla_queue.ops`) takes the start
a claim is given (``claim_request(after=...)``, one key, or one per queue served) and
tells where its rows lay (``seen``), and knows nothing of when or why. The producer
(:mod:`.producer`) holds one :class:`ClaimCursor` per worker, shared by its executors,
when the operations can start a claim after a key (``Operations.claims_after``).
Pure logic: no database, no threads of its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from ..ops import CursorStart

__all__ = [
    "COST_RATIO", "CURSOR_SLACK", "MAX_RESCAN_INTERVAL", "RESCAN_INTERVAL", "ClaimCursor", "spaced_by_cost",
]

#: Seconds between claims from the head of the pending index while a cursor claims the
#: rest, at least: the longest a job that sorts before the cursor (a higher priority, or
#: made visible late by a long transaction) waits behind jobs after it, while claims from
#: the head are cheap.
RESCAN_INTERVAL = 0.25
#: A statement that reads every dead entry a held snapshot keeps (a claim from the head:
#: at 800 jobs/s, a hundred thousand entries in two minutes, 10-80 ms a claim; the idle
#: worker's lookup of the next due time) waits this many times as long as it last took
#: before it runs again, so that it costs a worker at most a fortieth of one
#: connection's time (see :func:`spaced_by_cost`).
COST_RATIO = 40.0
#: The longest wait between claims from the head, however slow they grew.
MAX_RESCAN_INTERVAL = 2.0
#: Seconds a cursor claim starts before the last ``run_after`` claimed. A job's
#: ``run_after`` is its transaction's start (``now()``), so jobs commit slightly out of
#: order: one a producer committed a moment after a later-starting one would sort just
#: behind the cursor and wait for the next claim from the head (one in a hundred, with
#: no slack, in ``benchmarks/pressure.py``). The dead entries of this window are all a
#: cursor claim reads beside live ones under a held snapshot (at 800 jobs/s, 200 of
#: them; a second's 800 cost every claim 0.11 ms more, and a worker claims about three
#: times a job at that rate). A transaction that enqueues and commits more than this
#: after it began has its job found by the next claim from the head.
CURSOR_SLACK = 0.25


def spaced_by_cost(took: float, least: float, most: float) -> float:
    """Seconds until a statement that ``took`` seconds runs again: :data:`COST_RATIO`
    times as long, between ``least`` and ``most``."""
    return min(max(least, took * COST_RATIO), most)



class ClaimCursor:
    """Where the worker's claims start their index scan: after the last job claimed.

    Each claimed job leaves a dead entry at the head of the pending index until vacuum
    removes it, and vacuum removes none while any transaction older than it is open (a
    report, ``pg_dump``, a replica's feedback): a claim from the head reads them all,
    and its cost grows with every job done since. A cursor claim starts after the last
    key claimed (:func:`~sqla_queue.sql.claim_template`, ``after=True``, run by the
    operations layer from the start :meth:`start` gives) and reads only
    live entries; a worker serving several queues keeps one cursor per queue
    (``per_queue``), since each queue is an index range of its own. Jobs that sort
    before it are found by a claim from the head, run

    - when the rescan is due, by one claim at a time (the executors claiming meanwhile
      keep to the cursor, so a slow one delays no other pickup): every
      :data:`RESCAN_INTERVAL` seconds, or :data:`COST_RATIO` times as long as the
      last one took when that is longer (up to :data:`MAX_RESCAN_INTERVAL`),
    - again and again while such claims find jobs before the cursor (a long transaction
      committed many at once), and
    - at the next rescan after a cursor claim found nothing (:meth:`head_claim_at`): the
      worker wakes for it, so no job waits for the poll, and an idle worker stops
      claiming only after a claim from the head found nothing.

    A cursor claim starts :data:`CURSOR_SLACK` seconds of ``run_after`` before the last
    key, for the jobs committed a moment late. Shared by the executors of one worker;
    the cursor only moves forward. Keys are compared in Python, so only integer keys use
    it (their order is the server's).
    """

    def __init__(
        self, rescan_interval: float | None = None, clock: Callable[[], float] = time.monotonic,
        slack: float | None = None, max_rescan_interval: float | None = None, *, per_queue: bool = False,
    ) -> None:
        self.rescan_interval = RESCAN_INTERVAL if rescan_interval is None else rescan_interval
        self.max_rescan_interval = max(
            self.rescan_interval, MAX_RESCAN_INTERVAL if max_rescan_interval is None else max_rescan_interval
        )
        self.slack = timedelta(seconds=CURSOR_SLACK if slack is None else slack)
        self.per_queue = per_queue
        self._clock = clock
        self._lock = threading.Lock()
        #: The last key claimed, in the claim's order ``(-priority, run_after, pk)``, of
        #: each queue (``per_queue``), or of all (under None).
        self._last: dict[str | None, tuple[Any, Any, Any]] = {}
        self._rescan_at = 0.0
        #: The wait between claims from the head, as the last one's cost set it.
        self.interval = self.rescan_interval
        self._behind = False
        #: A cursor claim found nothing since the last claim from the head.
        self._missed = False

    def start(self) -> dict[str | None, CursorStart] | None:
        """Where to claim after: ``{queue: (priority, run_after, pk)}`` for each queue a
        job was claimed from (``per_queue``), else ``{None: …}``; None: claim from the
        head."""
        with self._lock:
            if not self._last or self._behind:
                return None
            now = self._clock()
            if now >= self._rescan_at:
                # This claim is the rescan; the next one is due an interval on even if it
                # never reports back (it failed), and the claims meanwhile use the cursor.
                self._rescan_at = now + self.interval
                return None
            slack = self.slack
            return {lane: (-last[0], last[1] - slack, last[2]) for lane, last in self._last.items()}

    def claimed(self, keys: Sequence[tuple[int, Any, Any, str]], *, from_head: bool, took: float = 0.0) -> None:
        """Note the ``(priority, run_after, pk, queue)`` of the jobs a claim took, and (a
        claim from the head) the seconds it ``took``."""
        per_queue = self.per_queue
        ordered = [
            (queue if per_queue else None, (-priority, run_after, pk)) for priority, run_after, pk, queue in keys
        ]
        with self._lock:
            lasts = self._last
            if from_head:
                self.interval = spaced_by_cost(took, self.rescan_interval, self.max_rescan_interval)
                self._rescan_at = self._clock() + self.interval
                # Behind where the next cursor claim would start (the slack covers the rest).
                slack = self.slack
                self._behind = any(
                    (last := lasts.get(lane)) is not None and key < (last[0], last[1] - slack, last[2])
                    for lane, key in ordered
                )
                self._missed = False
            elif not ordered:
                self._missed = True
            if not per_queue and ordered:  # one lane: its greatest key, found in C
                ordered = [max(ordered)]
            for lane, key in ordered:
                last = lasts.get(lane)
                if last is None or key > last:
                    lasts[lane] = key

    def head_claim_at(self) -> float | None:
        """When (on the clock given, ``time.monotonic``) a claim from the head is owed:
        a cursor claim found nothing since the last one. None: none is owed."""
        with self._lock:
            return self._rescan_at if self._missed else None
