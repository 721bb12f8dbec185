"""EnqueueOptions: the enqueue options as one checked value (no database)."""

from __future__ import annotations

import dataclasses
import inspect
import math
from datetime import UTC, datetime, timedelta, timezone
from typing import Any, get_type_hints

import pytest

import sqla_queue
from sqla_queue import EnqueueError
from sqla_queue.enqueue.options import NO_OPTIONS, EnqueueKwargs, EnqueueOptions, enqueue_options

AT = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)


def test_no_option_sets_nothing() -> None:
    options = EnqueueOptions()
    assert options.values == {}
    assert options.delay_seconds is None
    assert not options
    assert enqueue_options({}) is NO_OPTIONS
    assert not NO_OPTIONS


@pytest.mark.parametrize(
    ("given", "values"),
    [
        ({"queue": "emails"}, {"queue": "emails"}),
        ({"priority": -5}, {"priority": -5}),
        ({"priority": 2**31 - 1}, {"priority": 2**31 - 1}),
        ({"max_attempts": 1}, {"max_attempts": 1}),
        ({"run_at": AT}, {"run_after": AT}),
        (
            {"queue": "q", "priority": 3, "max_attempts": 7, "run_at": AT},
            {"queue": "q", "priority": 3, "max_attempts": 7, "run_after": AT},
        ),
    ],
)
def test_column_options_become_column_values(given: dict[str, Any], values: dict[str, Any]) -> None:
    options = EnqueueOptions(**given)
    assert options.values == values
    assert options.delay_seconds is None
    assert options


@pytest.mark.parametrize(
    ("delay", "seconds"),
    [(0, 0.0), (30, 30.0), (1.5, 1.5), (timedelta(minutes=2), 120.0), (timedelta(days=1), 86400.0)],
)
def test_a_delay_is_float_seconds_and_no_column(delay: Any, seconds: float) -> None:
    options = EnqueueOptions(delay=delay, queue="q")
    assert options.delay_seconds == seconds
    assert options.values == {"queue": "q"}  # run_after is the database clock's, at the insert
    assert options


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"queue": ""}, "queue must be a non-empty string, got ''"),
        ({"queue": 5}, "queue must be a non-empty string, got 5"),
        ({"priority": True}, "priority must be a 32-bit integer, got True"),
        ({"priority": 2**31}, "priority must be a 32-bit integer"),
        ({"priority": 1.0}, "priority must be a 32-bit integer"),
        ({"max_attempts": 0}, r"max_attempts must be an integer >= 1 \(32-bit\), got 0"),
        ({"max_attempts": 2**31}, "max_attempts must be an integer >= 1"),
        ({"delay": -1}, "delay must be a finite, non-negative duration"),
        ({"delay": math.nan}, "delay must be a finite, non-negative duration"),
        ({"delay": math.inf}, "delay must be a finite, non-negative duration"),
        ({"delay": 10**400}, "delay must be a finite, non-negative duration"),
        ({"delay": timedelta(days=366 * 1001)}, "delay must be at most 1000 years"),
        ({"delay": "30"}, "delay must be seconds or a timedelta, got '30'"),
        ({"delay": False}, "delay must be seconds or a timedelta, got False"),
        ({"run_at": datetime(2030, 1, 1)}, "run_at must be a timezone-aware datetime"),
        ({"run_at": "2030-01-01"}, "run_at must be a timezone-aware datetime"),
        (
            {"run_at": datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-2)))},
            "run_at is out of range",
        ),
        ({"delay": 5, "run_at": AT}, "give either delay or run_at, not both"),
    ],
)
def test_a_bad_option_raises_enqueue_error(given: dict[str, Any], message: str) -> None:
    with pytest.raises(EnqueueError, match=message):
        EnqueueOptions(**given)


def test_options_are_checked_in_a_fixed_order() -> None:
    """With several bad options, the first of queue, priority, max_attempts, delay/run_at
    is named (as the enqueue functions always did)."""
    with pytest.raises(EnqueueError, match=r"^queue"):
        EnqueueOptions(queue="", priority="x", max_attempts=0, delay=-1)  # type: ignore[arg-type]
    with pytest.raises(EnqueueError, match=r"^priority"):
        EnqueueOptions(priority="x", max_attempts=0, delay=-1)  # type: ignore[arg-type]
    with pytest.raises(EnqueueError, match=r"^max_attempts"):
        EnqueueOptions(max_attempts=0, delay=-1, run_at=AT)
    with pytest.raises(EnqueueError, match="either delay or run_at"):
        EnqueueOptions(delay=-1, run_at=datetime(2030, 1, 1))


def test_options_are_a_frozen_value() -> None:
    options = EnqueueOptions(queue="a", priority=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.queue = "b"  # type: ignore[misc]
    assert options == EnqueueOptions(priority=1, queue="a")
    assert options != EnqueueOptions(queue="a")
    assert "queue='a'" in repr(options)


def test_an_unknown_option_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'priorty'"):
        enqueue_options({"priorty": 1})  # type: ignore[typeddict-unknown-key]


def test_the_keyword_options_and_the_value_have_the_same_fields() -> None:
    """What the enqueue functions accept (``**options: Unpack[EnqueueKwargs]``) is what
    EnqueueOptions takes: a new option added to one and not the other fails here.
    ``unique_key`` is the one exception: a keyword of its own on every enqueue function,
    so that their overloads can say a keyed call returns an ``Enqueued``."""
    fields = {f.name for f in dataclasses.fields(EnqueueOptions) if f.init} - {"unique_key"}
    for fn in (sqla_queue.enqueue, sqla_queue.enqueue_values, sqla_queue.QueueSession.enqueue):
        assert inspect.signature(fn).parameters["unique_key"].kind is inspect.Parameter.KEYWORD_ONLY
    assert set(EnqueueKwargs.__annotations__) == fields
    assert set(EnqueueKwargs.__optional_keys__) == fields  # every option may be left out
    hints = get_type_hints(EnqueueKwargs)
    value_hints = get_type_hints(EnqueueOptions)
    assert {name: hints[name] for name in fields} == {name: value_hints[name] for name in fields}
