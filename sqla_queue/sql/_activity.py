"""Activity over time: jobs finished per queue and bucket of time, their pickup latency and
run time (p50, p99), the jobs waiting; recorded into the activity table by the workers,
read back by the dashboard's charts.

Every read of the queue table here is a time range of its index of finished jobs
(``<table>_finished_idx``, on ``finished_at``) or the partial index of pending jobs:
never the whole table. Activity is the table's, whatever model of it asks (no kind
filter): one activity table per queue table.

Definitions (the dashboard's documentation says the same):

- a job counts in the bucket of its ``finished_at``;
- **pickup latency**: ``started_at - greatest(run_after, created_at)`` of its last
  attempt: how long it waited, runnable, before a worker took it (``run_after`` is
  when it became runnable, after a delay or a retry's backoff; ``created_at`` where
  an enqueue set a ``run_after`` in the past);
- **run time**: ``finished_at - started_at`` of its last attempt;
- both over the ``done`` and ``failed`` jobs of the bucket, on tables with the
  timeout columns (``started_at``; NULL without them);
- **waiting**: pending jobs whose ``run_after`` has come (runnable), at the moment
  of the count.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Final

from sqlalchemy import (
    Boolean,
    DateTime,
    Float,
    Integer,
    Select,
    Table,
    and_,
    case,
    cast,
    func,
    literal,
    literal_column,
    null,
    or_,
    select,
    type_coerce,
    union_all,
)
from sqlalchemy.dialects.postgresql import ARRAY, insert
from sqlalchemy.sql.dml import Delete, ReturningInsert
from sqlalchemy.sql.elements import ColumnElement

from ..activity import MARK_QUEUE, RESOLUTIONS, declared_activity_table
from ..model import JobStatus, QueueTable, queue_table, status_literal
from ._base import PENDING, QueueModel, _param, has_timeouts, seconds_interval

__all__ = [
    "ACTIVITY_COLUMNS",
    "activity_marks",
    "activity_rows",
    "finished_activity",
    "prune_activity",
    "record_activity",
    "waiting_jobs",
]

#: The bound parameters of :func:`record_activity` and the reads: the first bucket's
#: start, the start of the bucket after the last, whether to count the waiting jobs.
ACTIVITY_SINCE_PARAM: Final = "sqla_queue_since"
ACTIVITY_UNTIL_PARAM: Final = "sqla_queue_until"
ACTIVITY_SAMPLE_PARAM: Final = "sqla_queue_sample"

#: The values of a bucket, in the order every statement here returns them after
#: ``(queue, bucket)``.
ACTIVITY_COLUMNS: Final = (
    "done", "failed", "cancelled", "pickup_p50", "pickup_p99", "run_p50", "run_p99", "waiting",
)

_PERCENTILES = literal_column("ARRAY[0.5, 0.99]", ARRAY(Float()))


def _width(seconds: int) -> int:
    if isinstance(seconds, bool) or not isinstance(seconds, int) or seconds < 1:
        raise ValueError(f"seconds must be a whole number of seconds, at least 1, got {seconds!r}")
    return seconds


def _bucket(moment: ColumnElement[Any], seconds: int) -> ColumnElement[datetime]:
    """The start of ``moment``'s bucket, aligned on the epoch (its width inline, so the
    SELECT and the GROUP BY are the same expression)."""
    width = literal_column(f"{_width(seconds)}.0", Float())
    return func.to_timestamp(func.floor(_epoch(moment) / width) * width, type_=DateTime(timezone=True))


def _epoch(value: ColumnElement[Any]) -> ColumnElement[float]:
    """``date_part('epoch', value)``: seconds as a double (``extract`` gives a slower numeric)."""
    return func.date_part(literal_column("'epoch'"), value, type_=Float())


def _time(name: str, value: datetime | None) -> ColumnElement[datetime]:
    return cast(_param(name, DateTime(timezone=True), *(() if value is None else (value,))),
                DateTime(timezone=True))


def _table(model: QueueModel) -> Table:
    qt = queue_table(model)
    found = declared_activity_table(qt.table)
    if found is None:
        raise TypeError(
            f"{qt.table.name!r} has no activity table: call sqla_queue.activity_table(Model) beside the model"
        )
    return found


def _finished(qt: QueueTable, seconds: int, since: ColumnElement[datetime], until: ColumnElement[datetime]) -> Any:
    """Per queue and bucket, the jobs that finished in ``[since, until)``: a subquery of
    ``(queue, bucket, done, failed, cancelled, pickup, run)``, the last two arrays of
    ``[p50, p99]`` seconds."""
    c = qt.c
    ran = c.status.in_([status_literal(JobStatus.DONE), status_literal(JobStatus.FAILED)])

    def count(status: JobStatus) -> ColumnElement[int]:
        return func.count().filter(c.status == status_literal(status))

    def percentiles(seconds_of: ColumnElement[Any]) -> ColumnElement[Any]:
        return func.percentile_cont(_PERCENTILES).within_group(seconds_of).filter(ran)

    if has_timeouts(qt):
        zero = literal_column("0.0", Float())
        pickup = percentiles(func.greatest(_epoch(c.started_at - func.greatest(c.run_after, c.created_at)), zero))
        run = percentiles(func.greatest(_epoch(c.finished_at - c.started_at), zero))
    else:
        pickup = run = cast(null(), ARRAY(Float()))
    bucket = _bucket(c.finished_at, seconds)
    return (
        select(
            c.queue.label("queue"),
            bucket.label("bucket"),
            count(JobStatus.DONE).label("done"),
            count(JobStatus.FAILED).label("failed"),
            count(JobStatus.CANCELLED).label("cancelled"),
            type_coerce(pickup, ARRAY(Float())).label("pickup"),
            type_coerce(run, ARRAY(Float())).label("run"),
        )
        .where(c.finished_at >= since, c.finished_at < until)
        .group_by(c.queue, bucket)
        .subquery("finished")
    )


def _split(finished: Any) -> list[ColumnElement[Any]]:
    """The subquery's columns in :data:`ACTIVITY_COLUMNS` order, percentiles split."""
    return [
        finished.c.done, finished.c.failed, finished.c.cancelled,
        finished.c.pickup[1].label("pickup_p50"), finished.c.pickup[2].label("pickup_p99"),
        finished.c.run[1].label("run_p50"), finished.c.run[2].label("run_p99"),
    ]


