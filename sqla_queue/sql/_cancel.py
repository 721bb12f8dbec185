"""Cancel: pending and running jobs to ``cancelled``, a fenced transition (a running
attempt's later statements match nothing), and the cancel of jobs not claimed yet.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import null, select
from sqlalchemy.sql.elements import ColumnElement

from ..model import QueueTable, has_workflows, queue_table, status_literal
from ._base import CANCELLED, PENDING, RUNNING, QueueModel, _clock, _kind_filter, _pk_in, _queue_filter, _status
from ._finish import Finishing, finished
from ._history import history_values
from ._workflows import edges_cleared


def cancel_jobs(
    model: QueueModel,
    *,
    ids: Iterable[Any] | None = None,
    queues: Sequence[str] | None = None,
    workflow_id: Any = None,
) -> Finishing:
    """Cancel pending **and running** jobs: ``cancelled``, finished now, no lease expiry
    (``lease_owner`` is kept: the worker that held it).

    A fenced transition: a running attempt of a cancelled job can no longer complete,
    retry or fail (every later statement of its worker is fenced by ``status =
    'running'``), so its handler's transactional writes roll back, whatever it does. The
    cancel and a completion racing it lock the same row: the first to commit wins, the
    other matches nothing. ``ids`` and/or ``queues`` choose the jobs (an empty ``ids``
    cancels none; neither: every unfinished job); ``workflow_id``, the unfinished jobs of
    one workflow (a table with :class:`~sqla_queue.WorkflowMixin`). Returns ``(pk,
    status before)`` of each job cancelled; the running ones' workers learn it from
    :func:`sqla_queue.cancel`'s NOTIFY, or their next poll of their jobs.
    """
    qt = queue_table(model)
    conditions: list[ColumnElement[bool]] = [_unfinished(qt), *_queue_filter(qt, queues), *_kind_filter(qt)]
    if ids is not None:
        conditions.append(_pk_in(qt, ids))
    if workflow_id is not None:
        if not has_workflows(qt.table):
            raise TypeError(f"table {qt.table.name!r} keeps no workflows: mix sqla_queue.WorkflowMixin into its model")
        conditions.append(qt.c.workflow_id == workflow_id)
    return _cancel(qt, conditions)


def _unfinished(qt: QueueTable) -> ColumnElement[bool]:
    """What a cancel takes: pending and running jobs."""
    column: ColumnElement[str] = qt.c.status
    return column.in_([status_literal(PENDING), status_literal(RUNNING)])


def _cancel(qt: QueueTable, conditions: list[ColumnElement[bool]]) -> Finishing:
    """The cancel of the rows ``conditions`` pick (among them :func:`_unfinished`),
    locked, each returned with its status before."""
    c = qt.c
    before = select(qt.pk, c.status).where(*conditions).with_for_update().subquery("sqla_queue_before")
    name = qt.pk.name
    update = (
        qt.table.update()
        .where(qt.pk == before.c[name], c.status.in_([status_literal(PENDING), status_literal(RUNNING)]))
        .values(
            status=status_literal(CANCELLED), finished_at=_clock(), lease_expires_at=null(),
            # A running attempt ends here (a pending job has none running).
            **history_values(qt, "cancelled", when=before.c.status == status_literal(RUNNING)),
            **edges_cleared(qt, status_literal(CANCELLED)),
        )
        .returning(qt.pk, before.c.status)
    )
    return finished(qt, update)


def cancel_pending(model: QueueModel, *, ids: Iterable[Any]) -> Finishing:
    """Cancel jobs that have not been claimed yet; running jobs are left to finish.

    An empty ``ids`` cancels nothing.
    """
    qt = queue_table(model)
    update = (
        qt.table.update()
        .where(_status(qt, PENDING), _pk_in(qt, ids))
        .values(status=status_literal(CANCELLED), finished_at=_clock(), **edges_cleared(qt, status_literal(CANCELLED)))
        .returning(qt.pk)
    )
    return finished(qt, update)
