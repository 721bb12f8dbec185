"""Handlers: a callable per queue table, or a registry of named tasks for task tables.

A handler takes the job, ``handler(job)``, or the job and a session,
``handler(job, session)``. The second kind is *transactional*: its writes and the job's
fenced completion commit together, so its database effects happen exactly once.

The worker only runs what was registered: a task name read from the database is looked
up in a dict, never imported or evaluated.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar, overload

from .errors import UnknownTask
from .model import MAX_TIMEOUT_SECONDS
from .periodic import Schedule

__all__ = ["Handler", "Tasks", "resolve_handler"]

Handler = Callable[..., Any]
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class ResolvedHandler:
    """A handler and whether it takes a session."""

    name: str
    fn: Handler
    transactional: bool
    #: Seconds one attempt may run (None: the worker's timeout, if any).
    timeout: float | None = None


def _takes_session(fn: Handler) -> bool:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"cannot inspect handler {fn!r}: {exc}") from exc
    positional = [
        p
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    variadic = any(p.kind is p.VAR_POSITIONAL for p in signature.parameters.values())
    if len(positional) == 1 and not variadic:
        return False
    if len(positional) == 2 or (len(positional) == 1 and variadic):
        return True
    raise TypeError(
        f"handler {getattr(fn, '__qualname__', fn)!r} must take (job) or (job, session), "
        f"not {signature}"
    )


def resolve_handler(fn: Handler, name: str | None = None, *, timeout: float | None = None) -> ResolvedHandler:
    """Check a handler's signature once, at registration, not when a job arrives."""
    if not callable(fn):
        raise TypeError(f"handler must be callable, got {fn!r}")
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise TypeError(f"timeout must be a number of seconds, got {timeout!r}")
        if not math.isfinite(timeout) or timeout <= 0 or timeout > MAX_TIMEOUT_SECONDS:
            raise ValueError(f"timeout must be a positive number of seconds (at most ten years), got {timeout!r}")
        timeout = float(timeout)
    label = name or getattr(fn, "__qualname__", None) or repr(fn)
    return ResolvedHandler(label, fn, _takes_session(fn), timeout)


class Tasks:
    """A registry of named task handlers for a :class:`~sqla_queue.TaskMixin` table::

        tasks = Tasks()

        @tasks.task
        def send_email(job):                      # runs for rows with task="send_email"
            mailer.send(**job.payload)

        @tasks.task(name="billing.charge")
        def charge(job, session):                 # transactional: commits with completion
            session.add(Charge(**job.payload))

        @tasks.periodic("0 3 * * *", timezone="Europe/Paris")
        def nightly_report(job):                  # enqueued at 03:00 Paris time, once
            ...

        Worker(engine, Task, tasks)
    """

    def __init__(self) -> None:
        self._handlers: dict[str, ResolvedHandler] = {}
        self._schedules: dict[str, Schedule] = {}

    def periodic(
        self,
        cron: str | None = None,
        /,
        *,
        every: timedelta | float | None = None,
        timezone: str = "UTC",
        name: str | None = None,
        task: str | None = None,
        payload: Mapping[str, Any] | None = None,
        queue: str | None = None,
        priority: int | None = None,
        max_attempts: int | None = None,
        backfill: int = 0,
    ) -> Callable[[F], F]:
        """Register the function as task ``task`` (default: its ``__name__``; a task
        registered already under that name is kept) and enqueue a job of it with
        ``payload`` on every tick of ``cron`` in ``timezone`` (or ``every`` seconds).

        The schedule is named ``name`` (default: the task's name): give two schedules of
        one task names of their own. Each worker of this registry runs the schedules,
        every tick enqueued once however many run (see :class:`~sqla_queue.Schedule`).
        """

        def register(func: F) -> F:
            task_name = task or func.__name__
            # Built first: a schedule refused leaves nothing registered.
            schedule = Schedule(
                name or task_name, cron, every=every, timezone=timezone,
                values={"task": task_name, "payload": dict(payload or {})},
                queue=queue, priority=priority, max_attempts=max_attempts, backfill=backfill,
            )
            if schedule.name in self._schedules:
                raise ValueError(f"a schedule named {schedule.name!r} is already registered: give name=")
            found = self._handlers.get(task_name)
            if found is None:
                self.register(task_name, func)
            elif found.fn is not func:
                raise ValueError(f"task {task_name!r} is already registered with another function")
            self.schedule(schedule)
            return func

        return register

    def schedule(self, schedule: Schedule) -> None:
        """Add ``schedule`` to the registry's (its jobs' task must be registered by
        the time a worker starts)."""
        if not isinstance(schedule, Schedule):
            raise TypeError(f"expected a sqla_queue.Schedule, got {schedule!r}")
        if schedule.name in self._schedules:
            raise ValueError(f"a schedule named {schedule.name!r} is already registered: give name=")
        self._schedules[schedule.name] = schedule

    @property
    def schedules(self) -> tuple[Schedule, ...]:
        """The registry's schedules, by name."""
        return tuple(self._schedules[name] for name in sorted(self._schedules))

    @overload
    def task(self, fn: F, /) -> F: ...

    @overload
    def task(self, /, *, name: str | None = None, timeout: float | None = None) -> Callable[[F], F]: ...

    def task(self, fn: Any = None, /, *, name: str | None = None, timeout: float | None = None) -> Any:
        """Register ``fn`` under ``name`` (default: the function's ``__name__``);
        ``timeout``: seconds one attempt of the task may run (a job's own ``timeout``
        wins, and this one wins over the worker's)."""

        if fn is not None and not callable(fn):
            # tasks.task("send_email"): the name must be given by keyword.
            raise TypeError(
                f"Tasks.task takes the function (@tasks.task) or keyword arguments "
                f"(@tasks.task(name={fn!r})), got {fn!r}"
            )

        def register(func: F) -> F:
            self.register(name or func.__name__, func, timeout=timeout)
            return func

        return register(fn) if fn is not None else register

    def register(self, name: str, fn: Handler, *, timeout: float | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"task name must be a non-empty string, got {name!r}")
        if name in self._handlers:
            raise ValueError(f"task {name!r} is already registered")
        self._handlers[name] = resolve_handler(fn, name, timeout=timeout)

    def timeouts(self) -> dict[str, float]:
        """The timeout (seconds) of each task registered with one."""
        return {name: h.timeout for name, h in sorted(self._handlers.items()) if h.timeout is not None}

    def lookup(self, name: str) -> ResolvedHandler:
        try:
            return self._handlers[name]
        except KeyError:
            raise UnknownTask(
                f"unknown task {name!r}: no handler is registered under that name "
                f"(registered: {', '.join(sorted(self._handlers)) or 'none'})"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._handlers

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._handlers))

    def __len__(self) -> int:
        return len(self._handlers)
