"""The dashboard's workflow page: a workflow's jobs with their parents and children, its
counts, a picture of its graph when it is small, and the cancel of all of it; and what a
job's page shows of its workflow. The reads are shared with the JSON API (:mod:`.api`).

Every read is bounded whatever the workflow's size: the counts are one aggregate, the
jobs a keyset page, each job's parents and children the first :data:`LINKS_SHOWN` with
their number, and the picture is drawn (:mod:`.graph`) only for a workflow of at most
:data:`~.graph.PICTURE_JOBS` jobs. Children are read from the other jobs' ``parent_ids``,
which never change (a parent's ``child_ids`` are cleared once it has counted).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flask import Blueprint, abort, flash, redirect, render_template, request, url_for
from sqlalchemy import BigInteger, Connection, and_, any_, cast, func, literal, select, true
from sqlalchemy.dialects.postgresql import ARRAY

from .. import admin
from .. import sql as q
from ..enqueue.workflow import WAITING_RUN_AFTER
from ..model import JobStatus, has_workflows
from .graph import PICTURE_JOBS, picture
from .reads import _job_id

if TYPE_CHECKING:
    from werkzeug.wrappers import Response

    from . import _Settings, _Table

__all__ = [
    "LINKS_SHOWN", "FlowJob", "FlowSummary", "Link", "add_workflow_views", "job_workflow", "parse_workflow_id",
    "waiting_label", "workflow_jobs", "workflow_summary",
]

#: How many of a job's parents, and of its children, a page names (with their number).
LINKS_SHOWN = 20
#: How much of the end of ``last_error`` a row reads, for its last line.
_ERROR_TAIL = 300
_PENDING, _RUNNING = JobStatus.PENDING.value, JobStatus.RUNNING.value


@dataclass(frozen=True)
class Link:
    """A job another one names (a parent, a child), with its status."""

    id: Any
    status: str


@dataclass(frozen=True)
class FlowSummary:
    """A workflow's counts: its jobs by status, those still waiting for a parent, its
    policy (one, as a workflow is enqueued with it; several only if written otherwise)."""

    id: uuid.UUID
    counts: dict[str, int]
    waiting: int
    policies: list[str]

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def done(self) -> int:
        return self.counts.get("done", 0)

    @property
    def unfinished(self) -> int:
        """What a cancel of the workflow takes: its pending and running jobs."""
        return self.counts.get(_PENDING, 0) + self.counts.get(_RUNNING, 0)


@dataclass
class FlowJob:
    """One job of a workflow's page."""

    id: Any
    queue: str
    task: str | None
    status: str
    waiting_on: int
    attempts: int
    max_attempts: int
    last_error: str | None  # its end, for the last line
    parents: list[Link] = field(default_factory=list)
    parents_total: int = 0
    children: list[Link] = field(default_factory=list)
    children_total: int = 0

    @property
    def name(self) -> str:
        return self.task if self.task is not None else self.queue


def parse_workflow_id(value: str) -> uuid.UUID | None:
    """A workflow's id from a URL or a body, None when it cannot be one."""
    try:
        return uuid.UUID(value)
    except (ValueError, AttributeError, TypeError):
        return None


def waiting_label(row: Mapping[str, Any]) -> str | None:
    """What a page shows for a waiting job's ``run_after`` (the sentinel no date is):
    ``waiting`` while pending, ``never released`` once it ended otherwise; None for a
    real date."""
    if row.get("run_after") != WAITING_RUN_AFTER:
        return None
    return "waiting" if row.get("status") == _PENDING else "never released"


def workflow_summary(settings: _Settings, entry: _Table, workflow: uuid.UUID) -> FlowSummary | None:
    """The counts of ``workflow``; None when it has no job in the table."""
    c = entry.qt.c
    columns = [c.status, c.on_parent_failure, func.count(),
               func.count().filter(and_(c.status == _PENDING, c.waiting_on > 0))]
    stmt = q.workflow_jobs(entry.model, workflow, columns=columns).order_by(None).group_by(
        c.status, c.on_parent_failure)
    with settings.engine.connect() as conn:
        rows = conn.execute(stmt).all()
    if not rows:
        return None
    counts = dict.fromkeys((s.value for s in JobStatus), 0)
    for status, _, n, _ in rows:
        counts[status] = counts.get(status, 0) + int(n)
    return FlowSummary(workflow, counts, sum(int(r[3]) for r in rows), sorted({r[1] for r in rows}))


