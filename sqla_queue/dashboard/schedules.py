"""The dashboard's schedules page: each periodic schedule of a table, in the code or only
a watermark row, with its last and next tick; run now, pause and resume
(:mod:`sqla_queue.schedule_actions`, which says what each does to the watermark).

A table has the page when it declares a watermark table (:func:`~sqla_queue.schedules_table`)
or the dashboard was given schedules of its; the code's schedules come from the
blueprint's ``schedules`` (by model), and without them the page shows the rows alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from flask import Blueprint, abort, flash, redirect, render_template, request, url_for

from .. import schedule_actions
from ..periodic import MAX_NAME_LENGTH, Schedule, check_schedules, declared_schedules_table, schedules_table

if TYPE_CHECKING:
    from werkzeug.wrappers import Response

    from . import _Settings, _Table

__all__ = ["add_schedule_views", "scheduled_tables"]


def add_schedule_views(
    bp: Blueprint,
    settings: _Settings,
    schedules: Mapping[Any, Sequence[Schedule]] | None,
    *,
    guard: Callable[[], None],
) -> None:
    """Register the schedules page and its actions on ``bp``. ``guard`` runs before
    every action: it refuses a read-only dashboard and a missing CSRF token."""
    code, shown = scheduled_tables(settings, schedules)

    def entry_of(table: str) -> _Table:
        entry = settings.table(table)
        if entry.key not in shown:
            abort(404)
        return entry

    def name_of(values: Mapping[str, str]) -> str:
        name = values.get("name", "")
        if not name or len(name) > MAX_NAME_LENGTH:
            abort(404)
        return name

    def listed(entry: _Table, name: str) -> schedule_actions.ScheduleView:
        views = schedule_actions.schedule_views(settings.engine, entry.model, code.get(entry.key))
        found = next((v for v in views or () if v.name == name), None)
        if found is None:
            abort(404)
        return found

    @bp.context_processor
    def _nav() -> dict[str, Any]:
        return {"schedule_tables": shown}

    @bp.get("/<path:table>/schedules", endpoint="schedules")
    def page(table: str) -> str:
        entry = entry_of(table)
        views = schedule_actions.schedule_views(settings.engine, entry.model, code.get(entry.key))
        return render_template(
            "sqla_queue_dashboard/schedules.html", table=entry, views=views, code_known=code.get(entry.key) is not None,
            watermark=schedules_table(entry.model).fullname, moment=_moment,
        )

    @bp.get("/<path:table>/schedules/run", endpoint="schedule_run")
    def confirm_run(table: str) -> str:
        entry = entry_of(table)
        if settings.read_only:
            abort(403, "the dashboard is read-only")
        view = listed(entry, name_of(request.args))
        if view.schedule is None:
            abort(404)
        return render_template("sqla_queue_dashboard/confirm_run.html", table=entry, view=view, moment=_moment)

    @bp.post("/<path:table>/schedules/run", endpoint="schedule_run_now")
    def run(table: str) -> Response:
        entry = entry_of(table)
        guard()
        view = listed(entry, name_of(request.form))
        if view.schedule is None:
            abort(404)
        seen = _seen(request.form.get("seen", ""))
        try:
            ran = schedule_actions.run_now(settings.engine, entry.model, view.schedule, seen=seen)
        except Exception as exc:  # noqa: BLE001 - the schedule's own (its values callable, a value refused)
            # Rolled back with the watermark: nothing was enqueued, as a failed tick.
            flash(f"schedule {view.name}: its job could not be enqueued, nothing changed: "
                  f"{type(exc).__name__}: {exc}", "error")
            return redirect(url_for(".schedules", table=entry.key))
        if ran.refused == "ticked":
            flash(f"schedule {view.name} ticked since the page was shown: nothing was enqueued. "
                  "Look at it again before running it now", "error")
        elif ran.refused == "busy":
            flash(f"a worker is claiming a tick of schedule {view.name} right now: nothing was enqueued, "
                  "try again", "error")
        else:
            flash(f"ran schedule {view.name} now: job {ran.key} enqueued; its watermark is {_moment(ran.tick)}", "ok")
        return redirect(url_for(".schedules", table=entry.key))

    @bp.post("/<path:table>/schedules/action", endpoint="schedule_action")
    def action(table: str) -> Response:
        entry = entry_of(table)
        guard()
        verb = request.form.get("action", "")
        if verb not in ("pause", "resume"):
            abort(400, f"unknown action {verb!r}")
        view = listed(entry, name_of(request.form))
        change = schedule_actions.pause if verb == "pause" else schedule_actions.resume
        done = "paused" if verb == "pause" else "resumed"
        if change(settings.engine, entry.model, view.name):
            flash(f"{done} schedule {view.name}", "ok")
        else:
            flash(f"schedule {view.name} was {'paused already' if verb == 'pause' else 'not paused'}", "ok")
        return redirect(url_for(".schedules", table=entry.key))


def scheduled_tables(
    settings: _Settings, schedules: Mapping[Any, Sequence[Schedule]] | None
) -> tuple[dict[str, tuple[Schedule, ...] | None], set[str]]:
    """The code's schedules of each table by key (None where not known), and the tables
    that have a schedules page: those with schedules in the code or a declared watermark
    table (declared now for the first, as a worker given these schedules declares it)."""
    code = _code_schedules(settings, schedules)
    shown = {key for key, table in settings.tables.items()
             if code.get(key) or declared_schedules_table(table.qt.table) is not None}
    for key in shown:
        schedules_table(settings.tables[key].model)
    return code, shown


def _code_schedules(
    settings: _Settings, schedules: Mapping[Any, Sequence[Schedule]] | None
) -> dict[str, tuple[Schedule, ...] | None]:
    """The code's schedules of each table by key; None where they are not known."""
    by_model = {table.model: key for key, table in settings.tables.items()}
    found: dict[str, tuple[Schedule, ...] | None] = dict.fromkeys(settings.tables)
    for model, given in (schedules or {}).items():
        key = by_model.get(model)
        if key is None:
            raise ValueError(f"schedules are given for {model!r}, which is not one of the dashboard's models")
        found[key] = check_schedules(given)
    return found


def _seen(value: str) -> datetime | None:
    """The watermark the page showed (``""``: no row), as the form sends it back."""
    if not value:
        return None
    try:
        seen = datetime.fromisoformat(value)
    except ValueError:
        abort(400, "not a moment: reload the page and try again")
    if seen.utcoffset() is None:
        abort(400, "not a moment: reload the page and try again")
    return seen


def _moment(value: datetime | None) -> str:
    """A moment in UTC, as the page says its times are."""
    return "-" if value is None else value.astimezone(UTC).isoformat(sep=" ", timespec="seconds")
