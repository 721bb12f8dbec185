"""How often a repeated warning may be logged: the rest are only counted by the caller."""

from __future__ import annotations

import time

__all__ = ["PerMinute"]


class PerMinute:
    """At most ``limit`` times in any 60 seconds: ``if limiter.allow(): log.warning(...)``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._times: list[float] = []

    def allow(self) -> bool:
        now = time.monotonic()
        recent = [t for t in self._times if now - t < 60.0]
        allowed = len(recent) < self.limit
        if allowed:
            recent.append(now)
        self._times = recent
        return allowed
