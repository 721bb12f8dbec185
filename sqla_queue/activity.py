"""The activity table: what a queue table did, one row per queue and time bucket.

:func:`activity_table` adds ``<table>_activity`` to the model's metadata. Declaring it is
what makes the workers of that queue table record their table's activity: once a bucket
of time has ended (a minute, and a quarter of an hour), the first worker whose sweeper
comes round writes a row per queue with the jobs that finished in it (done, failed,
cancelled), the p50 and p99 of their pickup latency and run time, and the jobs waiting
at that moment, all computed by one statement over the index of finished jobs (the
bucket's rows only), plus a row for the bucket itself (queue ``''``): the mark of how far
the recording has got. The dashboard's charts read these rows, and the table for the
bucket in progress, so a chart of the last 24 hours costs the same on a table of ten
million finished jobs as on an empty one. Without the table the charts read the queue
table itself for their whole window (a time range of its index of finished jobs): exact,
but as costly as the jobs that finished in the window are many.

A bucket is recorded :data:`GRACE` seconds after it ends (a job counts in the bucket of
its ``finished_at``; one whose finishing transaction commits later than that is missed).
Rows older than a resolution's ``keep`` are deleted by the same workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

from sqlalchemy import Column, DateTime, Float, Integer, Table

from .model import companion_table, queue_table

__all__ = [
    "GRACE",
    "MINUTES",
    "QUARTERS",
    "RESOLUTIONS",
    "Resolution",
    "activity_table",
    "bucket_start",
    "declared_activity_table",
    "due_range",
]

_INFO_KEY: Final = "sqla_queue.activity_table"

#: Seconds after a bucket ends before it is recorded: a finishing statement's transaction
#: has committed by then (its ``finished_at`` is the clock when it ran).
GRACE: Final = 10.0

#: The queue of a bucket's own row, the mark of how far the recording has got: no queue
#: has this name (a queue name is never empty).
MARK_QUEUE: Final = ""


@dataclass(frozen=True)
class Resolution:
    """A size of bucket the workers record: ``seconds`` wide; the first recording goes
    back ``backfill`` buckets, each statement records at most ``chunk`` buckets (so
    catching up after a stop costs a bounded statement per sweep), and rows are kept for
    ``keep`` seconds."""

    seconds: int
    backfill: int
    chunk: int
    keep: float


#: One bucket a minute: the charts of the last hour.
MINUTES: Final = Resolution(60, backfill=60, chunk=60, keep=86400.0)
#: One bucket a quarter of an hour: the charts of the last 24 hours.
QUARTERS: Final = Resolution(900, backfill=96, chunk=4, keep=7 * 86400.0)
RESOLUTIONS: Final = (MINUTES, QUARTERS)


def activity_table(model: Any) -> Table:
    """The activity table of ``model``'s queue table, named ``<table>_activity``, in the
    queue table's schema and ``MetaData`` (so ``create_all`` and Alembic autogenerate see
    it). Call it beside the model, in the module every worker imports: from then on its
    workers record the table's activity, which the dashboard's charts read. It returns the
    same Table on every call."""
    table = queue_table(model).table
    return companion_table(
        table,
        "activity",
        _INFO_KEY,
        # The bucket's width (60 or 900) and start; the queue ('' for the bucket's own row).
        Column("seconds", Integer, primary_key=True, autoincrement=False),
        Column("bucket", DateTime(timezone=True), primary_key=True),
        Column("queue", table.c.queue.type, primary_key=True),
        # Jobs that finished in the bucket, by status.
        Column("done", Integer, nullable=False, server_default="0"),
        Column("failed", Integer, nullable=False, server_default="0"),
        Column("cancelled", Integer, nullable=False, server_default="0"),
        # Seconds, over the done and failed jobs of the bucket (their last attempt); NULL: none.
        Column("pickup_p50", Float),
        Column("pickup_p99", Float),
        Column("run_p50", Float),
        Column("run_p99", Float),
        # Runnable pending jobs when the bucket was recorded; NULL: recorded late (catching up).
        Column("waiting", Integer),
    )


def declared_activity_table(table: Table) -> Table | None:
    """The activity table :func:`activity_table` declared for the queue ``table``, if any."""
    found: Table | None = table.info.get(_INFO_KEY)
    return found


def bucket_start(moment: datetime, seconds: int) -> datetime:
    """The start of the bucket of ``seconds`` that holds ``moment`` (aligned on the epoch,
    as the statements align them)."""
    epoch = moment.timestamp()
    return datetime.fromtimestamp(epoch - epoch % seconds, tz=moment.tzinfo)


def due_range(now: datetime, mark: datetime | None, resolution: Resolution) -> tuple[datetime, datetime, bool] | None:
    """The buckets of ``resolution`` to record now: ``(since, until, sample)``, the starts
    of the first and of the one after the last, or None when none has ended.

    ``now``: the server's clock; ``mark``: the latest bucket recorded (None: none yet).
    ``sample`` is true when the range ends at the latest ended bucket, whose row then takes
    the jobs waiting now; buckets recorded while catching up have no such count."""
    width = timedelta(seconds=resolution.seconds)
    # The first bucket not yet over (GRACE included): every bucket before it has ended.
    current = bucket_start(now - timedelta(seconds=GRACE), resolution.seconds)
    oldest = current - resolution.backfill * width
    since = oldest if mark is None else max(mark + width, oldest)
    until = min(since + resolution.chunk * width, current)
    if since >= until:
        return None
    return since, until, until == current