def workflow_jobs(
    settings: _Settings, entry: _Table, workflow: uuid.UUID, *, after: Any, limit: int
) -> tuple[list[FlowJob], Any]:
    """A page of ``workflow``'s jobs in key order after the key ``after``, each with its
    first parents and children; and the key the next page starts after (None: last)."""
    qt = entry.qt
    c = qt.c
    columns = [qt.pk, c.queue, c.task if entry.has_task else literal(None).label("task"), c.status, c.waiting_on,
               c.attempts, c.max_attempts, func.right(c.last_error, _ERROR_TAIL).label("last_error"), c.parent_ids]
    stmt = q.workflow_jobs(entry.model, workflow, columns=columns).limit(limit + 1)
    if after is not None:
        stmt = stmt.where(qt.pk > after)
    with settings.engine.connect() as conn:
        rows = conn.execute(stmt).all()
        more = len(rows) > limit
        rows = rows[:limit]
        jobs = [FlowJob(*row[:-1]) for row in rows]
        parent_ids = {job.id: list(row[-1] or ()) for job, row in zip(jobs, rows, strict=True)}
        shown = {key for ids in parent_ids.values() for key in ids[:LINKS_SHOWN]}
        statuses = _statuses(conn, entry, workflow, shown)
        children = _children(conn, entry, workflow, [job.id for job in jobs])
    for job in jobs:
        ids = parent_ids[job.id]
        job.parents = [Link(key, statuses.get(key, "?")) for key in ids[:LINKS_SHOWN]]
        job.parents_total = len(ids)
        job.children, job.children_total = children.get(job.id, ([], 0))
    return jobs, (jobs[-1].id if more else None)


def workflow_graph(settings: _Settings, entry: _Table, workflow: uuid.UUID) -> list[Any]:
    """Every job of ``workflow`` as the picture needs it (key, name, status, waiting_on,
    parent_ids): for a workflow of at most :data:`~.graph.PICTURE_JOBS` jobs."""
    qt = entry.qt
    c = qt.c
    columns = [qt.pk, c.task if entry.has_task else c.queue, c.status, c.waiting_on, c.parent_ids]
    stmt = q.workflow_jobs(entry.model, workflow, columns=columns).limit(PICTURE_JOBS + 1)
    with settings.engine.connect() as conn:
        return list(conn.execute(stmt).all())


def job_workflow(settings: _Settings, entry: _Table, values: Mapping[str, Any]) -> dict[str, Any] | None:
    """What a job's page shows of its workflow: its id and policy, the first parents and
    children with their statuses and their numbers; None for a table without workflows
    or a job enqueued alone."""
    if not has_workflows(entry.qt.table) or values.get("workflow_id") is None:
        return None
    workflow, key = values["workflow_id"], values[entry.qt.pk.name]
    parent_ids = list(values.get("parent_ids") or ())
    with settings.engine.connect() as conn:
        statuses = _statuses(conn, entry, workflow, parent_ids[:LINKS_SHOWN])
        children, children_total = _children(conn, entry, workflow, [key]).get(key, ([], 0))
    return {
        "id": workflow,
        "policy": values.get("on_parent_failure"),
        "waiting_on": values.get("waiting_on") if values.get("status") == _PENDING else 0,
        "parents": [Link(p, statuses.get(p, "?")) for p in parent_ids[:LINKS_SHOWN]],
        "parents_total": len(parent_ids),
        "children": children,
        "children_total": children_total,
    }


def _statuses(conn: Connection, entry: _Table, workflow: uuid.UUID, keys: Iterable[Any]) -> dict[Any, str]:
    """The statuses of the jobs ``keys`` of ``workflow`` (found by their keys)."""
    wanted = sorted(set(keys))
    if not wanted:
        return {}
    pk = entry.qt.pk
    stmt = q.workflow_jobs(entry.model, workflow, columns=[pk, entry.qt.c.status]).where(
        pk == any_(cast(wanted, ARRAY(BigInteger))))
    return {row[0]: row[1] for row in conn.execute(stmt).all()}


