"""What the overview's charts read: each queue's activity over a window (the last hour, by
minute; the last 24 hours, by quarter of an hour), from the activity table where workers
recorded it, and from the queue table for the buckets they have not recorded yet.

Each read is bounded: the activity table's rows of the window (a range of its primary
key), the queue table's finished jobs since the activity table's mark (a range of the
index of finished jobs: the bucket in progress, when the workers keep up) and the
pending jobs' partial index. A table without an activity table is read for the whole
window: exact, and as costly as the jobs finished in it are many (see the dashboard's
documentation, "What a page costs").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final

from sqlalchemy import Connection, Engine, Table, func, select

from .. import sql as q
from ..activity import MARK_QUEUE, MINUTES, QUARTERS, bucket_start, declared_activity_table
from ..model import queue_table, translated_schema

__all__ = ["WINDOWS", "ActivityView", "Point", "QueueActivity", "Window", "read_activity"]


@dataclass(frozen=True)
class Window:
    """A span the charts show: ``buckets`` buckets of ``seconds``, the last one the
    bucket in progress."""

    key: str
    label: str
    seconds: int
    buckets: int
    #: How a bucket is named in a chart's legend ("per minute").
    per: str

    @property
    def span(self) -> timedelta:
        return timedelta(seconds=self.seconds * self.buckets)


#: The windows of the overview, by the value of its ``window`` argument.
WINDOWS: Final = {
    "1h": Window("1h", "last hour", MINUTES.seconds, 60, "per minute"),
    "24h": Window("24h", "last 24 hours", QUARTERS.seconds, 96, "per 15 minutes"),
}


@dataclass
class Point:
    """One bucket of one queue: the jobs that finished in it by status, the p50 and p99
    pickup latency and run time of its done and failed jobs (seconds; None: none ran),
    and the jobs waiting (None: not counted in that bucket)."""

    bucket: datetime
    done: int = 0
    failed: int = 0
    cancelled: int = 0
    pickup_p50: float | None = None
    pickup_p99: float | None = None
    run_p50: float | None = None
    run_p99: float | None = None
    waiting: int | None = None


@dataclass
class QueueActivity:
    """One queue's points over the window, oldest first (one per bucket)."""

    queue: str
    points: list[Point] = field(default_factory=list)

    def total(self, status: str) -> int:
        return sum(int(getattr(p, status)) for p in self.points)


@dataclass
class ActivityView:
    """One table's activity over ``window``: per queue, from ``start`` (the first
    bucket's start) to ``now``; ``recorded`` whether the table has an activity table,
    ``mark`` the latest bucket its workers recorded (None: none in reach)."""


    window: Window
    now: datetime
    start: datetime
    recorded: bool
    mark: datetime | None
    queues: dict[str, QueueActivity]
    #: The activity table is declared, but not in the database.
    missing: bool = False


def read_activity(engine: Engine, model: Any, window: Window) -> ActivityView:
    """``model``'s table over ``window``: recorded buckets from its activity table, the
    others (the one in progress at least) from the queue table, and the jobs waiting now
    on the bucket in progress. One connection, a few bounded statements. An activity
    table declared but missing from the database (not migrated yet) is read as none."""
    width = timedelta(seconds=window.seconds)
    declared = declared_activity_table(queue_table(model).table)
    missing = False
    with engine.connect() as conn:
        mark = None
        if declared is not None:
            found = conn.execute(select(func.to_regclass(_regclass(conn, declared)))).scalar()
            missing = found is None
        if declared is not None and not missing:
            now, mark = conn.execute(q.activity_marks(model, [window.seconds])).one()
        else:
            now = conn.execute(select(func.now())).scalar_one()
        current = bucket_start(now, window.seconds)
        start = current - (window.buckets - 1) * width
        rows: list[Any] = []
        if mark is not None and mark >= start:
            rows += conn.execute(q.activity_rows(model, seconds=window.seconds, since=start, until=mark)).all()
        since = start if mark is None else max(start, mark + width)
        live = q.finished_activity(model, seconds=window.seconds, since=since, until=current + width)
        rows += conn.execute(live).all()
        waiting = conn.execute(q.waiting_jobs(model)).all()
    queues = _merge(rows, start, width, window.buckets)
    for queue, count in waiting:
        points = _queue(queues, queue, start, width, window.buckets).points
        points[-1].waiting = int(count)
    for activity in queues.values():  # a queue with no job waiting now waits for none
        if activity.points[-1].waiting is None:
            activity.points[-1].waiting = 0
    return ActivityView(window, now, start, declared is not None and not missing,
                        mark if mark is not None and mark >= start else None, dict(sorted(queues.items())), missing)


def _regclass(conn: Connection, table: Table) -> str:
    """``table``'s name as ``to_regclass`` takes it, in the schema the connection's
    ``schema_translate_map`` puts it in."""
    schema = translated_schema(table, conn.get_execution_options().get("schema_translate_map"))
    quote = conn.dialect.identifier_preparer.quote
    return f"{quote(schema)}.{quote(table.name)}" if schema else quote(table.name)


def _queue(queues: dict[str, QueueActivity], name: str, start: datetime, width: timedelta, n: int) -> QueueActivity:
    found = queues.get(name)
    if found is None:
        found = queues[name] = QueueActivity(name, [Point(start + i * width) for i in range(n)])
    return found


def _merge(rows: Iterable[Any], start: datetime, width: timedelta, n: int) -> dict[str, QueueActivity]:
    """Rows ``(queue, bucket, *ACTIVITY_COLUMNS)`` into points; a bucket read from both
    sources (never, but for a race with a recording) keeps the recorded one. A mark
    (queue ``''``) that counted the waiting jobs of its bucket gives a queue without a
    count there 0."""
    queues: dict[str, QueueActivity] = {}
    seen: set[tuple[str, int]] = set()
    counted: set[int] = set()
    for row in rows:
        values: Mapping[str, Any] = row._mapping
        index = int((values["bucket"] - start) / width)
        if not 0 <= index < n or (values["queue"], index) in seen:
            continue
        if values["queue"] == MARK_QUEUE:
            if values["waiting"] is not None:
                counted.add(index)
            continue
        seen.add((values["queue"], index))
        point = _queue(queues, values["queue"], start, width, n).points[index]
        for name in q.ACTIVITY_COLUMNS:
            value = values[name]
            if value is not None:
                setattr(point, name, int(value) if name in ("done", "failed", "cancelled", "waiting") else float(value))
    for activity in queues.values():
        for index in counted:
            point = activity.points[index]
            if point.waiting is None:
                point.waiting = 0
    return queues
