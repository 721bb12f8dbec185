"""Schedules without a database: their ticks across daylight-saving changes, and the
arguments refused when a schedule or a task is declared."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import UTC, datetime, time, timedelta
from itertools import pairwise
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from sqla_queue import Schedule, Tasks
from sqla_queue.periodic import MAX_BACKFILL, MAX_EVERY_SECONDS

ZONES = ("Europe/Paris", "America/New_York", "Australia/Sydney")
YEAR = 2026
MINUTE = timedelta(minutes=1)
TINY = timedelta(microseconds=1)


def _change(zone: ZoneInfo, forward: bool) -> datetime:
    """The moment (UTC) of ``YEAR``'s change of ``zone`` that moves clocks forward, or back."""
    found = []
    moment = datetime(YEAR, 1, 1, tzinfo=UTC)
    while moment.year == YEAR:
        after = moment + timedelta(hours=1)
        before_offset, after_offset = moment.astimezone(zone).utcoffset(), after.astimezone(zone).utcoffset()
        assert before_offset is not None and after_offset is not None
        if before_offset != after_offset:
            found.append((after, after_offset > before_offset))
        moment = after
    assert len(found) == 2, found  # one change each way, every year, in these zones
    (change,) = [at for at, ahead in found if ahead is forward]
    return change


def _minutes(lo: datetime, hi: datetime) -> list[datetime]:
    count = int((hi - lo) / MINUTE)
    return [lo + n * MINUTE for n in range(count + 1)]


# The promise of the periodic guide, computed from wall clocks, not from cronsim: a
# wildcard hour runs in every real hour (the repeated one included), a fixed time runs
# once a day, at its first occurrence, or at the first moment after a gap that ate it;
# every= counts seconds from the Unix epoch, whatever the zone.


def _at_minutes(marks: set[int]) -> Callable[[ZoneInfo, list[datetime]], list[datetime]]:
    def ticks(zone: ZoneInfo, minutes: list[datetime]) -> list[datetime]:
        return [t for t in minutes if t.astimezone(zone).minute in marks]

    return ticks


def _daily_0230(zone: ZoneInfo, minutes: list[datetime]) -> list[datetime]:
    wall = [(t, t.astimezone(zone).replace(tzinfo=None)) for t in minutes]
    days = sorted({local.date() for _, local in wall})[1:-1]  # whole days inside the window
    ticks = []
    for day in days:
        exact = [t for t, local in wall if local.date() == day and local.time() == time(2, 30)]
        later = [t for t, local in wall if local.date() == day and local.time() > time(2, 30)]
        ticks.append(exact[0] if exact else later[0])
    return ticks


def _every_half_hour(zone: ZoneInfo, minutes: list[datetime]) -> list[datetime]:
    return [t for t in minutes if int(t.timestamp()) % 1800 == 0]


