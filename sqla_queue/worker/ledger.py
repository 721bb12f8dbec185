"""The ledger: the one owner of the jobs a worker holds, and of their one lock.

Jobs are keyed by ``(job id, attempt)``, the fencing token, so a re-claim of the same job
while an older attempt still runs is a different entry. The executors add what they
claim and remove what they recorded; the heartbeat reads the tokens and marks the ones it
found lost; shutdown waits for it to empty. Pure logic: no database, no threads of its own.

Each executor claims under a lease owner name of its own (``{worker}/{executor}.{n}``) and
each held job keeps the name it was claimed under. That lets an executor whose claim
committed but whose answer was lost give back exactly the rows that claim took: they are
the rows running under its name, on another attempt than every job it holds or let go
while its row may still be running under that name (its outcome could not be recorded,
the leases lapsed: :meth:`Ledger.recovery`). Such a job is remembered with its name, and
the executor then moves on to a new name (``n + 1``) at its next claim, so what is
remembered is forgotten once no recovery can need it any more.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..current import STOPPING, JobContext
from ..model import ClaimToken
from ..runtime import Condition, Event

__all__ = ["Held", "Ledger", "Start"]

#: Guards the lazy making of a held job's context (its handler's threads may race).
_MAKING = threading.Lock()


@dataclass(eq=False, slots=True)
class Held:
    """A job this worker holds a lease on, from its claim to its recorded outcome."""

    token: ClaimToken
    job: Any = None
    #: Why the row could not become the handler's object, if it could not.
    load_error: str | None = None
    isolated: bool = False
    #: Runs with no other job in the worker: its lease expired on its last two attempts.
    solitary: bool = False
    #: The lease owner it was claimed under (its executor's name).
    owner: str = ""
    #: Its handler was started (a job never started gets its attempt back at shutdown).
    started: bool = False
    #: Its outcome is being recorded: only that statement's result says if it was lost.
    finishing: bool = False
    #: The lease is known lost (or the job handed back): its outcome must not be recorded.
    lost: bool = False
    #: Losses of the worker's connection in a row under this job's handler, before this run.
    losses: int = 0
    #: When its handler started (wall clock, ``time.time()``), and the seconds it ran.
    started_at: float | None = None
    run_time: float | None = None
    #: Seconds its attempt may run, and ``time.monotonic()`` at its deadline (None: none).
    timeout: float | None = None
    deadline: float | None = None
    #: Why its attempt is over though its handler may still run: ``"cancelled"`` (the
    #: row says so) or ``"timed out"`` (past the deadline). None: it may go on.
    stopped: str | None = None
    #: What its handler is told with it (see :meth:`JobContext.stop`).
    stop_message: str = ""
    #: What its handler sees as ``sqla_queue.current_job()``: made before the handler
    #: starts when a deadline, a cancellable task or a ``job_context`` needs it, else by
    #: the first ``current_job()`` (:meth:`job_context`).
    context: JobContext | None = None
    #: The job's fields its observers' events share (see :class:`~.hooks.JobEvent`),
    #: read at its first event.
    facts: tuple[Any, ...] | None = None
    #: The worker is stopping: its handler is told (:data:`~sqla_queue.current.STOPPING`),
    #: its lease still runs (unlike ``stopped``), and it may still complete.
    shutdown: bool = False
    #: How its handler's ``current_job().progress(value)`` is encoded (None: the table
    #: keeps no progress).
    progress_encoder: Callable[[Any], str | None] | None = None

    @property
    def progress(self) -> str | None:
        """The progress its handler recorded, as JSON text (None: none this attempt)."""
        context = self.context
        return context.progress_text if context is not None else None

    def tell_stopping(self) -> None:
        """The worker is stopping: tell its handler, which may finish or give up (then
        the job is handed back); nothing else changes for it."""
        self.shutdown = True  # before reading ``context``: see job_context()
        context = self.context
        if context is not None:
            context.stop(STOPPING, "the worker is stopping")

    def tell(self, reason: str, message: str = "") -> bool:
        """Its attempt is over (``reason``): tell its handler, if it runs (see
        :class:`~sqla_queue.JobContext`). True the first time."""
        if self.stopped is not None:
            return False
        self.stop_message = message  # before ``stopped``: whoever sees the reason sees it
        self.stopped = reason
        context = self.context
        if context is not None:
            context.stop(reason, message)
        return True

    def job_context(self, running: bool = True) -> JobContext:
        """Its context, made on first use: by ``current_job()`` inside its handler (so it
        starts as ``running``), or by the executor before the handler starts.

        No lock against :meth:`tell` on another thread: that one sets ``stopped`` and then
        reads ``context``; this one sets ``context`` and then reads ``stopped``; so at
        least one of them stops it (``stop`` acts once)."""
        context = self.context
        if context is None:
            with _MAKING:
                context = self.context
                if context is None:
                    context = JobContext(self.job, self.token, self.timeout, self.deadline, self.progress_encoder)
                    if running:
                        context.enter(None)
                    self.context = context
        if self.shutdown:
            context.stop(STOPPING, "the worker is stopping")
        if self.stopped is not None:
            context.stop(self.stopped, self.stop_message)
        return context


class Start(Enum):
    """What :meth:`Ledger.start` says about a job about to run."""

    #: Run it.
    RUN = "run"
    #: Do not: it was lost, or is being handed back.
    SKIP = "skip"
    #: Do not, and hand it back unstarted (attempt refunded): a solitary job waits for
    #: the worker to hold nothing else.
    DEFER = "defer"


class Ledger:
    """Held jobs, claims in flight, the isolated-claim slot, the executors' owner names
    and the worker's lease health, under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = Condition(self._lock)
        self._held: dict[ClaimToken, Held] = {}
        self._isolated_taken = False
        #: The solitary job held, if any: no claim is made while it is.
        self._solitary: Held | None = None
        #: The number in each executor's current owner name, by the name's prefix.
        self._names: dict[str, int] = {}
        #: Owner names whose claim may have committed unseen.
        self._unknown: set[str] = set()
        #: Jobs let go while their row may still be running under that owner name.
        self._abandoned: dict[str, set[ClaimToken]] = {}
        #: False after no heartbeat succeeded for a whole lease: claim nothing until one does.
        self._healthy = True
        #: Claims sent whose rows are not in the ledger yet: mark -> when it began (monotonic).
        self._claims: dict[int, float] = {}
        self._marks = itertools.count(1)
        #: Set when the worker stops (:meth:`close_claims`): no claim begins after it.
        self._closed = False

    def __len__(self) -> int:
        return len(self._held)

    # -- claims and outcomes -----------------------------------------------------------

    def add(self, held: Iterable[Held]) -> None:
        with self._lock:
            for h in held:
                self._held[h.token] = h
                if h.solitary and self._solitary is None:
                    self._solitary = h

    def begin_claim(self) -> int | None:
        """A claim is about to be sent: its mark, for :meth:`end_claim`; None while a
        solitary job is held (claim nothing).

        Until it ended (its rows are in the ledger, or it failed), the rows it took are
        this worker's without being in the ledger: their answer may sit unread while
        the event loop is blocked. The heartbeat keeps their leases meanwhile
        (:meth:`claims_since`)."""
        with self._lock:
            if self._solitary is not None or self._closed:
                return None
            mark = next(self._marks)
            self._claims[mark] = time.monotonic()
            return mark

    def end_claim(self, mark: int) -> None:
        """The claim ``mark`` is over: its rows are in the ledger (or it claimed nothing, or failed)."""
        with self._lock:
            self._claims.pop(mark, None)
            self._changed.notify_all()

    def start(self, held: Held) -> Start:
        """Mark a job started, unless it was lost or is being handed back meanwhile.

        The solitary job waits here until the worker holds nothing else and claims
        nothing: the other jobs finish, or are handed back unstarted (DEFER), so that
        if it kills the worker, it takes no other job's attempt with it.
        """
        with self._lock:  # the Condition's own lock: ``_changed.wait`` may release it
            if held is self._solitary:
                while not (held.lost or held.finishing) and (len(self._held) > 1 or self._claims):
                    self._changed.wait(0.05)
            if held.lost or held.finishing:
                if held.lost and self._held.get(held.token) is held:
                    self._forget(held)  # never started: nothing will record it
                return Start.SKIP
            if self._solitary is not None and held is not self._solitary:
                return Start.DEFER
            held.started = True
            return Start.RUN

    def close_claims(self, timeout: float) -> bool:
        """No claim begins from now on (the worker stops); wait up to ``timeout`` for the
        claims in flight to end, so that their rows are in the ledger when the stop
        hands back what did not start. False if one is still out."""
        with self._changed:
            self._closed = True
            return self._wait_while(lambda: bool(self._claims), timeout)

    def take(self, held: Iterable[Held]) -> list[Held]:
        """Of ``held``, the jobs no one else is recording or handing back, marked for
        hand-back: an executor that claimed while the worker stopped and the stop itself
        (:meth:`take_unstarted`) never both give back the same job."""
        with self._lock:
            taken = [h for h in held if not (h.finishing or h.lost)]
            for h in taken:
                h.finishing = True
            return taken

    def take_unstarted(self) -> list[Held]:
        """The jobs whose handler never started, marked for hand-back (at shutdown)."""
        with self._lock:
            taken = [h for h in self._held.values() if not (h.started or h.finishing or h.lost)]
            for h in taken:
                h.finishing = True
            self._changed.notify_all()
            return taken

    def finishing(self, held: Iterable[Held]) -> list[Held]:
        """Mark jobs whose outcome is about to be recorded; returns those not lost."""
        with self._lock:
            live = [h for h in held if not h.lost]
            for h in live:
                h.finishing = True
        return live

    def remove(self, held: Iterable[Held]) -> None:
        with self._lock:
            jobs = self._held
            for h in held:
                if jobs.get(h.token) is h:
                    del jobs[h.token]  # _forget(), inline: once a job
                    if h is self._solitary:
                        self._solitary = None
            self._changed.notify_all()

    def _forget(self, h: Held) -> None:
        del self._held[h.token]
        if h is self._solitary:
            self._solitary = None

    def get(self, token: ClaimToken) -> Held | None:
        with self._lock:
            return self._held.get(token)

    def tokens(self) -> list[ClaimToken]:
        """Tokens whose lease still matters: held, not lost, and not being handed back
        unstarted (a beat over ten thousand of those would hold their rows' locks while
        the hand-back waits for them; if it fails, they return after their lease)."""
        with self._lock:
            return [t for t, h in self._held.items() if not (h.lost or h.stopped or (h.finishing and not h.started))]

    def live(self) -> list[Held]:
        """The held jobs whose lease still matters, as :meth:`tokens` says: not those
        whose attempt is over (cancelled, or past its deadline, where no lease runs)."""
        with self._lock:
            return [h for h in self._held.values() if not (h.lost or h.stopped or (h.finishing and not h.started))]

    # -- claims in flight --------------------------------------------------------------

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

    def lose(self, held: Iterable[Held], *, settled: bool = False) -> list[Held]:
        """Mark jobs lost (handed back, or the worker's leases lapsed) and forget them.

        ``settled``: the database said their rows are no longer running under their
        owner (a fenced statement matched none). Otherwise a row may still be ours: it
        is remembered with its owner name while a recovery may need it (see
        :meth:`recovery`)."""
        marked = []
        with self._lock:
            for h in held:
                if not h.lost:
                    h.lost = True
                    marked.append(h)
                if self._held.get(h.token) is h:
                    self._forget(h)
            if marked and not settled:
                current = self._current_names()
                for h in marked:
                    if h.owner in current or h.owner in self._unknown:
                        self._abandoned.setdefault(h.owner, set()).add(h.token)
            self._changed.notify_all()
        return marked

    # -- claims whose answer was lost ----------------------------------------------------

    def lane_owner(self, prefix: str) -> str:
        """The owner name an executor claims under next: ``prefix`` and a number, moved
        on once a job of the name was let go while its row may still be ours."""
        with self._lock:
            number = self._names.setdefault(prefix, 0)
            name = f"{prefix}{number}"
            if self._abandoned.get(name):
                if name not in self._unknown:
                    del self._abandoned[name]  # no recovery can need them any more
                self._names[prefix] = number + 1
                name = f"{prefix}{number + 1}"
            return name

    def _current_names(self) -> set[str]:
        return {f"{prefix}{number}" for prefix, number in self._names.items()}

    def claim_unknown(self, owner: str) -> None:
        """A claim under ``owner`` may have committed, but its rows never arrived."""
        with self._lock:
            self._unknown.add(owner)

    def unknown_claims(self, prefix: str) -> list[str]:
        """The owner names starting with ``prefix`` that have claims to recover."""
        with self._lock:
            return [name for name in self._unknown if name.startswith(prefix)]

    def recovery(self, owner: str) -> list[ClaimToken]:
        """The tokens to keep when giving back the rows of ``owner``'s lost claims: the
        jobs held under that name, and those let go while their row may still be
        running under it. Every other row running under it came from a lost claim."""
        with self._lock:
            keep = [token for token, h in self._held.items() if h.owner == owner]
            keep.extend(self._abandoned.get(owner, ()))
            return keep

    def recovered(self, owner: str) -> None:
        with self._lock:
            self._unknown.discard(owner)
            if owner not in self._current_names():
                self._abandoned.pop(owner, None)

    # -- isolated jobs -----------------------------------------------------------------

    def take_isolated_slot(self) -> bool:
        """One claim of an isolated job (its last worker died running it) at a time per
        worker: each is claimed alone, and a solitary one stops every other claim."""
        with self._lock:
            if self._isolated_taken:
                return False
            self._isolated_taken = True
            return True

    def give_back_isolated_slot(self) -> None:
        with self._lock:
            self._isolated_taken = False

    @property
    def solitary(self) -> bool:
        """A solitary job is held: the worker claims nothing until it is done."""
        return self._solitary is not None

    @property
    def claims_open(self) -> bool:
        """A claim may begin now: no solitary job is held, the leases are healthy and
        the worker is not stopping (else :meth:`begin_claim` refuses, or the producer
        does not ask)."""
        return self._solitary is None and self._healthy and not self._closed

    # -- health ------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self._healthy

    def set_healthy(self, healthy: bool) -> None:
        with self._lock:
            self._healthy = healthy

    # -- shutdown ----------------------------------------------------------------------

    def wait_empty(self, timeout: float, give_up: Event | None = None) -> bool:
        with self._changed:
            return self._wait_while(lambda: bool(self._held), timeout, give_up)

    def _wait_while(self, busy: Callable[[], bool], timeout: float, give_up: Event | None = None) -> bool:
        """With the lock held: wait up to ``timeout`` until ``busy()`` is false (changes
        notify; ``give_up`` is looked at every 50 ms). False if it still was."""
        deadline = time.monotonic() + timeout
        while busy():
            left = deadline - time.monotonic()
            if left <= 0 or (give_up is not None and give_up.is_set()):
                return False
            self._changed.wait(min(left, 0.05))
        return True