def finished_activity(
    model: QueueModel, *, seconds: int = 60, since: datetime | None = None, until: datetime | None = None
) -> Select[Any]:
    """``(queue, bucket, *ACTIVITY_COLUMNS)`` from the queue table itself: per queue and
    bucket of ``seconds``, the jobs that finished from ``since`` to before ``until``
    (``sqla_queue_since`` / ``sqla_queue_until`` when not given), their p50 and p99
    pickup latency and run time; ``waiting`` NULL. A range of the finished jobs' index,
    read once: as costly as the jobs that finished in it are many."""
    qt = queue_table(model)
    finished = _finished(qt, seconds, _time(ACTIVITY_SINCE_PARAM, since), _time(ACTIVITY_UNTIL_PARAM, until))
    return (
        select(finished.c.queue, finished.c.bucket, *_split(finished), cast(null(), Integer()).label("waiting"))
        .order_by(finished.c.queue, finished.c.bucket)
    )


def _waiting(qt: QueueTable) -> Select[Any]:
    c = qt.c
    return (
        select(c.queue.label("queue"), func.count().label("waiting"))
        .where(c.status == status_literal(PENDING), c.run_after <= func.now())
        .group_by(c.queue)
    )


def waiting_jobs(model: QueueModel) -> Select[Any]:
    """``(queue, waiting)``: the runnable pending jobs of each queue now (their
    ``run_after`` has come), read from the partial index of pending jobs alone."""
    return _waiting(queue_table(model)).order_by(queue_table(model).c.queue)