def _children(
    conn: Connection, entry: _Table, workflow: uuid.UUID, keys: list[Any]
) -> dict[Any, tuple[list[Link], int]]:
    """The first :data:`LINKS_SHOWN` children of each job of ``keys`` and their number:
    the jobs of ``workflow`` whose ``parent_ids`` name it, in one pass over the workflow."""
    if not keys:
        return {}
    qt = entry.qt
    c = qt.c
    wanted = cast(keys, ARRAY(BigInteger))
    named = select(func.unnest(c.parent_ids).label("parent")).correlate(qt.table).lateral("sqla_queue_named")
    parent = named.c.parent
    edges = (
        q.workflow_jobs(entry.model, workflow, columns=[
            parent, qt.pk.label("child"), c.status.label("status"),
            func.row_number().over(partition_by=parent, order_by=qt.pk).label("n"),
            func.count().over(partition_by=parent).label("total"),
        ])
        .select_from(qt.table.join(named, true()))
        .order_by(None)
        .where(c.parent_ids.overlap(wanted), parent == any_(wanted))
        .subquery("sqla_queue_edges")
    )
    stmt = select(edges.c.parent, edges.c.child, edges.c.status, edges.c.total).where(
        edges.c.n <= LINKS_SHOWN).order_by(edges.c.parent, edges.c.child)
    found: dict[Any, tuple[list[Link], int]] = {}
    for parent_key, child, status, total in conn.execute(stmt).all():
        links, _ = found.setdefault(parent_key, ([], int(total)))
        links.append(Link(child, status))
    return found


def add_workflow_views(bp: Blueprint, settings: _Settings, *, guard: Callable[[], None]) -> None:
    """Register the workflow page, its cancel (a confirm page, then the POST) and the
    helpers the job pages use on ``bp``. ``guard`` runs before the cancel: it refuses a
    read-only dashboard and a missing CSRF token."""

    @bp.context_processor
    def _helpers() -> dict[str, Any]:
        return {"waiting_label": waiting_label}

    def found(table: str, workflow_id: str) -> tuple[_Table, FlowSummary]:
        entry = settings.table(table)
        workflow = parse_workflow_id(workflow_id)
        if not has_workflows(entry.qt.table) or workflow is None:
            abort(404)
        summary = workflow_summary(settings, entry, workflow)
        if summary is None:
            abort(404)
        return entry, summary

    @bp.get("/<path:table>/workflow/<workflow_id>", endpoint="workflow")
    def page(table: str, workflow_id: str) -> str:
        entry, summary = found(table, workflow_id)
        after = request.args.get("after")
        jobs, next_after = workflow_jobs(
            settings, entry, summary.id, after=_job_id(entry, after) if after else None, limit=settings.page_size)
        drawn = None
        if summary.total <= PICTURE_JOBS:
            drawn = picture(workflow_graph(settings, entry, summary.id),
                            lambda key: url_for(".job", table=entry.key, job_id=str(key)))
        here = url_for(".workflow", table=entry.key, workflow_id=str(summary.id))
        return render_template(
            "sqla_queue_dashboard/workflow.html", table=entry, flow=summary, jobs=jobs, picture=drawn,
            picture_limit=PICTURE_JOBS, statuses=[s.value for s in JobStatus], links_shown=LINKS_SHOWN,
            next_url=f"{here}?after={next_after}" if next_after is not None else None,
            first_url=here if after else None,
        )

    @bp.get("/<path:table>/workflow/<workflow_id>/cancel", endpoint="workflow_cancel")
    def confirm(table: str, workflow_id: str) -> str:
        if settings.read_only:
            abort(403, "the dashboard is read-only")
        entry, summary = found(table, workflow_id)
        return render_template("sqla_queue_dashboard/confirm_workflow_cancel.html", table=entry, flow=summary)

    @bp.post("/<path:table>/workflow/<workflow_id>/cancel", endpoint="workflow_cancel_run")
    def cancel(table: str, workflow_id: str) -> Response:
        guard()
        entry, summary = found(table, workflow_id)
        cancelled = admin.cancel(settings.engine, entry.model, workflow=summary.id)
        flash(f"cancelled {len(cancelled)} job(s) of workflow {summary.id} (finished ones stay as they are)", "ok")
        return redirect(url_for(".workflow", table=entry.key, workflow_id=str(summary.id)))

