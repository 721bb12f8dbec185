"""Handlers: a callable per queue table, or a registry of named tasks for task tables.

A handler takes the job, ``handler(job)``, or the job and a session,
``handler(job, session)``. The second kind is *transactional*: its writes and the job's
fenced completion commit together, so its database effects happen exactly once. A task
handler may also declare keyword-only parameters, ``handler(job, *, to, subject)``: the
worker then calls it with the job's payload as keyword arguments, and its task function
(:mod:`sqla_queue.task_functions`) checks a payload against them before enqueueing it.

The worker only runs what was registered: a task name read from the database is looked
up in a dict, never imported or evaluated. This module is the worker's side of a
registry (:class:`TaskRegistry`); the decorators users write, which return task
functions that can enqueue, are :class:`sqla_queue.Tasks`'s.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import NotAQueueModel, UnknownTask
from .model import MAX_TIMEOUT_SECONDS, queue_table
from .periodic import Schedule
from .runtime import is_async_callable

__all__ = [
    "Handler", "ResolvedHandler", "TaskRegistry", "WrappedHandler", "payload_signature", "resolve_handler", "unwrapped",
]

Handler = Callable[..., Any]

#: The parameters a handler's payload is given to: keyword-only ones and ``**kwargs``.
_PAYLOAD_KINDS = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD)


@dataclass(frozen=True)
class ResolvedHandler:
    """A handler and whether it takes a session."""

    name: str
    #: What the worker calls: the handler, or for a handler taking its payload as
    #: keywords, a function of the same kind that passes them.
    fn: Handler
    transactional: bool
    #: Seconds one attempt may run (None: the worker's timeout, if any).
    timeout: float | None = None
    #: The function as it was registered.
    function: Handler | None = None


class WrappedHandler:
    """Base of what ``@tasks.task`` returns (:class:`sqla_queue.TaskFunction`): the
    handler it wraps is ``fn``, which is what gets registered and run."""

    fn: Handler


def unwrapped(fn: Handler) -> Handler:
    """The handler a task function wraps, or ``fn`` itself (not any ``__wrapped__``: a
    decorator of the user's stays part of the handler)."""
    return fn.fn if isinstance(fn, WrappedHandler) else fn


def _signature(fn: Handler) -> inspect.Signature:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"cannot inspect handler {fn!r}: {exc}") from exc


def _takes_session(fn: Handler) -> bool:
    signature = _signature(fn)
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


def payload_signature(fn: Handler) -> inspect.Signature | None:
    """The part of ``fn``'s signature its payload binds to (its keyword-only parameters
    and ``**kwargs``), or None when it declares none: it reads ``job.payload`` itself."""
    found = [p for p in _signature(fn).parameters.values() if p.kind in _PAYLOAD_KINDS]
    return inspect.Signature(found) if found else None


def _payload_of(job: Any, name: str) -> Mapping[str, Any]:
    payload = job.payload
    if not isinstance(payload, Mapping):
        raise TypeError(
            f"task {name!r} takes its payload as keyword arguments, but the payload of job "
            f"{getattr(job, 'id', '?')} is not a JSON object: {type(payload).__name__}"
        )
    return payload


def _with_payload(fn: Handler, name: str) -> Handler:
    """``fn`` called with the job's payload as keyword arguments, a coroutine function
    if ``fn`` is one (the worker awaits what the signature says it may)."""
    if is_async_callable(fn):

        async def call_async(job: Any, *rest: Any) -> Any:
            return await fn(job, *rest, **_payload_of(job, name))

        return functools.wraps(fn)(call_async)

    def call(job: Any, *rest: Any) -> Any:
        return fn(job, *rest, **_payload_of(job, name))

    return functools.wraps(fn)(call)


def resolve_handler(
    fn: Handler, name: str | None = None, *, timeout: float | None = None, payload: bool = False
) -> ResolvedHandler:
    """Check a handler's signature once, at registration, not when a job arrives.

    ``payload``: a task's handler, whose keyword-only parameters (if any) take the
    job's payload."""
    fn = unwrapped(fn)
    if not callable(fn):
        raise TypeError(f"handler must be callable, got {fn!r}")
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise TypeError(f"timeout must be a number of seconds, got {timeout!r}")
        if not math.isfinite(timeout) or timeout <= 0 or timeout > MAX_TIMEOUT_SECONDS:
            raise ValueError(f"timeout must be a positive number of seconds (at most ten years), got {timeout!r}")
        timeout = float(timeout)
    label = name or getattr(fn, "__qualname__", None) or repr(fn)
    transactional = _takes_session(fn)
    called = _with_payload(fn, label) if payload and payload_signature(fn) is not None else fn
    return ResolvedHandler(label, called, transactional, timeout, fn)


class TaskRegistry:
    """Named task handlers and schedules, as a worker looks them up: the base of
    :class:`sqla_queue.Tasks`, whose decorators fill it.

    ``model``: the task table (a :class:`~sqla_queue.TaskMixin` model) its task
    functions enqueue into; a worker given the registry must serve that table.
    """

    def __init__(self, model: Any = None) -> None:
        if model is not None and not queue_table(model).is_task_table:
            raise NotAQueueModel(
                f"{getattr(model, '__qualname__', model)!r} has no task and payload columns: "
                f"a Tasks registry's model is a TaskMixin model"
            )
        self.model = model
        self._handlers: dict[str, ResolvedHandler] = {}
        self._schedules: dict[str, Schedule] = {}

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

    def register(self, name: str, fn: Handler, *, timeout: float | None = None) -> ResolvedHandler:
        """Register ``fn`` (a function, or a task function: the function it wraps) as
        task ``name``; returns it checked."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"task name must be a non-empty string, got {name!r}")
        if name in self._handlers:
            raise ValueError(f"task {name!r} is already registered")
        resolved = self._handlers[name] = resolve_handler(fn, name, timeout=timeout, payload=True)
        return resolved

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
