"""Dependencies: how the statement that ends a parent counts its children down, releases the
ones it takes to zero, and applies the workflow's policy when the parent ended
``failed`` or ``cancelled``, all inside that statement (so in its transaction); and the
reads and the cancel of a whole workflow.

The count lives on each child (``waiting_on``), not on a row per workflow: a fan-in of
many parents serialises only on the child's row, from each finishing statement's
decrement to its commit. The row lock does the rest: two parents ending at the same
moment lock the child in turn, the second re-reads the first's count (READ COMMITTED
re-checks a row updated under it), and exactly one takes it to zero. A parent's
transaction that rolls back takes its decrement with it. No parent counts twice: the
statement that counts a parent clears its ``child_ids`` (read here from the statement's
snapshot, as they were before). A parent held by the ``hold`` policy keeps them, so it
counts when it is requeued and ends ``done``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Final

from sqlalchemy import CTE, CompoundSelect, Select, String, and_, any_, case, func, literal, null, or_, select
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.sql.elements import ColumnElement

from ..model import WAKE_NONE, QueueTable, has_workflows, notify_channel, queue_table, status_literal, wake_mode
from ._base import CANCELLED, DONE, FAILED, PENDING, QueueModel, _clock
from ._notify import pg_notify

__all__ = ["CASCADE_REASON", "edges_cleared", "for_leaves", "release_children", "releases", "workflow_jobs"]

#: ``last_error`` of a job cancelled because a job above it ended failed or cancelled.
CASCADE_REASON: Final = "cancelled: a job it waited for ended failed or cancelled (the workflow's policy is 'cancel')"
#: The labels of the columns :func:`release_children` adds to a finishing UPDATE's RETURNING.
NOW_LABEL: Final = "sqla_queue_now"
POLICY_LABEL: Final = "sqla_queue_policy"


_LEAVES: ContextVar[bool] = ContextVar("sqla_queue_leaves", default=False)


@contextmanager
def for_leaves() -> Iterator[None]:
    """Build the finishing statements of a table with workflows for jobs that wait for
    nobody's end but their own: jobs without children (``child_ids`` NULL, which never
    changes once enqueued), which have nothing to release. They are the statements of a
    table without workflows; the worker runs them for a batch of such jobs only, and
    saves the release's cost on the jobs of a workflow table that no job waits for."""
    token = _LEAVES.set(True)
    try:
        yield
    finally:
        _LEAVES.reset(token)


def releases(qt: QueueTable) -> bool:
    """Whether the finishing statements built now release children (see :func:`for_leaves`)."""
    return has_workflows(qt.table) and not _LEAVES.get()


def _ended(status: ColumnElement[Any]) -> ColumnElement[bool]:
    return status.in_([status_literal(DONE), status_literal(FAILED), status_literal(CANCELLED)])


def _counts(status: ColumnElement[Any], policy: ColumnElement[Any]) -> ColumnElement[bool]:
    """Whether a parent that moved to ``status`` is done with its children: it ended
    ``done``, or ended otherwise under a policy other than ``hold``."""
    return and_(_ended(status), or_(status == status_literal(DONE), policy != literal("hold", String())))


def edges_cleared(qt: QueueTable, status: ColumnElement[Any]) -> dict[str, Any]:
    """The SET of a finishing statement whose rows move to ``status``: the ``child_ids``
    of each parent it is done with cleared (see the module's docstring); nothing on a
    table without workflows."""
    if not releases(qt):
        return {}
    c = qt.c
    return {"child_ids": case((_counts(status, c.on_parent_failure), null()), else_=c.child_ids)}


