"""The one bounded cache: resolved queue tables, row plans, the statements they compile.

Everything worked out once per model, dialect and shape of call (a model's queue table,
a table's rules and defaults, the INSERT of ``enqueue_values()`` for a set of columns,
the NOTIFY statements of a commit) is kept here, under keys that say what it depends on, so
that no path grows a cache of its own and none grows without bound: past
:data:`MAX_ENTRIES` the oldest entry goes (a plan is rebuilt on its next use; a caller
holding one keeps using it).

Lookups are a plain ``dict.get`` (:attr:`PlanCache.get`): the hot paths pay nothing more.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Final, TypeVar

__all__ = ["MAX_ENTRIES", "PlanCache", "plans"]

T = TypeVar("T")

#: Entries kept at most, all kinds together.
MAX_ENTRIES: Final = 2048


class PlanCache:
    """A dict bounded by insertion order: the oldest entry is dropped when it is full.

    Not an LRU on purpose: a hit costs one ``dict.get`` and no bookkeeping, and an entry
    dropped while still in use is only rebuilt.
    """

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self._items: dict[Hashable, Any] = {}
        #: ``get(key)``: the entry, or None (the dict's own bound method).
        self.get: Callable[[Hashable], Any] = self._items.get

    def put(self, key: Hashable, value: T) -> T:
        """Keep ``value`` under ``key`` (dropping the oldest entry if full); return it."""
        items = self._items
        if key not in items and len(items) >= self.max_entries:
            del items[next(iter(items))]
        items[key] = value
        return value

    def get_or_build(self, key: Hashable, build: Callable[[], T]) -> T:
        """The entry under ``key``, built by ``build()`` and kept on first use."""
        found = self._items.get(key)
        if found is None:
            found = self.put(key, build())
        return found

    def clear(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items


#: The cache every enqueue path shares.
plans: Final = PlanCache()
