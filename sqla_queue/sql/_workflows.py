"""Dependencies: how the statement that ends a parent counts its children down, releases the
ones it takes to zero, and applies the workflow's policy when the parent ended
``failed`` or ``cancelled``, all inside that statement (so in its transaction); and the
reads and the cancel of a whole workflow.

The count lives on each child (``waiting_on``), not on a row per workflow. A parent is
counted by the statement that clears its ``child_ids`` (read here from the statement's
snapshot, as they were before), so no parent counts twice; a parent held by the ``hold``
policy keeps them, and counts when it is requeued and ends ``done``. A transaction that
rolls back takes its count with it.

A fan-in's parents all write one child, and a row lock lasts until its transaction
commits: were each completion to wait for the child, the completions would take turns,
from one's statement to its commit. So the worker's statements (those given the keys
they may end, ``taken``) lock their children with ``SKIP LOCKED``: a child another
transaction holds is not waited for, and the parent keeps it in ``child_ids``, a debt,
which the statement returns (a last column, ``child_ids``: what each row kept). After
the commit, the worker has its sweeper run :func:`settle_edges`: it takes such parents
(an index of them, empty most of the time), waits for their children's rows, and counts
them as the parent's statement would have. The child is released once, by whichever
statement takes its count to zero, and only after every parent's commit: a debt is on a
committed row. Every sweeper tick settles too, so a worker that died between its commit
and the settle costs a sweep interval at most. (Not a NOTIFY: a transaction that
notifies takes a lock held through its commit, one per database, so the commits of a
fan-in would take turns on it instead.)

Statements without ``taken`` (the sweeper's expiry, cancels, :func:`settle_edges`) wait
for the children's rows, in key order, so two of them wait for each other instead of
deadlocking; a worker's statement never waits, so it never joins such a cycle.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Final

from sqlalchemy import (
    CTE,
    CompoundSelect,
    Connection,
    Select,
    String,
    and_,
    any_,
    bindparam,
    case,
    func,
    literal,
    null,
    or_,
    select,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from ..model import WAKE_NONE, QueueTable, has_workflows, notify_channel, queue_table, status_literal, wake_mode
from ._base import CANCELLED, CHANNEL_PARAM, DONE, FAILED, PENDING, QueueModel, _clock
from ._notify import pg_notify

__all__ = [
    "CASCADE_REASON", "children_taken", "edges_cleared", "for_leaves", "release_children", "releases",
    "settle_edges", "wake_values", "workflow_jobs",
]

#: ``last_error`` of a job cancelled because a job above it ended failed or cancelled.
CASCADE_REASON: Final = "cancelled: a job it waited for ended failed or cancelled (the workflow's policy is 'cancel')"
#: The labels of the columns :func:`release_children` adds to a finishing UPDATE's RETURNING.
NOW_LABEL: Final = "sqla_queue_now"
POLICY_LABEL: Final = "sqla_queue_policy"
#: The label of the column a worker's finishing statement adds, last: each row's kept children.
KEPT_LABEL: Final = "sqla_queue_kept"


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


def children_taken(qt: QueueTable, targets: ColumnElement[Any]) -> CTE | None:
    """The children of the jobs ``targets`` (an array of keys: those a worker's statement
    may end) that no other transaction holds, locked for the statement (``SKIP LOCKED``:
    see the module's docstring); None on a table whose finishing statements release
    nothing now."""
    if not releases(qt):
        return None
    key = qt.pk
    parent = qt.table.alias("sqla_queue_target")
    children = select(func.unnest(parent.c.child_ids)).where(parent.c[key.name] == any_(targets))
    return (
        select(key.label("id"))
        .where(key == any_(_keys(qt, children)))
        .order_by(key)
        .with_for_update(skip_locked=True)
        .cte("sqla_queue_taken")
    )


def edges_cleared(qt: QueueTable, status: ColumnElement[Any], taken: CTE | None = None) -> dict[str, Any]:
    """The SET of a finishing statement whose rows move to ``status``: the ``child_ids``
    of each parent it is done with cleared, or with ``taken`` (:func:`children_taken`)
    only of the children it took (see the module's docstring); nothing on a table
    without workflows."""
    if not releases(qt):
        return {}
    c = qt.c
    if taken is None:
        remaining: ColumnElement[Any] = null()
    else:
        child = func.unnest(c.child_ids).column_valued("sqla_queue_child")
        kept = select(child).where(child.not_in(select(taken.c.id))).scalar_subquery()
        remaining = func.nullif(func.array(kept, type_=c.child_ids.type), literal([], c.child_ids.type))
    return {"child_ids": case((_counts(status, c.on_parent_failure), remaining), else_=c.child_ids)}


def release_children(qt: QueueTable, update: Any, taken: CTE | None = None) -> tuple[Any, list[CTE], list[Any]]:
    """``update`` (a finishing UPDATE … RETURNING whose first column is the key) as the CTE
    of the moved rows, the data-modifying CTEs that count down, release and cancel their
    children, to add to the statement that selects from it, and the columns to select:
    those ``update`` returns, and with ``taken`` one more, each row's kept children
    (NULL: none; see the module's docstring)."""
    c = qt.c
    kept: list[Any] = []
    if taken is not None:
        # RETURNING reads the new row: a parent it is done with that kept children owes them.
        owes = and_(c.child_ids.is_not(None), _counts(c.status, c.on_parent_failure))
        kept = [case((owes, c.child_ids), else_=null()).label(KEPT_LABEL)]
    moved = update.returning(*kept, c.status.label(NOW_LABEL), c.on_parent_failure.label(POLICY_LABEL)).cte(
        "sqla_queue_moved"
    )
    shown = list(moved.c)[:-2]
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
    counting = [or_(edges.c.now == status_literal(DONE), edges.c.policy == literal("run", String()))]
    if taken is not None:  # the other children stay owed
        counting.append(edges.c.child.in_(select(taken.c.id)))
    counted = (
        select(edges.c.child, func.count().label("n"))
        .where(*counting)
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
    # The rows to wait for and write, locked in key order: two statements that wait
    # release the same children in turn instead of deadlocking. Found by the key from
    # the few targets (an array, so an index scan whatever the planner guesses of the
    # CTEs' sizes). A row the statement moves itself (a cancel of a whole workflow) is
    # not written twice. With ``taken``, the children to count are locked already.
    targets = select(doomed.c.id) if taken is not None else select(counted.c.child).union(select(doomed.c.id))
    locked = (
        select(key.label("id"))
        .where(key == any_(_keys(qt, targets)), key.not_in(select(moved_key)), c.status == status_literal(PENDING))
        .order_by(key)
        .with_for_update()
        .cte("sqla_queue_locked")
    )
    counted_rows = taken if taken is not None else locked
    left = c.waiting_on - counted.c.n
    wake: list[Any] = []
    if wake_mode(qt.table) != WAKE_NONE:
        # The queue's wake-up, delivered at commit (PostgreSQL folds the identical ones), on
        # the declared table's channel unless the worker binds its own (see CHANNEL_PARAM).
        channel = bindparam(CHANNEL_PARAM, notify_channel(qt.table), type_=String())
        wake = [case((left <= 0, pg_notify(channel, c.queue)), else_=null()).label("woke")]
    released = (
        qt.table.update()
        .where(
            key == any_(_keys(qt, select(counted_rows.c.id))),
            key == counted.c.child,
            key.not_in(select(doomed.c.id)),
            key.not_in(select(moved_key)),
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
    return moved, [released, cascaded], shown


def settle_edges(model: QueueModel, *, limit: int = 1000) -> Select[Any]:
    """Count down the children that parents ended without counting (another transaction
    held the child's row then: see the module's docstring), as their statements would
    have: release or cancel them. Takes up to ``limit`` such parents, skipping those
    another settle holds, and waits for their children's rows. Returns the key of each
    parent it settled. The worker's sweeper runs it when told, and on every tick."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    qt = queue_table(model)
    _required(qt)
    c = qt.c
    owing = (
        select(qt.pk)
        .where(c.child_ids.is_not(None), c.finished_at.is_not(None), _counts(c.status, c.on_parent_failure))
        .order_by(qt.pk)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    update = qt.table.update().where(qt.pk.in_(owing.scalar_subquery())).values(child_ids=null()).returning(qt.pk)
    _, writes, shown = release_children(qt, update)
    return select(*shown).add_cte(*writes)


def wake_values(model: QueueModel, conn: Connection | Session) -> dict[str, Any]:
    """The parameters that make a finishing statement run on ``conn`` (a SQLAlchemy
    connection or session) wake the workers of the table ``conn``'s
    ``schema_translate_map`` puts it in (:data:`~._base.CHANNEL_PARAM`): none on a table
    without workflows, whose statements release nothing of their own accord."""
    qt = queue_table(model)
    if not has_workflows(qt.table):
        return {}
    bound = conn.connection() if isinstance(conn, Session) else conn
    translate = bound.get_execution_options().get("schema_translate_map")
    return {CHANNEL_PARAM: notify_channel(qt.table, translate)}


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
