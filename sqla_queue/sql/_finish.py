"""The one wrapper of every statement that ends jobs (completion, retry, dead letter, the
sweeper's expiry, cancel): on a table that keeps results it NOTIFYs the ids it finished
(:mod:`._results`), and on a table with workflows it counts down and releases their
children, or applies the workflow's policy to them (:mod:`._workflows`), in the same
statement, so in the transaction that ends the parent and nowhere else.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import CTE, Select, select
from sqlalchemy.sql.dml import ReturningUpdate

from ..model import QueueTable, result_column
from ._results import results_notified
from ._workflows import release_children, releases

__all__ = ["Finishing", "finished"]

#: A statement that ends jobs: the UPDATE itself, or on a table that keeps results or
#: workflows, a SELECT of its rows that also does the rest. Either returns the same
#: columns.
Finishing = ReturningUpdate[Any] | Select[Any]


def finished(
    qt: QueueTable, update: ReturningUpdate[Any], *, failed_only: bool = False, taken: CTE | None = None
) -> Finishing:
    """``update`` as it is, or under a SELECT that returns the same columns and also
    NOTIFYs the finished ids and releases children (see the module's docstring).
    ``failed_only``: of the rows ``update`` returns, only those with status ``failed``
    finished (a retry's); its RETURNING must then include ``status``. ``taken``: the
    children it locked without waiting (:func:`~._workflows.children_taken`), which
    ``update``'s SET cleared with :func:`~._workflows.edges_cleared`."""
    results = result_column(qt.table) is not None
    flows = releases(qt)
    if not results and not flows:
        return update
    if flows:
        moved, writes, shown = release_children(qt, update, taken)
    else:
        moved, writes = update.cte("sqla_queue_moved"), []
        shown = list(moved.c)
    stmt = select(*shown)
    if results:
        stmt = stmt.where(results_notified(qt, moved, failed_only=failed_only))
    if writes:
        stmt = stmt.add_cte(*writes)
    return stmt
