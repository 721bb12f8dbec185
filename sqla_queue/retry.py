"""Retry timing: :class:`Backoff`, the delay before a failed job's next attempt.

A value type, no SQL: ``WorkerConfig.backoff`` holds one for the retries of failed jobs,
and the worker's services use another between their reconnection attempts. Also exported
from :mod:`sqla_queue` and :mod:`sqla_queue.sql`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Final

__all__ = ["MAX_BACKOFF_SECONDS", "Backoff"]

#: The longest delay a :class:`Backoff` gives (about ten years), whatever its cap: a
#: longer one could not be added to a timestamp, nor held by a ``timedelta``.
MAX_BACKOFF_SECONDS: Final = 10 * 365 * 86400.0


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter and a cap: ``base * factor**(attempt-1)``.

    The delay of attempt ``n`` is drawn uniformly from ``[d*(1-jitter), d*(1+jitter)]``
    (jitter spreads retries of jobs that failed together) and never exceeds ``cap``, nor
    :data:`MAX_BACKOFF_SECONDS` (``cap=float("inf")`` means that ceiling). Every attempt
    number gets a delay, however large.
    """

    base: float = 1.0
    factor: float = 2.0
    cap: float = 3600.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        for name in ("base", "factor", "cap", "jitter"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if self.base < 0 or self.cap < 0:
            raise ValueError("base and cap must not be negative")
        if self.factor < 1:
            raise ValueError("factor must be at least 1")
        if not 0 <= self.jitter <= 1:
            raise ValueError("jitter must be between 0 and 1")

    def bounds(self, attempt: int) -> tuple[float, float]:
        """The smallest and largest delay (seconds) attempt ``attempt`` can get."""
        ceiling = min(float(self.cap), MAX_BACKOFF_SECONDS)
        exponent = max(int(attempt) - 1, 0)
        if self.base == 0:
            raw = 0.0  # not 0 * inf
        elif exponent == 0 or self.factor == 1:
            raw = float(self.base)
        else:
            try:  # factor**exponent overflows a float for large attempts
                raw = self.base * float(self.factor) ** exponent
            except OverflowError:
                raw = math.inf
        raw = min(raw, ceiling)  # finite from here on: no inf * 0
        return min(raw * (1 - self.jitter), ceiling), min(raw * (1 + self.jitter), ceiling)

    def delay(self, attempt: int, rand: Callable[[], float] = random.random) -> timedelta:
        """The delay before retrying after attempt ``attempt`` (1-based) failed."""
        low, high = self.bounds(attempt)
        return timedelta(seconds=low + (high - low) * rand())
