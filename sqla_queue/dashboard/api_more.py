"""The JSON API's endpoints of the overview, the schedules page and the bulk actions by
filter: the same reads as those pages, and their actions under the API's checks (the
action endpoint of :mod:`.api`: ``api_actions``, read-only mode, the ``X-CSRF-Token``
header, the dashboard's ``Host`` and ``Origin`` checks).

- **Overview** (``/overview``, ``/tables/{t}/activity``): the page's cards and charts,
  :func:`.charts.overview_cards` over a window (``1h`` by minute, ``24h`` by quarter of an
  hour): jobs pending and running now, those finished in the window, each bucket's done
  and failed, waiting, pickup latency and run time (p50, p99).
- **Schedules** (``/tables/{t}/schedules``; actions ``run_now``, ``pause_schedule``,
  ``resume_schedule``): :func:`sqla_queue.schedule_actions.schedule_views`, and a run now
  fenced by the watermark the caller read (its ``last_tick``), as the page's form is.
- **Bulk actions by filter** (``/tables/{t}/bulk``; actions ``bulk_requeue``,
  ``bulk_cancel``, ``bulk_delete``): the count of :func:`sqla_queue.bulk_actions.count_matching`,
  then the walk of :func:`~sqla_queue.bulk_actions.run_bulk` over the jobs that existed
  at that count (its ``as_of``, which the action must send back, as the page's form does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from flask import Response, request, url_for

from .. import admin, schedule_actions
from .. import sql as q
from ..admin import JobFilters
from ..bulk_actions import ACTIONS as BULK_ACTIONS
from ..bulk_actions import count_matching, run_bulk
from ..periodic import MAX_NAME_LENGTH, Schedule, schedules_table
from .activity import WINDOWS, Window
from .api import _STATUSES, Action, ApiContext, ApiMore, _fail, _json, _names, _read_only_message
from .bulk import _TAKES
from .charts import STATUSES_NOW, STATUSES_WINDOW, Card, overview_cards
from .reads import _split
from .schedules import scheduled_tables

if TYPE_CHECKING:
    from . import _Settings, _Table

__all__ = ["more_endpoints"]

_BULK_ARGUMENTS = ("action", "queue", "status", "task", "error")


def more_endpoints(ctx: ApiContext, schedules: Mapping[Any, Sequence[Schedule]] | None) -> ApiMore:
    """Register the overview's, schedules' and bulk actions' reads on the API, and give
    their actions (``schedules``: the code's, by model, as the dashboard was given)."""
    settings, route, entry_of = ctx.settings, ctx.route, ctx.entry_of
    code, shown = scheduled_tables(settings, schedules)

    @route("/overview", "GET")
    def overview() -> Response:
        window = _window()
        return _json({
            "window": _window_view(window),
            "statuses_now": list(STATUSES_NOW),
            "statuses_window": list(STATUSES_WINDOW),
            "tables": [_table_overview(settings, entry, window) for entry in settings.tables.values()],
        })

    @route("/tables/<path:table>/activity", "GET")
    def activity(table: str) -> Response:
        entry = entry_of(table)
        window = _window()
        view, cards = overview_cards(settings, entry, window)
        return _json({
            "table": entry.key,
            "window": _window_view(window),
            "now": view.now,
            "start": view.start,
            "recorded": view.recorded,
            "mark": view.mark,
            "activity_table_missing": view.missing,
            "queues": [{**_card(card), "points": [vars(p) for p in card.activity.points]} for card in cards],
        })

    def scheduled(table: str) -> _Table:
        entry = entry_of(table)
        if entry.key not in shown:
            _fail(404, "no_schedules", f"{entry.key} has no schedules: none in the code the dashboard was given, "
                                       "no watermark table declared")
        return entry

    @route("/tables/<path:table>/schedules", "GET")
    def schedules_(table: str) -> Response:
        entry = scheduled(table)
        views = schedule_actions.schedule_views(settings.engine, entry.model, code.get(entry.key))
        return _json({
            "table": entry.key,
            "watermark_table": schedules_table(entry.model).fullname,
            "watermark_table_missing": views is None,
            "code_known": code.get(entry.key) is not None,
            "schedules": [_schedule(view) for view in views or ()],
        })

    @route("/tables/<path:table>/bulk", "GET")
    def bulk(table: str) -> Response:
        entry = entry_of(table)
        if not ctx.writable:  # the page's count is its action's confirm: refused where the action is
            _fail(403, "read_only", _read_only_message(settings.read_only))
        args = request.args
        unknown = sorted(set(args) - set(_BULK_ARGUMENTS))
        if unknown:
            _fail(400, "bad_filter", f"unknown argument(s) {', '.join(unknown)}: "
                                     f"the arguments are {', '.join(_BULK_ARGUMENTS)}")
        action = args.get("action", "")
        if action not in BULK_ACTIONS:
            _fail(400, "bad_filter", f"action is one of {', '.join(BULK_ACTIONS)}")
        filters = _filters(entry, {name: list(_split(args.getlist(name))) for name in ("queue", "status", "task")},
                           args.get("error") or None, kind="bad_filter")
        count = count_matching(settings.engine, entry.model, action, filters)
        return _json({
            "table": entry.key, "action": action, "filters": _filter_view(filters),
            "matched": count.matched, "acting": count.acting, "holding_keys": count.holding_keys,
            "as_of": count.as_of, "takes": _TAKES[action], "batch": q.BULK_BATCH,
            "run": url_for(".action", table=entry.key, verb=f"bulk_{action}"),
        })

    def listed(entry: _Table, body: Mapping[str, Any]) -> schedule_actions.ScheduleView:
        name = body.get("name")
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_LENGTH:
            _fail(400, "bad_body", f'"name" is a schedule\'s name (1 to {MAX_NAME_LENGTH} characters)')
        views = schedule_actions.schedule_views(settings.engine, entry.model, code.get(entry.key))
        if views is None:
            _fail(409, "watermark_table_missing", f"the watermark table {schedules_table(entry.model).fullname} "
                                                  "does not exist in this database")
        found = next((v for v in views if v.name == name), None)
        if found is None:
            _fail(404, "no_such_schedule", f"no schedule {name!r} in {entry.key}: neither in the code nor a row")
        return found

    def run_now(settings: _Settings, entry: _Table, body: Mapping[str, Any]) -> dict[str, Any]:
        entry = scheduled(entry.key)
        view = listed(entry, body)
        if view.schedule is None:
            _fail(400, "not_in_code", f"schedule {view.name!r} is not in the code the dashboard was given: "
                                      "nothing to enqueue it with")
        if "seen" not in body:
            _fail(400, "bad_body", '"seen" is the schedule\'s last_tick as you read it (null: none yet)')
        seen = _moment(body["seen"], "seen") if body["seen"] is not None else None
        try:
            ran = schedule_actions.run_now(settings.engine, entry.model, view.schedule, seen=seen)
        except Exception as exc:  # noqa: BLE001 - the schedule's own (its values callable, a value refused)
            # Rolled back with the watermark: nothing was enqueued, as a failed tick.
            _fail(422, "enqueue_failed", f"schedule {view.name}: its job could not be enqueued, nothing changed: "
                                         f"{type(exc).__name__}: {exc}")
        if ran.refused == "ticked":
            _fail(409, "schedule_ticked", f"schedule {view.name} ticked since its last_tick was read: nothing was "
                                          "enqueued. Read it again before running it now")
        if ran.refused == "busy":
            _fail(409, "schedule_busy", f"a worker is claiming a tick of schedule {view.name} right now: nothing "
                                        "was enqueued, try again")
        return {"name": view.name, "job": ran.key, "last_tick": ran.tick}

    def pause_or_resume(pause: bool) -> Action:
        def run(settings: _Settings, entry: _Table, body: Mapping[str, Any]) -> dict[str, Any]:
            entry = scheduled(entry.key)
            view = listed(entry, body)
            change = schedule_actions.pause if pause else schedule_actions.resume
            return {"name": view.name, "paused": pause, "changed": change(settings.engine, entry.model, view.name)}

        return run

    def links(entry: _Table) -> dict[str, Any]:
        return {
            "activity": url_for(".activity", table=entry.key),
            "schedules": url_for(".schedules_", table=entry.key) if entry.key in shown else None,
            "bulk": url_for(".bulk", table=entry.key) if ctx.writable else None,
        }

    def offered(entry: _Table) -> list[str]:
        verbs = [f"bulk_{action}" for action in BULK_ACTIONS]
        return verbs + (["run_now", "pause_schedule", "resume_schedule"] if entry.key in shown else [])

    actions: dict[str, Action] = {
        "run_now": run_now, "pause_schedule": pause_or_resume(True), "resume_schedule": pause_or_resume(False),
        **{f"bulk_{action}": _bulk(action) for action in BULK_ACTIONS},
    }
    return ApiMore(actions, links, offered)


# --- overview


def _window() -> Window:
    """The window of ``?window=`` (the last hour by default), strictly."""
    unknown = sorted(set(request.args) - {"window"})
    if unknown:
        _fail(400, "bad_filter", f"unknown argument(s) {', '.join(unknown)}: the argument is window")
    key = request.args.get("window", "1h")
    if key not in WINDOWS:
        _fail(400, "bad_filter", f"window is one of {', '.join(WINDOWS)}")
    return WINDOWS[key]


def _window_view(window: Window) -> dict[str, Any]:
    return {"window": window.key, "label": window.label, "bucket_seconds": window.seconds, "buckets": window.buckets}


def _card(card: Card) -> dict[str, Any]:
    return {
        "queue": card.queue,
        "counts": card.counts,
        "oldest_runnable_seconds": card.oldest_runnable,
    }


def _table_overview(settings: _Settings, entry: _Table, window: Window) -> dict[str, Any]:
    """One table of the overview: the page's reads (its cards over ``window``, its pauses,
    flow rules and queue limits), as plain values; a queue paused or limited with no job
    has a card of zeros, as on the page."""
    engine = settings.engine
    paused = admin.paused_queues(engine, entry.model)
    limits = admin.queue_limits(engine, entry.model)
    view, cards = overview_cards(settings, entry, window, also={*paused, *limits})
    concurrency, rate = entry.queue_rules
    queues = []
    for card in cards:
        own = limits.get(card.queue, (None, None))
        queues.append({
            **_card(card),
            "paused_since": paused.get(card.queue),
            "limits": {"concurrency": own[0], "rate": own[1]},
        })
    return {
        "table": entry.key,
        "has_task": entry.has_task,
        "pausable": entry.pausable,
        "activity": url_for(".activity", table=entry.key, window=window.key),
        "recorded": view.recorded,
        "queue_rules": {
            "concurrency": None if concurrency is None else concurrency.limit,
            "rate": None if rate is None else {"limit": rate.limit, "seconds": rate.seconds},
        },
        "rules": [
            {"rule": rule.rule, "busiest": [{"key": key, "count": n} for key, n in rule.busiest]}
            for rule in admin.flow_view(engine, entry.model)
        ],
        "queues": queues,
    }


# --- schedules


def _schedule(view: schedule_actions.ScheduleView) -> dict[str, Any]:
    schedule = view.schedule
    return {
        "name": view.name,
        "expression": schedule.expression if schedule is not None else None,
        "timezone": schedule.timezone if schedule is not None else None,
        "in_code": view.in_code,
        "last_tick": view.last_tick,
        "previous_tick": view.previous_tick,
        "paused_at": view.paused_at,
        "next_tick": view.next_tick,
    }


def _moment(value: Any, field: str) -> datetime:
    """A moment of a body, as this API wrote it (ISO 8601 with its offset)."""
    moment = None
    if isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value)
        except ValueError:
            moment = None
    if moment is None or moment.utcoffset() is None:
        _fail(400, "bad_body", f'"{field}" is a moment in ISO 8601 with its offset, as the API gave it')
    return moment