def record_activity(model: QueueModel, *, seconds: int = 60) -> ReturningInsert[Any]:
    """Record the buckets of ``seconds`` from ``sqla_queue_since`` to before
    ``sqla_queue_until`` into the activity table: a row per queue with jobs finished in
    a bucket, its :data:`ACTIVITY_COLUMNS`; and a row per bucket whose queue is ``''``,
    the mark of how far the recording has got (:func:`activity_marks`). When
    ``sqla_queue_sample`` is true, the last bucket takes the jobs waiting now: each
    queue's row its own count (0 for a queue with none; a queue with waiting jobs and
    none finished gets a row of its own), the mark the total; elsewhere ``waiting`` is
    NULL (not counted). Buckets recorded already are left as they are (``ON CONFLICT DO
    NOTHING``): workers recording at once agree. Returns the ``(bucket, queue)`` of each
    row written."""
    qt = queue_table(model)
    t = _table(model)
    width = _width(seconds)
    since, until = _time(ACTIVITY_SINCE_PARAM, None), _time(ACTIVITY_UNTIL_PARAM, None)
    last = until - seconds_interval(float(width))
    sample = cast(_param(ACTIVITY_SAMPLE_PARAM, Boolean()), Boolean())
    finished = _finished(qt, width, since, until)
    waiting = _waiting(qt).add_columns(last.label("bucket")).where(sample).cte("waiting")
    seconds_value = literal(width, Integer())
    counts = [func.coalesce(column, 0) if i < 3 else column for i, column in enumerate(_split(finished))]
    bucket = func.coalesce(finished.c.bucket, waiting.c.bucket)
    rows = select(
        seconds_value,
        bucket,
        func.coalesce(finished.c.queue, waiting.c.queue),
        *counts,
        case((and_(sample, bucket == last), func.coalesce(waiting.c.waiting, 0)), else_=null()),
    ).select_from(
        finished.join(
            waiting,
            and_(finished.c.queue == waiting.c.queue, finished.c.bucket == waiting.c.bucket),
            full=True,
        )
    )
    series = func.generate_series(since, last, seconds_interval(float(width))).table_valued("bucket").render_derived(
        name="series")
    total = select(func.coalesce(func.sum(waiting.c.waiting), 0)).scalar_subquery()
    marks = select(
        seconds_value, series.c.bucket, literal(MARK_QUEUE, t.c.queue.type),
        *(literal(0, Integer()) for _ in range(3)),
        *(cast(null(), Float()) for _ in range(4)),
        cast(case((and_(sample, series.c.bucket == last), total), else_=null()), Integer()),
    ).select_from(series)
    names = ["seconds", "bucket", "queue", *ACTIVITY_COLUMNS]
    return (
        insert(t)
        .from_select(names, union_all(rows, marks))
        .on_conflict_do_nothing()
        .returning(t.c.bucket, t.c.queue)
    )


def activity_marks(model: QueueModel, resolutions: Sequence[int] | None = None) -> Select[Any]:
    """One row: the server's clock (``now``), and for each bucket width of
    ``resolutions`` (default: every resolution the workers record) the start of the
    latest bucket recorded (``mark_<seconds>``, NULL when none): where the recording of
    each goes on, and where a chart's read of the queue table itself starts. An index
    probe each."""
    t = _table(model)
    if resolutions is None:
        resolutions = [r.seconds for r in RESOLUTIONS]
    marks = [
        select(func.max(t.c.bucket)).where(t.c.seconds == _width(s)).scalar_subquery().label(f"mark_{s}")
        for s in resolutions
    ]
    return select(func.now().label("now"), *marks)


def activity_rows(
    model: QueueModel, *, seconds: int = 60, since: datetime | None = None, until: datetime | None = None
) -> Select[Any]:
    """``(queue, bucket, *ACTIVITY_COLUMNS)``: the recorded rows of the buckets of
    ``seconds`` from ``since`` to ``until`` (both included; ``sqla_queue_since`` /
    ``sqla_queue_until`` when not given), by queue and bucket. The marks come first
    (queue ``''``): a mark whose ``waiting`` is not NULL says the waiting jobs were
    counted in its bucket, so a queue without a row there had none."""
    t = _table(model)
    return (
        select(t.c.queue, t.c.bucket, *(t.c[name] for name in ACTIVITY_COLUMNS))
        .where(
            t.c.seconds == _width(seconds),
            t.c.bucket >= _time(ACTIVITY_SINCE_PARAM, since),
            t.c.bucket <= _time(ACTIVITY_UNTIL_PARAM, until),
        )
        .order_by(t.c.queue, t.c.bucket)
    )


def prune_activity(model: QueueModel) -> Delete:
    """Delete the activity rows past their resolution's ``keep`` (the rows of a width no
    resolution records any more, too)."""
    t = _table(model)
    old = [and_(t.c.seconds == r.seconds, t.c.bucket < func.now() - seconds_interval(r.keep)) for r in RESOLUTIONS]
    return t.delete().where(or_(*old))
