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

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, TypeAlias

__all__ = ["Concurrency", "FlowRule", "MAX_CONCURRENCY", "check_rules"]

#: The largest limit a rule may set: a claim counts at most this many running jobs.
MAX_CONCURRENCY: Final = 1_000_000


@dataclass(frozen=True)
class Concurrency:
    """At most ``limit`` jobs running at once per value of the column ``key``, across
    every worker and process; ``key=None``: at most ``limit`` in the whole table, and
    ``key="queue"`` is a limit per queue.

    Strict: the worker's claims of a table with a rule take turns (a transaction-level
    advisory lock of the table's, held for the claim's statement only), so each counts
    what every earlier claim committed. Jobs whose key is NULL are not limited."""

    limit: int
    key: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or not 1 <= self.limit <= MAX_CONCURRENCY:
            raise ValueError(f"Concurrency limit must be an integer from 1 to {MAX_CONCURRENCY}, got {self.limit!r}")
        if self.key is not None and (not isinstance(self.key, str) or not self.key):
            raise TypeError(f"Concurrency key must be a column name or None, got {self.key!r}")


FlowRule: TypeAlias = Concurrency


def check_rules(owner: str, rules: object, columns: Iterable[str]) -> tuple[FlowRule, ...]:
    """``rules`` (one rule or an iterable of them) as a tuple, each key a column of
    ``columns``, no key limited twice; ``owner`` names the model in the errors."""
    if isinstance(rules, Concurrency):
        rules = (rules,)
    if isinstance(rules, str | bytes) or not isinstance(rules, Iterable):
        raise TypeError(f"{owner}.__queue_flow__ must be a sqla_queue flow rule or a tuple of them, got {rules!r}")
    found = tuple(rules)
    names = set(columns)
    seen: set[str | None] = set()
    for rule in found:
        if not isinstance(rule, Concurrency):
            raise TypeError(f"{owner}.__queue_flow__ holds {rule!r}, which is not a sqla_queue flow rule")
        if rule.key is not None and rule.key not in names:
            raise ValueError(f"{owner}.__queue_flow__: Concurrency key {rule.key!r} is not a column of the table")
        if rule.key in seen:
            raise ValueError(f"{owner}.__queue_flow__ limits key {rule.key!r} twice: give it one Concurrency")
        seen.add(rule.key)
    return found
