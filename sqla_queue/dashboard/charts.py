"""The overview page: each queue's counts and charts, drawn on the server as SVG, and its
live refresh.

The charts are plain SVG in the page (no script draws them): jobs done and failed per
bucket as stacked bars, the jobs waiting, and the p50 and p99 of the pickup latency and
of the run time as lines, over the last hour (a bucket a minute) or the last 24 hours (a
bucket a quarter of an hour), read by :mod:`sqla_queue.dashboard.activity`.

Live refresh is off unless the page's URL asks for it (``?live=5``: every five seconds).
Then a small script of the dashboard's own (``live.js``, the only script the dashboard
serves; the overview's Content-Security-Policy allows scripts of its own origin and no
other, never inline) fetches the page's live parts from ``/live`` every few seconds and
replaces those whose content changed: the counts and charts of each queue, nothing
else (never a form). The response carries an ETag of its content, and the script sends
it back: when nothing changed the answer is an empty 304 and the page is left alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from importlib import resources
from typing import TYPE_CHECKING, Any, Final

from flask import Blueprint, Response, render_template, request, url_for

from .. import admin
from .activity import WINDOWS, ActivityView, Point, QueueActivity, Window, read_activity

if TYPE_CHECKING:
    from . import _Settings, _Table

__all__ = ["LIVE_CSP", "STATUSES_NOW", "STATUSES_WINDOW", "Card", "add_overview_views", "overview_cards",
           "overview_page"]

#: The overview's policy: the dashboard's, plus its own script and its fetches of ``/live``.
LIVE_CSP: Final = (
    "default-src 'none'; script-src 'self'; connect-src 'self'; style-src 'unsafe-inline'; "
    "img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
#: Seconds between two refreshes: the choices the page offers, and the bounds of ``live``.
LIVE_CHOICES: Final = (5, 30)
LIVE_MIN, LIVE_MAX = 1, 600
#: The counts of a card: the jobs in these statuses now, and those that finished in the window.
STATUSES_NOW: Final = ("pending", "running")
STATUSES_WINDOW: Final = ("done", "failed", "cancelled")
_WIDTH, _HEIGHT = 380, 56
_SCRIPT: Final = resources.files(__package__).joinpath("static", "live.js").read_text(encoding="utf-8")


def add_overview_views(bp: Blueprint, settings: _Settings) -> None:
    """Register the overview's live parts (``/live``) and its script (``/live.js``)."""

    @bp.get("/live")
    def overview_live() -> Response:
        window, _ = _arguments()
        body = render_template("sqla_queue_dashboard/overview_live.html", **_overview(settings, window, parts=True))
        etag = '"' + hashlib.sha256(body.encode()).hexdigest()[:32] + '"'
        if etag in request.headers.get("If-None-Match", ""):
            response = Response(status=304)
        else:
            response = Response(body, mimetype="text/html")
        response.headers["ETag"] = etag
        return response

    @bp.get("/live.js")
    def live_js() -> Response:
        return Response(_SCRIPT, mimetype="text/javascript")


def overview_page(settings: _Settings) -> Response:
    """The overview of every table, over the window the URL names (the last hour by default)."""
    window, live = _arguments()
    response = Response(render_template(
        "sqla_queue_dashboard/overview.html",
        **_overview(settings, window),
        windows=WINDOWS.values(),
        live=live,
        live_choices=LIVE_CHOICES,
        live_url=url_for(".overview_live", window=window.key),
    ))
    if live:
        response.headers["Content-Security-Policy"] = LIVE_CSP
    return response


def _arguments() -> tuple[Window, int]:
    """The window (``?window=1h|24h``) and the seconds between refreshes (``?live=N``, 0: off)."""
    window = WINDOWS.get(request.args.get("window", ""), WINDOWS["1h"])
    try:
        live = int(request.args.get("live", "0"))
    except ValueError:
        live = 0
    return window, min(max(live, LIVE_MIN), LIVE_MAX) if live > 0 else 0


@dataclass
class Card:
    """One queue of one table on the overview: its counts (pending and running now, the
    finished ones over the window), the oldest runnable job's age, and its charts."""

    queue: str
    counts: dict[str, int]
    oldest_runnable: timedelta | None
    activity: QueueActivity
    charts: dict[str, Any]


def _overview(settings: _Settings, window: Window, *, parts: bool = False) -> dict[str, Any]:
    """What the overview shows of each table; ``parts``: only what its live parts show
    (the counts and charts), not the pauses, flow rules and limits that only the page
    shows."""
    engine = settings.engine
    sections: list[tuple[Any, ...]] = []
    for table in settings.tables.values():
        view, cards = overview_cards(settings, table, window)
        if parts:
            sections.append((table, cards, {}, [], {}, view))
            continue
        sections.append((
            table,
            cards,
            admin.paused_queues(engine, table.model),
            admin.flow_view(engine, table.model),
            admin.queue_limits(engine, table.model),
            view,
        ))
    return {"sections": sections, "window": window,
            "statuses_now": STATUSES_NOW, "statuses_window": STATUSES_WINDOW, "live_id": _live_id}


def overview_cards(
    settings: _Settings, table: _Table, window: Window, *, also: Collection[str] = ()
) -> tuple[ActivityView, list[Card]]:
    """One table's activity over ``window`` and its cards, one per queue with a job
    pending or running or finished in the window, and one for each queue of ``also``:
    what the overview shows (and the JSON API answers)."""
    view = read_activity(settings.engine, table.model, window)
    return view, _cards(view, admin.queue_depth(settings.engine, table.model), also)


