"""Flow rules a queue model declares in ``__queue_flow__``, as typed values.

    class ExportJob(Base, JobMixin):
        __tablename__ = "export_jobs"
        __queue_flow__ = (
            Concurrency(1, key="account_id"),   # one running export per account
            Concurrency(20, key="queue"),       # and at most 20 per queue
        )

A rule is a value checked when it is made; the model checks, when it is mapped, that
its keys are columns of the table, and adds the index each rule's claims count with.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Final, TypeAlias

__all__ = [
    "MAX_CONCURRENCY", "MAX_RATE_PERIOD", "ON_DEAD_LETTER", "Concurrency", "FlowRule", "InOrder", "RateLimit",
    "check_queue_limits", "check_retention", "check_rules", "rate_periods",
    "takes_turns",
]

#: The largest limit a rule may set: a claim counts at most this many running jobs.
MAX_CONCURRENCY: Final = 1_000_000


@dataclass(frozen=True)
class Concurrency:
    """At most ``limit`` jobs running at once per value of the column ``key``, across
    every worker and process; ``key=None``: at most ``limit`` in the whole table, and
    ``key="queue"`` is a limit per queue.

    Strict: the worker's claims of a table with a rule take turns (a transaction-level
    advisory lock of the table's, held for the claim's statement only), so each counts
    what every earlier claim committed. Jobs whose key is NULL are not limited.

    ``fair=True``: a claim goes round the keys that have pending jobs (a loose index
    scan) and takes at most ``limit`` candidates of each, instead of reading the pending
    jobs in order and passing over a full key's backlog row by row: a key with a million
    jobs waiting costs a claim no more than one with ten. One fair rule per table."""

    limit: int
    key: str | None = None
    fair: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or not 1 <= self.limit <= MAX_CONCURRENCY:
            raise ValueError(f"Concurrency limit must be an integer from 1 to {MAX_CONCURRENCY}, got {self.limit!r}")
        if self.key is not None and (not isinstance(self.key, str) or not self.key):
            raise TypeError(f"Concurrency key must be a column name or None, got {self.key!r}")
        if not isinstance(self.fair, bool):
            raise TypeError(f"Concurrency fair must be a bool, got {self.fair!r}")
        if self.fair and self.key is None:
            raise ValueError("Concurrency(fair=True) needs a key: claims go round the keys")


#: The longest period of a rate limit: a day (finished rows must be kept that long).
MAX_RATE_PERIOD: Final = 86_400.0


@dataclass(frozen=True)
class RateLimit:
    """At most ``limit`` starts (claims) in any ``per`` seconds (a number or a timedelta),
    per value of the column ``key`` (``key="queue"``: per queue; None: in the whole table).

    Counted over the rows' own start times (``started_at``, set by each claim): a sliding
    window, which bounds each claim's size by what is left in it. ``strict=True``: claims
    take turns (as under a :class:`Concurrency` rule), and a job is not started again
    within ``per`` of its own previous start (a retry or a snooze waits until then, since
    its new start would replace the old one in the count), so no window ever holds more
    than ``limit`` starts. Otherwise concurrent claims can each see the same count: see
    the flow control guide for the bound. Jobs whose key is NULL are not limited. Finished
    rows are the count: keep them (retention) at least ``per``."""

    limit: int
    per: timedelta | float
    key: str | None = None
    strict: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or not 1 <= self.limit <= MAX_CONCURRENCY:
            raise ValueError(f"RateLimit limit must be an integer from 1 to {MAX_CONCURRENCY}, got {self.limit!r}")
        seconds = self.per.total_seconds() if isinstance(self.per, timedelta) else self.per
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds) or not (
            0.001 <= seconds <= MAX_RATE_PERIOD
        ):
            raise ValueError(
                f"RateLimit per must be a duration from 1 ms to {MAX_RATE_PERIOD:.0f} s, got {self.per!r}"
            )
        object.__setattr__(self, "per", float(seconds))
        if self.key is not None and (not isinstance(self.key, str) or not self.key):
            raise TypeError(f"RateLimit key must be a column name or None, got {self.key!r}")
        if not isinstance(self.strict, bool):
            raise TypeError(f"RateLimit strict must be a bool, got {self.strict!r}")

    @property
    def seconds(self) -> float:
        """``per`` in seconds."""
        per = self.per
        return per.total_seconds() if isinstance(per, timedelta) else float(per)


#: What a dead-lettered job does to the jobs of its key after it, under :class:`InOrder`.
ON_DEAD_LETTER: Final = ("block", "skip")


@dataclass(frozen=True)
class InOrder:
    """The jobs of one value of the column ``key`` run one at a time, in enqueue order
    (``created_at``, then the primary key): a job is claimed only when no earlier job of
    its key is pending or running, so a key's head that waits (a retry's backoff, a
    snooze, a delay) holds back the rest, and the claim never slides past it.

    ``on_dead_letter``: a head that ends ``failed`` ``"block"``s its key until it is
    requeued, deleted or cancelled (the default: the next job may depend on it), or lets
    the next one run (``"skip"``). A cancelled head never blocks. Jobs whose key is NULL
    are not ordered."""

    key: str
    on_dead_letter: str = "block"

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise TypeError(f"InOrder key must be a column name, got {self.key!r}")
        if self.on_dead_letter not in ON_DEAD_LETTER:
            raise ValueError(f"InOrder on_dead_letter must be 'block' or 'skip', got {self.on_dead_letter!r}")


FlowRule: TypeAlias = Concurrency | RateLimit | InOrder


def takes_turns(rules: Iterable[FlowRule]) -> bool:
    """Whether claims under ``rules`` must take turns: a concurrency rule, or a strict
    rate limit."""
    return any(isinstance(rule, Concurrency) or (isinstance(rule, RateLimit) and rule.strict) for rule in rules)


def check_rules(owner: str, rules: object, columns: Iterable[str]) -> tuple[FlowRule, ...]:
    """``rules`` (one rule or an iterable of them) as a tuple, each key a column of
    ``columns``, no key limited twice; ``owner`` names the model in the errors."""
    if isinstance(rules, Concurrency | RateLimit | InOrder):
        rules = (rules,)
    if isinstance(rules, str | bytes) or not isinstance(rules, Iterable):
        raise TypeError(f"{owner}.__queue_flow__ must be a sqla_queue flow rule or a tuple of them, got {rules!r}")
    found = tuple(rules)
    names = set(columns)
    seen: set[tuple[type, str | None]] = set()
    for rule in found:
        if not isinstance(rule, Concurrency | RateLimit | InOrder):
            raise TypeError(f"{owner}.__queue_flow__ holds {rule!r}, which is not a sqla_queue flow rule")
        kind = type(rule).__name__
        if rule.key is not None and rule.key not in names:
            raise ValueError(f"{owner}.__queue_flow__: {kind} key {rule.key!r} is not a column of the table")
        if (type(rule), rule.key) in seen:
            raise ValueError(f"{owner}.__queue_flow__ limits key {rule.key!r} twice: give it one {kind}")
        if isinstance(rule, Concurrency) and rule.fair and any(
            isinstance(other, Concurrency) and other.fair and other is not rule for other in found
        ):
            raise ValueError(f"{owner}.__queue_flow__ has two fair Concurrency rules: claims go round one key")
        if isinstance(rule, RateLimit) and "started_at" not in names:
            raise ValueError(f"{owner}.__queue_flow__: a RateLimit counts started_at, which the table lacks")
        seen.add((type(rule), rule.key))
    return found


def check_queue_limits(owner: str, rules: Iterable[FlowRule], concurrency: object, rate: object) -> None:
    """Refuse a queue's limits set at run time that would replace no declared rule, or
    that are not integers from 1 to :data:`MAX_CONCURRENCY` (None: the model's own).
    ``concurrency`` replaces the limit of a ``Concurrency(…, key="queue")``, ``rate``
    that of a ``RateLimit(…, key="queue")`` (its period stays the model's)."""
    found = tuple(rules)
    for name, value, kind in (("concurrency", concurrency, Concurrency), ("rate", rate, RateLimit)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CONCURRENCY:
            raise ValueError(f"a queue's {name} must be an integer from 1 to {MAX_CONCURRENCY} or None, got {value!r}")
        if not any(isinstance(rule, kind) and rule.key == "queue" for rule in found):
            raise ValueError(
                f"{owner}.__queue_flow__ declares no {kind.__name__}(…, key=\"queue\"): a queue's {name} set at run "
                f"time replaces that rule's limit for one queue; declare it (its limit is every other queue's)"
            )


def rate_periods(rules: Iterable[FlowRule]) -> list[float]:
    """The periods, in seconds, of the rate limits among ``rules``."""
    return [rule.seconds for rule in rules if isinstance(rule, RateLimit)]


def check_retention(owner: str, rules: Iterable[FlowRule], ages: dict[str, float]) -> None:
    """Refuse a retention that would prune finished rows a rate limit still counts: every
    age must be at least the longest rate period."""
    periods = rate_periods(rules)
    if not periods or not ages:
        return
    longest = max(periods)
    short = {status: age for status, age in ages.items() if age < longest}
    if short:
        raise ValueError(
            f"retention {short} is shorter than the {longest:g} s period of {owner}'s RateLimit: finished rows "
            f"count as starts until then; keep them at least that long"
        )
