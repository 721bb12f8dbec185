"""What every service of one worker shares, handed over as one value.

A service gets this context (and the few collaborators of its own: the producer for the
sweeper, the handler for the executor), never the :class:`~sqla_queue.Worker`: a new
shared part (an observer of outcomes, a metrics sink) is one field here, not a new
argument of six constructors.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..driver import Driver
from ..ops import Operations
from .config import WorkerConfig
from .hooks import Hooks
from .ledger import Ledger
from .stats import WorkerStats
from .work_signal import WorkSignal

__all__ = ["WorkerContext"]


@dataclass(frozen=True)
class WorkerContext:
    """One worker's config, ledger, driver, queue table operations, wake-up signal,
    counters, lease owner name (the start of every executor's) and hooks (every claim,
    run and end of a job passes them: :mod:`.hooks`)."""

    config: WorkerConfig
    ledger: Ledger
    driver: Driver
    ops: Operations
    signal: WorkSignal
    stats: WorkerStats
    owner: str
    hooks: Hooks
