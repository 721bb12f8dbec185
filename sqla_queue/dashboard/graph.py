"""The picture of a small workflow on its dashboard page: the geometry of a server-drawn
SVG (no script), each job a box coloured by its status, in columns by depth (a job with
no parent is at depth 0, another one column right of its deepest parent), with an edge
from each parent to each child.

Bounded: a workflow of more than :data:`PICTURE_JOBS` jobs, or of more than
:data:`PICTURE_EDGES` edges, has no picture (its page shows the counts and the paged
list); a column taller than :data:`PER_COLUMN` boxes wraps into several.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["PICTURE_EDGES", "PICTURE_JOBS", "PER_COLUMN", "depths", "picture"]

#: The most jobs, and edges, a picture draws.
PICTURE_JOBS = 200
PICTURE_EDGES = 2000
#: The most boxes one column stacks before it wraps into another.
PER_COLUMN = 20
_W, _H, _GAP_X, _GAP_Y, _PAD = 150, 28, 44, 10, 8
_LABEL = 22  # characters of a box's label
#: Fill and outline of a box, by status (the pages' status colours).
COLOURS = {
    "pending": ("#e6eefc", "#2f5fd0"),
    "running": ("#fff3dc", "#c98a12"),
    "done": ("#e3f5ea", "#2e9d5b"),
    "failed": ("#fde7e5", "#d0453a"),
    "cancelled": ("#eceef2", "#8a94a8"),
}


def depths(parents: Mapping[Any, Sequence[Any]]) -> dict[Any, int]:
    """Each job's depth: 0 without a parent among ``parents``' keys, else one more than
    its deepest parent's. A workflow has no cycle; were one written in, its back edge is
    ignored rather than followed for ever."""
    depth: dict[Any, int] = {}
    for start in parents:
        on_path: set[Any] = set()
        stack: list[tuple[Any, bool]] = [(start, False)]
        while stack:
            key, expanded = stack.pop()
            if key in depth:
                continue
            known = [p for p in parents[key] if p in parents]
            if expanded:
                on_path.discard(key)
                depth[key] = 1 + max((depth.get(p, -1) for p in known), default=-1)
                continue
            on_path.add(key)
            stack.append((key, True))
            stack.extend((p, False) for p in known if p not in depth and p not in on_path)
    return depth


def picture(jobs: Sequence[Any], url_of: Callable[[Any], str]) -> dict[str, Any] | None:
    """The picture of the jobs ``jobs`` (rows of key, name, status, waiting_on,
    parent_ids): its size, boxes and edges; None above the bounds. ``url_of`` gives a
    job's page, each box's link."""
    if not jobs or len(jobs) > PICTURE_JOBS:
        return None
    parents = {row[0]: list(row[4] or ()) for row in jobs}
    if sum(len(p) for p in parents.values()) > PICTURE_EDGES:
        return None
    depth = depths(parents)
    rank: dict[Any, float] = {}  # each placed job's row, to order the next columns by
    place: dict[Any, tuple[int, int]] = {}
    column = 0
    tallest = 0
    by_depth: dict[int, list[Any]] = {}
    for row in jobs:
        by_depth.setdefault(depth[row[0]], []).append(row[0])
    for level in sorted(by_depth):
        # Each job near its parents (their mean row): fewer crossing edges.
        keys = sorted(by_depth[level], key=lambda k: (_mean(rank, parents[k]), k))
        for start in range(0, len(keys), PER_COLUMN):
            chunk = keys[start:start + PER_COLUMN]
            for i, key in enumerate(chunk):
                place[key] = (column, i)
                rank[key] = i
            tallest = max(tallest, len(chunk))
            column += 1
    boxes = []
    for key, name, status, waiting_on, _ in jobs:
        col, row_ = place[key]
        fill, stroke = COLOURS.get(status, ("#ffffff", "#667085"))
        waiting = status == "pending" and (waiting_on or 0) > 0
        label = f"{key} {name}"
        boxes.append({
            "key": key, "x": _PAD + col * (_W + _GAP_X), "y": _PAD + row_ * (_H + _GAP_Y),
            "fill": fill, "stroke": stroke, "waiting": waiting, "status": status, "depth": depth[key],
            "label": label if len(label) <= _LABEL else label[: _LABEL - 1] + "…",
            "title": f"job {key} · {name} · {status}" + (f", waiting on {waiting_on}" if waiting else ""),
            "url": url_of(key),
        })
    at = {box["key"]: box for box in boxes}
    edges = []
    for child, ids in parents.items():
        for parent in ids:
            if parent not in at:
                continue
            a, b = at[parent], at[child]
            x1, y1, x2, y2 = a["x"] + _W, a["y"] + _H / 2, b["x"], b["y"] + _H / 2
            middle = (x1 + x2) / 2
            edges.append({"d": f"M{x1} {y1} C{middle} {y1} {middle} {y2} {x2 - 4} {y2}", "from": parent, "to": child})
    return {
        "width": _PAD * 2 + column * _W + max(column - 1, 0) * _GAP_X,
        "height": _PAD * 2 + tallest * _H + max(tallest - 1, 0) * _GAP_Y,
        "box_w": _W, "box_h": _H, "boxes": boxes, "edges": edges, "colours": COLOURS,
        "depth": max(depth.values(), default=0) + 1,
    }


def _mean(rank: dict[Any, float], keys: Sequence[Any]) -> float:
    placed = [rank[k] for k in keys if k in rank]
    return sum(placed) / len(placed) if placed else 0.0
