"""The ledger: the one owner of the jobs a worker holds, and of their one lock.

Jobs are keyed by ``(job id, attempt)``, the fencing token, so a re-claim of the same job
while an older attempt still runs is a different entry. The executors add what they
claim and remove what they recorded; the heartbeat reads the tokens and marks the ones it
found lost; shutdown waits for it to empty. Pure logic: no database, no threads of its own.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..runtime import Condition, Event
from ..sql import ClaimToken

__all__ = ["Held", "Ledger"]


@dataclass(eq=False, slots=True)
class Held:
    """A job this worker holds a lease on, from its claim to its recorded outcome."""

    token: ClaimToken
    job: Any = None
    #: Why the row could not become the handler's object, if it could not.
    load_error: str | None = None
    isolated: bool = False
    #: Its handler was started (a job never started gets its attempt back at shutdown).
    started: bool = False
    #: Its outcome is being recorded: only that statement's result says if it was lost.
    finishing: bool = False
    #: The lease is known lost (or the job handed back): its outcome must not be recorded.
    lost: bool = False
    #: Losses of the worker's connection in a row under this job's handler, before this run.
    losses: int = 0


class Ledger:
    """Held jobs, the isolated-job slot and the worker's lease health, under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = Condition(self._lock)
        self._held: dict[ClaimToken, Held] = {}
        self._isolated_taken = False
        #: False after no heartbeat succeeded for a whole lease: claim nothing until one does.
        self._healthy = True
        #: Claims sent whose rows are not in the ledger yet: mark -> when it began (monotonic).
        self._claims: dict[int, float] = {}
        self._marks = itertools.count(1)

    def __len__(self) -> int:
        return len(self._held)

    # -- claims and outcomes -----------------------------------------------------------

    def add(self, held: Iterable[Held]) -> None:
        with self._lock:
            for h in held:
                self._held[h.token] = h

    def start(self, held: Held) -> bool:
        """Mark a job started, unless it was lost or is being handed back meanwhile."""
        with self._lock:
            if held.lost or held.finishing:
                return False
            held.started = True
            return True

    def take_unstarted(self) -> list[Held]:
        """The jobs whose handler never started, marked for hand-back (at shutdown)."""
        with self._lock:
            taken = [h for h in self._held.values() if not (h.started or h.finishing or h.lost)]
            for h in taken:
                h.finishing = True
            return taken

    def finishing(self, held: Iterable[Held]) -> list[Held]:
        """Mark jobs whose outcome is about to be recorded; returns those not lost."""
        live = []
        with self._lock:
            for h in held:
                if not h.lost:
                    h.finishing = True
                    live.append(h)
        return live

    def remove(self, held: Iterable[Held]) -> None:
        with self._lock:
            for h in held:
                if self._held.get(h.token) is h:
                    del self._held[h.token]
                    if h.isolated:
                        self._isolated_taken = False
            self._changed.notify_all()

    def get(self, token: ClaimToken) -> Held | None:
        with self._lock:
            return self._held.get(token)

    def tokens(self) -> list[ClaimToken]:
        """Tokens whose lease still matters: held, not lost."""
        with self._lock:
            return [t for t, h in self._held.items() if not h.lost]

    def live(self) -> list[Held]:
        """The held jobs whose lease still matters: not lost."""
        with self._lock:
            return [h for h in self._held.values() if not h.lost]

    # -- claims in flight --------------------------------------------------------------

    def claim_began(self) -> int:
        """A claim is about to be sent; returns its mark, for :meth:`claim_ended`.

        Until it ended (its rows are in the ledger, or it failed), the rows it took are
        this worker's without being in the ledger: their answer may sit unread while
        the event loop is blocked. The heartbeat keeps their leases meanwhile."""
        mark = next(self._marks)
        with self._lock:
            self._claims[mark] = time.monotonic()
        return mark

    def claim_ended(self, mark: int) -> None:
        with self._lock:
            self._claims.pop(mark, None)

    def claims_since(self) -> float | None:
        """When the oldest claim in flight began (monotonic), or None."""
        with self._lock:
            return min(self._claims.values()) if self._claims else None

    def held(self) -> list[Held]:
        with self._lock:
            return list(self._held.values())

    # -- lost leases -------------------------------------------------------------------

    def mark_lost(self, held: Held) -> Held | None:
        """Mark a held job lost, unless its outcome is already being recorded (then the
        recording statement decides) or it is no longer held; returns it if this call
        marked it. By the object, not the token: a job handed back with its attempt
        refunded and claimed again has the same token, and the new claim is not lost."""
        with self._lock:
            if self._held.get(held.token) is not held or held.finishing or held.lost:
                return None
            held.lost = True
            return held

    def lose(self, held: Iterable[Held]) -> list[Held]:
        """Mark jobs lost (handed back, or the worker's leases lapsed) and forget them."""
        marked = []
        with self._lock:
            for h in held:
                if not h.lost:
                    h.lost = True
                    marked.append(h)
                if self._held.get(h.token) is h:
                    del self._held[h.token]
                    if h.isolated:
                        self._isolated_taken = False
            self._changed.notify_all()
        return marked

    # -- isolated jobs -----------------------------------------------------------------

    def take_isolated_slot(self) -> bool:
        """At most one isolated job (its last worker died running it) runs per worker."""
        with self._lock:
            if self._isolated_taken:
                return False
            self._isolated_taken = True
            return True

    def give_back_isolated_slot(self) -> None:
        with self._lock:
            self._isolated_taken = False

    # -- health ------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self._healthy

    def set_healthy(self, healthy: bool) -> None:
        with self._lock:
            self._healthy = healthy

    # -- shutdown ----------------------------------------------------------------------

    def wait_empty(self, timeout: float, give_up: Event | None = None) -> bool:
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._held:
                left = deadline - time.monotonic()
                if left <= 0 or (give_up is not None and give_up.is_set()):
                    return False
                self._changed.wait(min(left, 0.05))
            return True