KINDS: dict[str, tuple[dict[str, Any], Callable[[ZoneInfo, list[datetime]], list[datetime]]]] = {
    "hourly": ({"cron": "0 * * * *"}, _at_minutes({0})),
    "half-hourly": ({"cron": "*/30 * * * *"}, _at_minutes({0, 30})),
    "daily-02:30": ({"cron": "30 2 * * *"}, _daily_0230),
    "every-1800s": ({"every": 1800}, _every_half_hour),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("forward", [True, False], ids=["clocks-forward", "clocks-back"])
@pytest.mark.parametrize("zone_name", ZONES)
def test_every_tick_around_a_daylight_saving_change_is_found_once(zone_name: str, forward: bool, kind: str) -> None:
    zone = ZoneInfo(zone_name)
    change = _change(zone, forward)
    kwargs, promised = KINDS[kind]
    schedule = Schedule(kind, timezone=zone_name, **kwargs)
    expected = promised(zone, _minutes(change - timedelta(days=3), change + timedelta(days=3)))
    assert len(expected) >= 5
    near = [tick for tick in expected if abs(tick - change) <= timedelta(hours=2)]
    assert near or kind == "daily-02:30"  # the window does hold the change

    # The scheduler claims latest_tick(now) and sleeps until next_tick(now): each tick
    # is the latest from its moment until the next one, and the next of the one before.
    for tick, following in pairwise(expected):
        assert schedule.latest_tick(tick) == tick, tick.astimezone(zone)
        assert schedule.latest_tick(tick + (following - tick) / 2) == tick, tick.astimezone(zone)
        assert schedule.latest_tick(following - TINY) == tick, tick.astimezone(zone)
        assert schedule.next_tick(tick) == following, tick.astimezone(zone)
        assert schedule.next_tick(following - TINY) == following, tick.astimezone(zone)
    # A pass at any moment near the change, inside a repeated hour or just after a gap.
    for moment in _minutes(change - timedelta(hours=3), change + timedelta(hours=3))[::5]:
        latest = max(tick for tick in expected if tick <= moment)
        assert schedule.latest_tick(moment) == latest, moment.astimezone(zone)
        assert schedule.next_tick(moment) == min(tick for tick in expected if tick > moment), moment.astimezone(zone)
    # After an outage over the change, a backfill enqueues the same ticks, each once.
    catching_up = dataclasses.replace(schedule, backfill=MAX_BACKFILL)
    assert catching_up.missed(expected[0], expected[-1]) == expected[1:]
    assert dataclasses.replace(schedule, backfill=3).missed(expected[0], expected[-1]) == expected[-4:]


def test_the_autumn_hour_of_paris_runs_twice_and_a_fixed_time_once() -> None:
    """The cases seen: 2026-10-25, 03:00 CEST becomes 02:00 CET (01:00 UTC)."""
    paris = "Europe/Paris"
    after_change = datetime(2026, 10, 25, 1, 45, tzinfo=UTC)  # 02:45 CET
    assert Schedule("h", "0 * * * *", timezone=paris).latest_tick(after_change) == datetime(
        2026, 10, 25, 1, 0, tzinfo=UTC
    )  # 02:00 CET
    half = Schedule("m", "*/30 * * * *", timezone=paris, backfill=10)
    assert half.missed(datetime(2026, 10, 24, 23, 30, tzinfo=UTC), half.latest_tick(after_change)) == [
        datetime(2026, 10, 25, 0, 0, tzinfo=UTC),  # 02:00 CEST
        datetime(2026, 10, 25, 0, 30, tzinfo=UTC),  # 02:30 CEST
        datetime(2026, 10, 25, 1, 0, tzinfo=UTC),  # 02:00 CET
        datetime(2026, 10, 25, 1, 30, tzinfo=UTC),  # 02:30 CET
    ]
    # 02:30 every day runs at 02:30 CEST only: the second 02:30 is not a tick of its own.
    nightly = Schedule("n", "30 2 * * *", timezone=paris)
    assert nightly.latest_tick(after_change) == datetime(2026, 10, 25, 0, 30, tzinfo=UTC)


# -- arguments refused when declared ---------------------------------------------------------


@pytest.mark.parametrize("every", [10**12, MAX_EVERY_SECONDS + 1, timedelta(days=999_999_999)])
def test_an_every_too_long_for_a_datetime_is_refused_when_declared(every: Any) -> None:
    with pytest.raises(ValueError, match="every must be at most 1000 years"):
        Schedule("s", every=every)
    tasks = Tasks()
    with pytest.raises(ValueError, match="every must be at most 1000 years"):
        tasks.periodic(every=every)(lambda job: None)
    assert len(tasks) == 0 and tasks.schedules == ()  # nothing half-registered


def test_the_longest_every_has_ticks() -> None:
    longest = Schedule("s", every=MAX_EVERY_SECONDS)
    now = datetime(YEAR, 6, 1, tzinfo=UTC)
    assert longest.latest_tick(now) <= now < longest.next_tick(now)


@pytest.mark.parametrize("given", ["send_email", 42, b"send_email"])
def test_task_given_a_name_positionally_is_a_usage_error(given: Any) -> None:
    tasks = Tasks()
    with pytest.raises(TypeError, match=r"@tasks\.task\(name="):
        tasks.task(given)
    assert len(tasks) == 0

    @tasks.task(name="send_email")
    def send(job: Any) -> None: ...

    assert "send_email" in tasks
