"""The dashboard's bulk actions by filter: requeue, cancel or delete every job the jobs
page's filter matches, on all its pages (:mod:`sqla_queue.bulk_actions`).

A GET shows how many jobs the filter matches and how many of them the action takes, with
the form that confirms it; the POST (CSRF token, refused read-only) walks them in batches
of :data:`~sqla_queue.sql.BULK_BATCH`, one statement each, over the jobs that existed at
the count. A delete keeps the jobs that still hold their unique key, then asks, as the
delete of a selection does, before a second walk frees them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from datetime import datetime
from typing import TYPE_CHECKING, Any

from flask import Blueprint, abort, flash, redirect, render_template, request, url_for
from werkzeug.datastructures import MultiDict

from .. import sql as q
from ..admin import JobFilters
from ..bulk_actions import ACTIONS, count_matching, run_bulk

if TYPE_CHECKING:
    from werkzeug.wrappers import Response

    from . import _Settings, _Table

__all__ = ["add_bulk_views"]

#: What each action says it did, and of which jobs.
_DONE = {"requeue": "requeued", "cancel": "cancelled", "delete": "deleted"}
_TAKES = {
    "requeue": "dead letters (failed jobs) only",
    "cancel": "pending and running jobs (a running job's handler is told, and can no longer complete)",
    "delete": "every job but running ones, and none that still holds its unique key",
}


def add_bulk_views(
    bp: Blueprint,
    settings: _Settings,
    *,
    guard: Callable[[], None],
    split: Callable[[list[str]], tuple[str, ...]],
    statuses: Collection[str],
) -> None:
    """Register the bulk actions' confirm page and their POST on ``bp``. ``guard`` runs
    before the action (read-only mode, CSRF token); ``split`` reads the jobs page's
    comma-separated filter fields, ``statuses`` are the known statuses."""

    def filters_of(entry: _Table, values: MultiDict[str, str]) -> JobFilters:
        """The jobs page's filter, strictly: an unknown status is refused, not dropped
        (dropping it would widen the filter of a destructive action)."""
        chosen = split(values.getlist("status"))
        unknown = [s for s in chosen if s not in statuses]
        if unknown:
            abort(400, f"unknown status {unknown[0]!r}")
        tasks = split(values.getlist("task"))
        if tasks and not entry.has_task:
            abort(400, "this table has no task column")
        return JobFilters(
            queues=split(values.getlist("queue")), statuses=chosen, tasks=tasks,
            error_contains=values.get("error") or None,
        )

    def action_of(values: MultiDict[str, str]) -> str:
        action = values.get("action", "")
        if action not in ACTIONS:
            abort(400, f"unknown action {action!r}")
        return action

    @bp.get("/<path:table>/bulk", endpoint="bulk")
    def confirm(table: str) -> str:
        entry = settings.table(table)
        if settings.read_only:
            abort(403, "the dashboard is read-only")
        action = action_of(request.args)
        filters = filters_of(entry, request.args)
        count = count_matching(settings.engine, entry.model, action, filters)
        return render_template(
            "sqla_queue_dashboard/confirm_bulk.html", table=entry, action=action, filters=filters, count=count,
            fields=_fields(filters), takes=_TAKES[action], back=_jobs_url(entry, filters), batch=q.BULK_BATCH,
            free_keys=False,
        )

    @bp.post("/<path:table>/bulk", endpoint="bulk_run")
    def run(table: str) -> Response | str:
        entry = settings.table(table)
        guard()
        action = action_of(request.form)
        filters = filters_of(entry, request.form)
        as_of = _as_of(request.form.get("as_of", ""))
        free_keys = action == "delete" and request.form.get("free_keys") == "1"
        result = run_bulk(settings.engine, entry.model, action, filters, created_before=as_of, free_keys=free_keys)
        flash(f"{_DONE[action]} {result.done} job(s) matching the filter, in {result.batches} statement(s) of at "
              f"most {q.BULK_BATCH} rows", "ok")
        if action == "delete" and not free_keys:
            kept = count_matching(settings.engine, entry.model, action, filters, created_before=as_of)
            if kept.holding_keys:
                # Deleting these frees their keys, so the work could run again: ask first.
                return render_template(
                    "sqla_queue_dashboard/confirm_bulk.html", table=entry, action=action, filters=filters,
                    count=kept, fields=_fields(filters), takes=_TAKES[action], back=_jobs_url(entry, filters),
                    batch=q.BULK_BATCH, free_keys=True, as_of=as_of,
                )
        return redirect(_jobs_url(entry, filters))


def _fields(filters: JobFilters) -> dict[str, str]:
    """The filter as the jobs page's fields (comma-separated lists), for hidden inputs."""
    return {
        "queue": ",".join(filters.queues), "status": ",".join(filters.statuses), "task": ",".join(filters.tasks),
        "error": filters.error_contains or "",
    }


def _jobs_url(entry: _Table, filters: JobFilters) -> str:
    kept: dict[str, Any] = {key: value for key, value in _fields(filters).items() if value}
    return url_for(".jobs", table=entry.key, **kept)


def _as_of(value: str) -> datetime:
    """The moment of the count the operator confirmed: the walk's ``created_before``."""
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        abort(400, "the count this action confirms is missing: reload the page and try again")
    if moment.utcoffset() is None:
        abort(400, "the count this action confirms is missing: reload the page and try again")
    return moment
