"""Periodic jobs: schedules declared in code, each tick enqueued exactly once.

A :class:`Schedule` names a cron expression (or a fixed interval) and the job each tick
enqueues. Every worker given schedules runs a scheduler (:mod:`sqla_queue.worker.scheduler`):
no leader is elected. A tick is claimed by advancing the schedule's watermark row in the
queue table's :func:`schedules_table` (``INSERT … ON CONFLICT DO UPDATE … WHERE last_tick <
:tick``), in the same transaction as the job's insert: the worker whose update matched
enqueues, the others (blocked on that row until it commits, for a bounded time) match
nothing. So a tick is claimed if and only if its job exists, however many workers run,
and whichever of them dies half-way.

Cron expressions are read by `cronsim <https://pypi.org/project/cronsim/>`_: small, pure
Python, typed, with no dependency of its own, maintained for Healthchecks.io (which
evaluates every user's schedule with it), and with daylight-saving behaviour it defines
and tests as Debian's cron does: a time that does not exist on the day clocks go forward
(02:30 in Europe/Paris) runs once, at the first moment after the gap; a time that occurs
twice when clocks go back runs once, at its first occurrence; expressions with a wildcard
hour (``*/5 * * * *``) run in every real hour.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final, NamedTuple
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError
from sqlalchemy import Column, DateTime, String, Table, func

from .model import MAX_DELAY_SECONDS, check_max_attempts, check_priority, check_queue, companion_table, queue_table

__all__ = ["MAX_BACKFILL", "Schedule", "declared_schedules_table", "schedules_table"]

#: The most missed ticks one schedule enqueues after an outage (besides the latest).
MAX_BACKFILL: Final = 1000
#: Longest schedule name: the primary key of the watermark table.
MAX_NAME_LENGTH: Final = 200
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_INFO_KEY: Final = "sqla_queue.schedules_table"
#: A moment just past ``now``: cronsim's reverse iteration returns ticks strictly before.
_EPSILON: Final = timedelta(microseconds=1)
#: Longer than any change of a zone's UTC offset (two hours at most, besides a day
#: skipped once): how far before a tick found backwards forward iteration starts.
_OFFSET_CHANGE: Final = timedelta(hours=3)
#: Longest ``every``: as long as the longest delay, so the next tick is a datetime.
MAX_EVERY_SECONDS: Final = int(MAX_DELAY_SECONDS)

RowValues = Mapping[str, Any] | Callable[[datetime], Mapping[str, Any]]


class ScheduleOptions(NamedTuple):
    """The enqueue options of a schedule's jobs, checked when the schedule is made
    (None: unset). The scheduler inserts each tick's job with them, as
    ``enqueue_values(..., queue=, priority=, max_attempts=)`` would."""

    queue: str | None
    priority: int | None
    max_attempts: int | None


#: The checks of :class:`ScheduleOptions`, in the order ``EnqueueOptions`` runs them.
_OPTION_CHECKS: Final = (("queue", check_queue), ("priority", check_priority), ("max_attempts", check_max_attempts))


def _utc(moment: datetime) -> datetime:
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise ValueError(f"expected a timezone-aware datetime, got {moment!r}")
    return moment.astimezone(UTC)


@dataclass(frozen=True)
class Schedule:
    """A job enqueued on every tick of ``cron`` (read in ``timezone``) or ``every``
    seconds (a number or a timedelta, counted from the Unix epoch: ``every=3600`` ticks
    on the hour in UTC).

    ``values`` are the job's column values (a mapping, or a callable given the tick as an
    aware UTC datetime that returns them), checked as ``enqueue_values()`` checks them;
    ``queue``, ``priority`` and ``max_attempts`` are the enqueue options. Each job's
    ``run_after`` is its tick. ``name`` identifies the schedule's watermark row: keep it
    when changing the expression, and never give two schedules of one table the same.

    After an outage (no worker ran) the latest missed tick is enqueued once;
    ``backfill=n`` also enqueues up to ``n`` earlier missed ticks (at most
    :data:`MAX_BACKFILL`). A schedule seen for the first time starts with its next tick.
    """

    name: str
    cron: str | None = None
    every: timedelta | float | None = None
    timezone: str = "UTC"
    values: RowValues | None = None
    queue: str | None = None
    priority: int | None = None
    max_attempts: int | None = None
    backfill: int = 0
    _zone: ZoneInfo = field(init=False, repr=False, compare=False)
    _every: float | None = field(init=False, repr=False, compare=False)
    _options: ScheduleOptions = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or len(self.name) > MAX_NAME_LENGTH or "\x00" in self.name:
            raise ValueError(f"a schedule needs a name of 1 to {MAX_NAME_LENGTH} characters, got {self.name!r}")
        if (self.cron is None) == (self.every is None):
            raise ValueError(f"schedule {self.name!r}: give either cron or every, not both nor neither")
        try:
            zone = ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError, TypeError) as exc:
            raise ValueError(f"schedule {self.name!r}: unknown timezone {self.timezone!r}") from exc
        object.__setattr__(self, "_zone", zone)
        every: float | None = None
        if self.cron is not None:
            if not isinstance(self.cron, str):
                raise TypeError(f"schedule {self.name!r}: cron must be a string, got {self.cron!r}")
            try:
                CronSim(self.cron, datetime.now(zone))
            except CronSimError as exc:
                raise ValueError(f"schedule {self.name!r}: not a cron expression: {self.cron!r} ({exc})") from None
        else:
            raw = self.every
            if isinstance(raw, bool) or not isinstance(raw, timedelta | int | float):
                raise TypeError(f"schedule {self.name!r}: every must be seconds or a timedelta, got {raw!r}")
            every = raw.total_seconds() if isinstance(raw, timedelta) else float(raw)
            if not math.isfinite(every) or every < 1 or every != int(every):
                raise ValueError(f"schedule {self.name!r}: every must be a whole number of seconds, at least 1, "
                                 f"got {raw!r}")
            if every > MAX_EVERY_SECONDS:  # its next tick would overflow datetime on every pass
                raise ValueError(f"schedule {self.name!r}: every must be at most 1000 years, got {raw!r}")
        object.__setattr__(self, "_every", every)
        if isinstance(self.backfill, bool) or not isinstance(self.backfill, int) or not (
            0 <= self.backfill <= MAX_BACKFILL
        ):
            raise ValueError(f"schedule {self.name!r}: backfill must be an integer from 0 to {MAX_BACKFILL}, "
                             f"got {self.backfill!r}")
        if self.values is not None and not (callable(self.values) or isinstance(self.values, Mapping)):
            raise TypeError(f"schedule {self.name!r}: values must be a mapping or a callable, got {self.values!r}")
        # Checked as enqueue options are (EnqueueOptions), with the same rules and errors.
        options = ScheduleOptions(queue=self.queue, priority=self.priority, max_attempts=self.max_attempts)
        for name, check in _OPTION_CHECKS:
            value = getattr(options, name)
            if value is not None:
                check(value, name)
        object.__setattr__(self, "_options", options)

    # -- ticks -------------------------------------------------------------------------

    @property
    def expression(self) -> str:
        """The cron expression, or ``every Ns``: for listings."""
        return self.cron if self.cron is not None else f"every {self._every:g}s"

    def latest_tick(self, now: datetime) -> datetime:
        """The last tick at or before ``now``, in UTC."""
        now = _utc(now)
        if self._every is not None:
            step = int(self._every)
            elapsed = math.floor((now - _EPOCH).total_seconds())
            return _EPOCH + timedelta(seconds=elapsed - elapsed % step)
        found = self._cron_before(now + _EPSILON, 1)
        if not found:
            raise ValueError(f"schedule {self.name!r}: {self.cron!r} has no tick before {now.isoformat()}")
        return found[-1]

    def next_tick(self, now: datetime) -> datetime:
        """The first tick after ``now``, in UTC."""
        now = _utc(now)
        if self._every is not None:
            return self.latest_tick(now) + timedelta(seconds=self._every)
        for tick in self._cron_after(now - _OFFSET_CHANGE):
            if tick > now:
                return tick
        raise ValueError(f"schedule {self.name!r}: {self.cron!r} has no tick after {now.isoformat()}")

    def missed(self, after: datetime, upto: datetime) -> list[datetime]:
        """The ticks a pass that claimed ``upto`` enqueues when the watermark stood at
        ``after``: ``upto``, and up to ``backfill`` earlier ticks later than ``after``;
        oldest first."""
        after, upto = _utc(after), _utc(upto)
        found = [upto]
        if self.backfill and upto > after:
            if self._every is not None:
                step = timedelta(seconds=self._every)
                tick = upto - step
                while tick > after and len(found) <= self.backfill:
                    found.append(tick)
                    tick -= step
            else:
                found += self._cron_before(upto, self.backfill, after)
        return sorted(found)

    def _cron_after(self, start: datetime) -> Iterator[datetime]:
        """The ticks of the cron expression after ``start``, in UTC, in order.

        Forward iteration from a moment inside an hour that occurs twice (its second
        occurrence) reads it as the first: it would give a tick of the past and skip
        ticks of the second occurrence. So it starts before that hour."""
        begin = start
        while begin.astimezone(self._zone).fold:
            begin -= timedelta(hours=1)
        for local in CronSim(self.cron or "", begin.astimezone(self._zone)):
            tick = _utc(local)
            if tick > start:
                yield tick

    def _cron_before(self, moment: datetime, count: int, after: datetime | None = None) -> list[datetime]:
        """The latest ``count`` (at most) ticks of the cron expression strictly before
        ``moment`` and after ``after``, oldest first, in UTC.

        The ticks are those of forward iteration, the ones :meth:`next_tick` steps
        through: cronsim's reverse iteration skips the ticks of an hour that occurs twice
        (``0 * * * *`` in Paris had no 02:00 CET) and may give the second occurrence of a
        time that runs at its first. It only finds where to start: ``count`` ticks back,
        less the longest change of a UTC offset."""
        expression = self.cron or ""
        backwards = CronSim(expression, moment.astimezone(self._zone), reverse=True)
        start, exhausted = moment, False
        while True:
            for _ in range(count):
                found = next(backwards, None)
                if found is None:
                    exhausted = True
                    break
                start = _utc(found)
                if after is not None and start <= after:
                    break
            start -= _OFFSET_CHANGE
            if after is not None and start <= after:
                start, exhausted = after, True
            ticks: list[datetime] = []
            for tick in self._cron_after(start):
                if tick >= moment:
                    break
                ticks.append(tick)
            if len(ticks) >= count or exhausted:
                return ticks[-count:]

    # -- the job -----------------------------------------------------------------------

    def row(self, tick: datetime) -> dict[str, Any]:
        """The column values of the job of ``tick`` (``run_after`` is set by the options)."""
        values = self.values(tick) if callable(self.values) else self.values
        return dict(values) if values else {}

    @property
    def options(self) -> ScheduleOptions:
        """The enqueue options every job of this schedule gets."""
        return self._options


def check_schedules(schedules: Iterable[Schedule]) -> tuple[Schedule, ...]:
    """``schedules`` as a tuple, refusing anything else and names given twice."""
    if isinstance(schedules, Schedule):
        schedules = [schedules]
    found = tuple(schedules)
    seen: set[str] = set()
    for schedule in found:
        if not isinstance(schedule, Schedule):
            raise TypeError(f"schedules must be sqla_queue.Schedule objects, got {schedule!r}")
        if schedule.name in seen:
            raise ValueError(f"two schedules are named {schedule.name!r}: each needs a name of its own")
        seen.add(schedule.name)
    return found


def schedules_table(model: Any) -> Table:
    """The watermark table of ``model``'s queue table: one row per schedule, the last
    tick enqueued, and since when it is paused (``paused_at``: no worker claims a paused
    schedule's ticks). Named ``<table>_schedules``, in the queue table's schema and
    ``MetaData`` (so ``create_all`` and Alembic autogenerate see it).

    Call it beside the model (``schedules_table(EmailJob)``) for a table whose workers
    run schedules; it returns the same Table on every call. One table per queue table,
    not per metadata: it follows the queue table into whatever schema a
    ``schema_translate_map`` puts it, so each tenant's schedules tick on their own, and
    schedule names need only be unique per queue table.
    """
    return companion_table(
        queue_table(model).table,
        "schedules",
        _INFO_KEY,
        Column("name", String(MAX_NAME_LENGTH), primary_key=True),
        # The last tick claimed (and enqueued); a tick is claimed by moving it forward.
        Column("last_tick", DateTime(timezone=True), nullable=False),
        # The value before the last claim: which missed ticks that claim enqueued.
        Column("previous_tick", DateTime(timezone=True)),
        Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
        # Set while the schedule is paused: no worker's claim of a tick matches the row.
        Column("paused_at", DateTime(timezone=True)),
    )


def declared_schedules_table(table: Table) -> Table | None:
    """The watermark table :func:`schedules_table` declared for the queue ``table``, if
    any (without declaring one: the dashboard asks before it shows a schedules page)."""
    found: Table | None = table.info.get(_INFO_KEY)
    return found