def _live_id(table: _Table, queue: str, part: str) -> list[str]:
    """A live part's name, the same in the page and in ``/live`` (JSON in an attribute)."""
    return [table.key, queue, part]


def _cards(view: ActivityView, depth: admin.QueueDepth, also: Collection[str] = ()) -> list[Card]:
    counts: dict[str, dict[str, int]] = {}
    oldest: dict[str, timedelta | None] = {}
    for count in depth.counts:
        counts.setdefault(count.queue, {})[count.status] = count.jobs
        if count.oldest_runnable_seconds is not None:
            oldest[count.queue] = timedelta(seconds=count.oldest_runnable_seconds)
    cards = []
    for name in sorted({*counts, *view.queues, *also}):
        activity = view.queues.get(name) or _idle(view, name)
        shown = {s: counts.get(name, {}).get(s, 0) for s in STATUSES_NOW}
        shown.update({s: activity.total(s) for s in STATUSES_WINDOW})
        cards.append(Card(name, shown, oldest.get(name), activity, _charts(activity.points, view)))
    return cards


def _idle(view: ActivityView, queue: str) -> QueueActivity:
    width = timedelta(seconds=view.window.seconds)
    points = [Point(view.start + i * width) for i in range(view.window.buckets)]
    points[-1].waiting = 0
    return QueueActivity(queue, points)


# -- geometry ------------------------------------------------------------------------------


def _charts(points: list[Point], view: ActivityView) -> dict[str, Any]:
    labels = [_bucket_label(p.bucket, view.window) for p in points]
    return {
        "finished": _bars(points, labels),
        "waiting": _lines([("waiting", [_number(p.waiting) for p in points])], labels, _count),
        "pickup": _lines(
            [("p50", [p.pickup_p50 for p in points]), ("p99", [p.pickup_p99 for p in points])], labels, duration,
        ),
        "run": _lines([("p50", [p.run_p50 for p in points]), ("p99", [p.run_p99 for p in points])], labels, duration),
    }


def _number(value: int | None) -> float | None:
    return None if value is None else float(value)


def _bars(points: list[Point], labels: list[str]) -> dict[str, Any]:
    """Stacked bars, one per bucket: done under failed, scaled to the busiest bucket."""
    peak = max([p.done + p.failed for p in points] + [0])
    top = max(peak, 1)
    step = _WIDTH / max(len(points), 1)
    bars = []
    for i, (p, label) in enumerate(zip(points, labels, strict=True)):
        done_h = _HEIGHT * p.done / top
        failed_h = _HEIGHT * p.failed / top
        bars.append({
            "x": _n(i * step), "w": _n(max(step - 1, 0.6)), "slot": _n(step),
            "done_y": _n(_HEIGHT - done_h), "done_h": _n(done_h),
            "failed_y": _n(_HEIGHT - done_h - failed_h), "failed_h": _n(failed_h),
            "title": f"{label}: {p.done} done, {p.failed} failed",
            "done": p.done, "failed": p.failed,
        })
    return {"width": _WIDTH, "height": _HEIGHT, "bars": bars, "peak": peak}


def _lines(
    series: list[tuple[str, list[float | None]]], labels: list[str], unit: Callable[[float | None], str]
) -> dict[str, Any]:
    """Lines, one per series, over the buckets (a gap where a bucket has no value; a lone
    value is a dot), scaled from 0 to the highest value."""
    peak = max([v for _, values in series for v in values if v is not None] + [0.0])
    top = peak if peak > 0 else 1.0
    step = _WIDTH / max(len(labels), 1)
    drawn = []
    for name, values in series:
        segments: list[list[tuple[str, str]]] = [[]]
        for i, value in enumerate(values):
            if value is None:
                if segments[-1]:
                    segments.append([])
                continue
            segments[-1].append((_n((i + 0.5) * step), _n(_HEIGHT - _HEIGHT * value / top)))
        drawn.append({
            "name": name,
            "paths": [" ".join(f"{x},{y}" for x, y in s) for s in segments if len(s) > 1],
            "dots": [s[0] for s in segments if len(s) == 1],
        })
    slots = []
    for i, label in enumerate(labels):
        shown = [f"{name} {unit(values[i])}" for name, values in series if values[i] is not None]
        slots.append({"x": _n(i * step), "w": _n(step),
                      "title": f"{label}: {', '.join(shown) if shown else 'none'}"})
    return {"width": _WIDTH, "height": _HEIGHT, "series": drawn, "slots": slots,
            "peak": unit(peak) if peak > 0 else None}


def _n(value: float) -> str:
    """A coordinate, to a tenth of a pixel, as short as it goes (``12``, ``12.5``)."""
    text = f"{value:.1f}"
    return text[:-2] if text.endswith(".0") else text


def _bucket_label(start: datetime, window: Window) -> str:
    """A bucket as its tooltip names it: its start (UTC), and its end for a long one."""
    start = start.astimezone(UTC)
    if window.seconds <= 60:
        return f"{start:%H:%M} UTC"
    return f"{start:%H:%M} to {start + timedelta(seconds=window.seconds):%H:%M} UTC"


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def duration(seconds: float | None) -> str:
    """Seconds for a chart: ``850 ms``, ``1.2 s``, ``3.5 min``, ``2.1 h``."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    for unit, size in (("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
