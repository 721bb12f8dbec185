"""The enqueue options, as one value: what ``queue=``, ``priority=``, … ask of a job.

Every enqueue path (``enqueue()``, ``enqueue_many()``, ``enqueue_values()``, the session
methods and the Flask helpers) takes the same keyword options (:class:`EnqueueKwargs`)
and turns them into one :class:`EnqueueOptions`, whose constructor is the validation:
a wrong option raises :class:`~sqla_queue.EnqueueError` there, before anything is
written. A new option is one field here (and one key of :class:`EnqueueKwargs`); an
option that sets a column says so in its field's metadata and needs nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from datetime import datetime, timedelta
from typing import Any, Final

from typing_extensions import TypedDict

from ..errors import EnqueueError
from ._rules import (
    Check,
    check_max_attempts,
    check_priority,
    check_queue,
    check_run_at,
    check_timeout,
    delay_seconds,
    timeout_seconds,
)

__all__ = ["NO_OPTIONS", "EnqueueKwargs", "EnqueueOptions", "enqueue_options"]


class EnqueueKwargs(TypedDict, total=False):
    """The keyword options every enqueue function takes (``**options``); None: unset."""

    queue: str | None
    priority: int | None
    delay: timedelta | float | None
    run_at: datetime | None
    max_attempts: int | None
    timeout: timedelta | float | None


def _column(key: str, check: Check) -> Any:
    """A field for an option that sets column ``key``, after ``check(value, name)``."""
    return field(default=None, metadata={"column": key, "check": check})


@dataclass(frozen=True, slots=True)
class EnqueueOptions:
    """The options of one enqueue call, checked: constructing one validates them.

    ``queue`` (a non-empty string), ``priority`` (a 32-bit integer, higher first),
    ``max_attempts`` (at least 1), ``timeout`` (positive seconds or a timedelta: how long
    each attempt may run, over the task's and the worker's timeout), and when the job
    may run: ``delay`` (seconds or a
    timedelta, counted by the database clock at the insert) or ``run_at`` (an aware
    datetime), not both. None leaves an option unset. :attr:`values` are the column
    values the options set, :attr:`delay_seconds` the delay as checked float seconds.
    Whether the options override a row's own values (``enqueue()``,
    ``enqueue_values()``) or only fill what a row leaves unset (``enqueue_many()``) is
    the caller's rule; the column rules of the table (lengths) are checked by the row
    plan (:mod:`sqla_queue.enqueue.rows`).
    """

    queue: str | None = _column("queue", check_queue)
    priority: int | None = _column("priority", check_priority)
    max_attempts: int | None = _column("max_attempts", check_max_attempts)
    #: Seconds (or a timedelta) each attempt may run; stored in the ``timeout`` column.
    timeout: timedelta | float | None = _column("timeout", check_timeout)  # noqa: RUF009 - frozen, as the others
    delay: timedelta | float | None = None
    run_at: datetime | None = None
    #: The job's unique key (``unique_key=``): a non-empty string, or with a key column of
    #: the user's own (:class:`~sqla_queue.UniqueJobs`) a value of that column. It sets
    #: the model's key column, which the row plan knows, so it is not in :attr:`values`.
    unique_key: Any = None
    values: dict[str, Any] = field(init=False, repr=False, compare=False)
    delay_seconds: float | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        values: dict[str, Any] = {}
        for name, key, check in _COLUMN_OPTIONS:
            value = getattr(self, name)
            if value is not None:
                check(value, name)
                values[key] = timeout_seconds(value) if name == "timeout" else value
        # delay and run_at both say when: one of them, run_at checked after delay.
        if self.delay is not None and self.run_at is not None:
            raise EnqueueError("give either delay or run_at, not both")
        seconds = delay_seconds(self.delay) if self.delay is not None else None
        if self.run_at is not None:
            check_run_at(self.run_at)
            values["run_after"] = self.run_at
        if self.unique_key is not None:
            check_unique_key(self.unique_key)
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "delay_seconds", seconds)

    def __bool__(self) -> bool:
        """Whether any option is set."""
        return bool(self.values) or self.delay_seconds is not None or self.unique_key is not None


#: (field name, column key, check) of the options that set a column, in check order.
_COLUMN_OPTIONS: Final = tuple(
    (f.name, f.metadata["column"], f.metadata["check"]) for f in fields(EnqueueOptions) if "column" in f.metadata
)

#: No option set: what a call without options uses, without constructing anything.
NO_OPTIONS: Final = EnqueueOptions()


def enqueue_options(options: EnqueueKwargs, unique_key: Any = None) -> EnqueueOptions:
    """The :class:`EnqueueOptions` of a call's keyword options (checked)."""
    if unique_key is not None:
        return EnqueueOptions(unique_key=unique_key, **options)
    return EnqueueOptions(**options) if options else NO_OPTIONS


def check_unique_key(value: Any, name: str = "unique_key") -> None:
    """A key is a value, not a flag: a bool or an empty string is surely a mistake."""
    if isinstance(value, bool) or (isinstance(value, str) and not value):
        raise EnqueueError(f"{name} must be a non-empty string (or a value of the key column), got {value!r}")