# --- bulk actions by filter


def _filters(entry: _Table, names: Mapping[str, list[str]], error: Any, *, kind: str) -> JobFilters:
    """The jobs page's filter, strictly: an unknown status is refused, never dropped
    (dropping it would widen the filter of a destructive action)."""
    wrong = [s for s in names["status"] if s not in _STATUSES]
    if wrong:
        _fail(400, kind, f"no status {', '.join(wrong)}: one of {', '.join(_STATUSES)}")
    if names["task"] and not entry.has_task:
        _fail(400, kind, f"{entry.key} has no task column to filter on")
    if error is not None and not isinstance(error, str):
        _fail(400, kind, '"error" is a text')
    return JobFilters(queues=tuple(names["queue"]), statuses=tuple(names["status"]), tasks=tuple(names["task"]),
                      error_contains=error or None)


def _filter_view(filters: JobFilters) -> dict[str, Any]:
    return {"queue": list(filters.queues), "status": list(filters.statuses), "task": list(filters.tasks),
            "error": filters.error_contains}


def _bulk(action: str) -> Action:
    """The action ``bulk_<action>``: the filter as the count read it, and the count's
    ``as_of``; a delete keeps the jobs holding their unique key unless ``free_keys``."""

    def run(settings: _Settings, entry: _Table, body: Mapping[str, Any]) -> dict[str, Any]:
        names = {name: _names(body, name) or [] for name in ("queue", "status", "task")}
        filters = _filters(entry, names, body.get("error"), kind="bad_body")
        if "as_of" not in body:
            _fail(400, "bad_body", f'"as_of" is the moment of the count you confirm: read it from GET '
                                   f'{url_for(".bulk", table=entry.key, action=action)}')
        as_of = _moment(body["as_of"], "as_of")
        free_keys = body.get("free_keys", False)
        if not isinstance(free_keys, bool) or (free_keys and action != "delete"):
            _fail(400, "bad_body", '"free_keys" is true or false, of a delete only')
        result = run_bulk(settings.engine, entry.model, action, filters, created_before=as_of, free_keys=free_keys)
        kept = 0
        if action == "delete" and not free_keys:
            # Deleting these frees their keys, so the work could run again: a second
            # action with "free_keys": true, as the page asks first.
            kept = count_matching(settings.engine, entry.model, action, filters, created_before=as_of).holding_keys
        return {"filters": _filter_view(filters), "as_of": as_of, "done": result.done, "batches": result.batches,
                "kept_holding_keys": kept}

    return run