def release_children(qt: QueueTable, update: Any) -> tuple[Any, list[CTE]]:
    """``update`` (a finishing UPDATE … RETURNING whose first column is the key) as the CTE
    of the moved rows, and the data-modifying CTEs that count down, release and cancel
    their children, to add to the statement that selects from it. The moved CTE has two
    more columns than ``update`` returns, last: each row's new status and its policy."""
    c = qt.c
    moved = update.returning(c.status.label(NOW_LABEL), c.on_parent_failure.label(POLICY_LABEL)).cte(
        "sqla_queue_moved"
    )
    key = qt.pk
    moved_key = next(iter(moved.c))
    now, policy = moved.c[NOW_LABEL], moved.c[POLICY_LABEL]
    parent = qt.table.alias("sqla_queue_parent")
    # Each edge below a parent this statement is done with, as its snapshot had them.
    edges = (
        select(func.unnest(parent.c.child_ids).label("child"), now.label("now"), policy.label("policy"))
        .select_from(moved.join(parent, parent.c[key.name] == moved_key))
        .where(_counts(now, policy))
        .cte("sqla_queue_edges")
    )
    counted = (
        select(edges.c.child, func.count().label("n"))
        .where(or_(edges.c.now == status_literal(DONE), edges.c.policy == literal("run", String())))
        .group_by(edges.c.child)
        .cte("sqla_queue_counted")
    )
    # Everything below a parent that ended badly under 'cancel', waiting jobs only.
    below = qt.table.alias("sqla_queue_below")
    doomed = (
        select(edges.c.child.label("id"))
        .where(edges.c.now != status_literal(DONE), edges.c.policy == literal("cancel", String()))
        .cte("sqla_queue_doomed", recursive=True)
    )
    doomed = doomed.union(
        select(func.unnest(below.c.child_ids).label("id")).where(
            below.c[key.name] == doomed.c.id, below.c.status == status_literal(PENDING)
        )
    )
    # The rows to write, locked in key order: two statements releasing the same children
    # wait for each other instead of deadlocking. A row the statement moves itself (a
    # cancel of a whole workflow) is not written twice.
    # Found by the key from the few targets (an array, so an index scan whatever the
    # planner guesses of the CTEs' sizes), locked in key order.
    targets = select(counted.c.child).union(select(doomed.c.id))
    locked = (
        select(key.label("id"))
        .where(key == any_(_keys(qt, targets)), key.not_in(select(moved_key)), c.status == status_literal(PENDING))
        .order_by(key)
        .with_for_update()
        .cte("sqla_queue_locked")
    )
    left = c.waiting_on - counted.c.n
    wake: list[Any] = []
    if wake_mode(qt.table) != WAKE_NONE:
        # The queue's wake-up, delivered at commit (PostgreSQL folds the identical ones).
        wake = [case((left <= 0, pg_notify(notify_channel(qt.table), c.queue)), else_=null()).label("woke")]
    released = (
        qt.table.update()
        .where(
            key == any_(_keys(qt, select(locked.c.id))),
            key == counted.c.child,
            key.not_in(select(doomed.c.id)),
            c.status == status_literal(PENDING),
            c.waiting_on > 0,
        )
        .values(waiting_on=left, run_after=case((left <= 0, _clock()), else_=c.run_after))
        .returning(key, *wake)
        .cte("sqla_queue_released")
    )
    cascaded = (
        qt.table.update()
        .where(
            key == any_(_keys(qt, select(locked.c.id).where(locked.c.id.in_(select(doomed.c.id))))),
            c.status == status_literal(PENDING),
        )
        .values(
            status=status_literal(CANCELLED),
            finished_at=_clock(),
            last_error=CASCADE_REASON,
            child_ids=null(),
            lease_expires_at=null(),
        )
        .returning(key)
        .cte("sqla_queue_cascaded")
    )
    return moved, [released, cascaded]


def no_waiting_children(qt: QueueTable) -> list[ColumnElement[bool]]:
    """The condition of a delete, a prune or an archive on a table with workflows: not a
    job that a child still waits for (one of its ``child_ids`` pending: it has not
    ended, or it ended held by the ``hold`` policy). Deleting it would leave the child
    waiting for good; cancel the child, or the workflow, first."""
    if not has_workflows(qt.table):
        return []
    child = qt.table.alias("sqla_queue_waiting_child")
    waiting = (
        select(child.c[qt.pk.name])
        .where(child.c[qt.pk.name] == any_(qt.c.child_ids), child.c.status == status_literal(PENDING))
        .exists()
    )
    return [or_(qt.c.child_ids.is_(None), ~waiting)]


def _keys(qt: QueueTable, chosen: Select[Any] | CompoundSelect[Any]) -> ColumnElement[Any]:
    """``ARRAY(chosen)``: keys as one value, for ``= ANY``."""
    return func.array(chosen.scalar_subquery(), type_=ARRAY(qt.pk.type))


def workflow_jobs(model: QueueModel, workflow_id: Any, *, columns: Sequence[Any] = ()) -> Select[Any]:
    """The jobs of workflow ``workflow_id`` in key order: ``columns`` (default: key,
    status, waiting_on, parent_ids, child_ids and the task or queue)."""
    qt = queue_table(model)
    _required(qt)
    c = qt.c
    chosen = list(columns) or [
        qt.pk, c.status, c.waiting_on, c.parent_ids, c.task if qt.is_task_table else c.queue, c.last_error
    ]
    return select(*chosen).where(c.workflow_id == workflow_id).order_by(qt.pk)


def parents_of(model: QueueModel, job_id: Any, *columns: Any) -> Select[Any]:
    """``columns`` (default: key and status) of the parents of job ``job_id``, in key order."""
    qt = queue_table(model)
    _required(qt)
    child = qt.table.alias("sqla_queue_child")
    chosen = list(columns) or [qt.pk, qt.c.status]
    parent_ids = select(func.unnest(child.c.parent_ids)).where(child.c[qt.pk.name] == job_id)
    return select(*chosen).where(qt.pk.in_(parent_ids)).order_by(qt.pk)


def _required(qt: QueueTable) -> None:
    if not has_workflows(qt.table):
        raise TypeError(
            f"table {qt.table.name!r} keeps no workflows: mix sqla_queue.WorkflowMixin into its model"
        )
