""":class:`RetentionOps`: the pruning statement of one worker (finished jobs past their
age, in batches, under the table's advisory lock)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import sql as q
from ..driver import DbConnection, Driver
from ..model import queue_table


class RetentionOps:
    """The pruning statement of one worker: finished jobs past their status's age, up to
    ``limit`` a statement, under the table's advisory lock (at most one worker prunes a
    table at a time; the others delete nothing)."""

    def __init__(self, driver: Driver, model: Any, ages: Mapping[str, float], *, limit: int) -> None:
        self.limit = limit
        pk = queue_table(model).pk
        stmt = q.prune_finished(model, older_than=dict(ages), limit=limit, exclusive=True).returning(pk)
        self._prune = driver.compile(stmt)

    def prune(self, conn: DbConnection) -> int:
        """Delete one batch (autocommit: one short transaction); how many rows went."""
        return len(conn.execute(self._prune, {}))
