"""``Tasks`` and the task functions its decorators return: a task enqueued from its own
function, its arguments checked against the function's signature first::

    tasks = Tasks(Task)

    @tasks.task
    def send_mail(job: Task, *, to: str, subject: str) -> None:
        mailer.send(to, subject)

    send_mail.enqueue(session, to="ada@example.com", subject="Hi")      # a Task row, added
    send_mail.with_options(queue="mail", priority=5).enqueue(session, to=..., subject=...)
    await send_mail.enqueue(async_session, to=..., subject=...)

The payload is the keyword arguments after the job (and the session of a transactional
handler): the function's keyword-only parameters, or its ``**kwargs``. The worker calls
such a function with the job's payload as those keywords, so ``enqueue()`` binds its
arguments to them (``inspect.Signature.bind``) before anything reaches the session, and
mypy checks them at the call site (the payload parameters are a ``ParamSpec``). Enqueue
options live apart, in :meth:`TaskFunction.with_options`: a payload may have a key
named ``queue`` or ``priority``. The decorated name stays the function: calling it runs
the handler, as tests do.

This module stands above the worker's side of the registry (:mod:`sqla_queue.tasks`,
which the worker's services import) and the enqueue side, which it calls: the worker
never imports it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Generator, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, cast, overload

from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session
from typing_extensions import Unpack

from .enqueue.binds import resolve_session
from .enqueue.options import EnqueueKwargs, enqueue_options
from .enqueue.session import enqueue
from .enqueue.unique import Enqueued, UniqueKey
from .errors import NotAQueueModel, TaskArgumentError
from .periodic import Schedule
from .runtime import is_async_callable
from .tasks import Handler, ResolvedHandler, TaskRegistry, WrappedHandler, payload_signature, unwrapped

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import async_scoped_session
    from sqlalchemy.orm import scoped_session

__all__ = ["PlainTaskFunction", "TaskFunction", "TaskWithOptions", "Tasks", "TransactionalTaskFunction"]

P = ParamSpec("P")
R = TypeVar("R")
J = TypeVar("J")
S = TypeVar("S")
#: What one enqueue gives back: the job, or with a unique key an ``Enqueued`` of it.
Out = TypeVar("Out")
T = TypeVar("T")


def check_payload(name: str, fn: Handler, signature: inspect.Signature | None, payload: Mapping[str, Any]) -> None:
    """Raise :class:`~sqla_queue.TaskArgumentError` unless ``fn`` (task ``name``, whose
    payload parameters are ``signature``) can be called with ``payload`` as keywords."""
    if signature is None:
        if payload:
            raise TaskArgumentError(
                f"task {name!r} takes no payload arguments, got {', '.join(map(repr, payload))}: declare them "
                f"as keyword-only parameters, def {getattr(fn, '__name__', name)}(job, *, {next(iter(payload))}"
                f", ...), and the worker passes the payload to them"
            )
        return
    try:
        signature.bind(**payload)
    except TypeError as exc:
        bare = signature.replace(parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()])
        raise TaskArgumentError(f"cannot enqueue task {name!r}: {exc} (its payload parameters: {bare})") from None
    if not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        return  # bound: each key is a keyword-only parameter
    named = {p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD}
    clash = sorted(named.intersection(payload))
    if clash:  # taken by the **kwargs, yet the call would give that parameter the job (or session) too
        raise TaskArgumentError(
            f"cannot enqueue task {name!r}: the payload key {clash[0]!r} names a positional parameter of its function"
        )


class _Ready(Awaitable[T]):
    """An awaitable of a value known already: the job an async enqueue added at once."""

    __slots__ = ("_value",)

    def __init__(self, value: T) -> None:
        self._value = value

    def __await__(self) -> Generator[Any, None, T]:
        if False:  # a generator, that gives its value without suspending
            yield
        return self._value


class TaskFunction(WrappedHandler, Generic[J, P]):
    """A registered task's function: call it as the function it wraps (``fn``), or
    enqueue a job of it with :meth:`enqueue`, whose keyword arguments are the job's
    payload. ``@tasks.task`` returns a :class:`PlainTaskFunction` or a
    :class:`TransactionalTaskFunction`, typed after the function."""

    registry: Tasks
    #: The task's name: what the job's ``task`` column holds.
    name: str
    #: The function's, as ``functools.update_wrapper`` copies them.
    __name__: str
    __qualname__: str

    def __init__(self, registry: Tasks, name: str, fn: Handler) -> None:
        functools.update_wrapper(cast("Any", self), fn)  # first: it copies fn's __dict__ over this one's
        self.registry = registry
        self.name = name
        self.fn = fn
        self._payload = payload_signature(fn)
        if is_async_callable(fn) and hasattr(inspect, "markcoroutinefunction"):  # Python 3.12+
            inspect.markcoroutinefunction(self)

    def __repr__(self) -> str:
        return f"<task function {self.name!r}: {getattr(self.fn, '__qualname__', self.fn)!r}>"

    def payload(self, *args: P.args, **kwargs: P.kwargs) -> dict[str, Any]:
        """The payload of a job of this task called with these arguments, checked against
        the function's signature: :class:`~sqla_queue.TaskArgumentError` if it cannot
        take them."""
        if args:
            raise TaskArgumentError(
                f"cannot enqueue task {self.name!r}: its payload is given by keyword, not as "
                f"{len(args)} positional argument(s)"
            )
        check_payload(self.name, self.fn, self._payload, kwargs)
        return dict(kwargs)

    def job(self, *args: P.args, **kwargs: P.kwargs) -> J:
        """A new job of this task (a row of the registry's model, not added anywhere), its
        payload checked as by :meth:`payload`: for ``enqueue_many()``, or a session's
        ``enqueue()`` with options of its own."""
        payload = self.payload(*args, **kwargs)
        model = self.registry.model
        if model is None:
            raise NotAQueueModel(
                f"cannot enqueue task {self.name!r}: its Tasks registry has no model; give it the task "
                f"table, tasks = Tasks(MyTask), to enqueue from the task's function"
            )
        return cast("J", model(task=self.name, payload=payload))

    @overload
    def enqueue(
        self, session: AsyncSession | async_scoped_session[Any], /, *args: P.args, **kwargs: P.kwargs
    ) -> Awaitable[J]: ...

    @overload
    def enqueue(self, session: Session | scoped_session[Any], /, *args: P.args, **kwargs: P.kwargs) -> J: ...

    def enqueue(self, session: Any, /, *args: P.args, **kwargs: P.kwargs) -> Any:
        """Enqueue a job of this task in ``session``'s transaction, with these arguments
        as its payload; it commits, or rolls back, with the caller's writes, as
        :func:`sqla_queue.enqueue` does. The arguments are checked against the function's
        signature first (:class:`~sqla_queue.TaskArgumentError`), and the payload and
        options as every enqueue checks them: a refused call leaves the session untouched.

        Returns the job (pending; its ``id`` known after the next flush). On an
        ``AsyncSession`` it returns an awaitable of the job (``await
        task.enqueue(async_session, ...)``): the job is added at once, as the session's
        own ``enqueue()`` adds it, so the await only hands it back. Options:
        :meth:`with_options`."""
        return self.with_options().enqueue(session, *args, **kwargs)

    @overload
    def with_options(
        self, *, unique_key: UniqueKey, **options: Unpack[EnqueueKwargs]
    ) -> TaskWithOptions[J, P, Enqueued[J]]: ...

    @overload
    def with_options(
        self, *, unique_key: None = None, **options: Unpack[EnqueueKwargs]
    ) -> TaskWithOptions[J, P, J]: ...

    def with_options(self, *, unique_key: Any = None, **options: Unpack[EnqueueKwargs]) -> Any:
        """This task with enqueue options, the options of :func:`sqla_queue.enqueue`
        (``queue``, ``priority``, ``delay`` or ``run_at``, ``max_attempts``, ``timeout``,
        ``unique_key``), checked now (:class:`~sqla_queue.EnqueueError`):
        ``send_mail.with_options(queue="mail").enqueue(session, to=...)``. Kept apart from
        the payload's keywords, so a payload may have a key of any name. With
        ``unique_key=``, ``enqueue()`` returns an :class:`~sqla_queue.Enqueued` (awaitable
        on an ``AsyncSession``: the insert happens at the await)."""
        return TaskWithOptions(self, unique_key, options)


class PlainTaskFunction(TaskFunction[J, P], Generic[J, P, R]):
    """The task function of a handler that takes the job: ``fn(job, **payload)``."""

    def __call__(self, job: J, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return cast("R", self.fn(job, *args, **kwargs))


class TransactionalTaskFunction(TaskFunction[J, P], Generic[J, S, P, R]):
    """The task function of a transactional handler: ``fn(job, session, **payload)``."""

    def __call__(self, job: J, session: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return cast("R", self.fn(job, session, *args, **kwargs))


class TaskWithOptions(Generic[J, P, Out]):
    """A task and the enqueue options of :meth:`TaskFunction.with_options`; enqueue
    jobs with them by :meth:`enqueue`."""

    def __init__(self, task: TaskFunction[J, P], unique_key: Any, options: EnqueueKwargs) -> None:
        enqueue_options(options, unique_key)  # checked now: a bad option is refused where it is written
        self.task = task
        self.unique_key = unique_key
        self.options = options

    @overload
    def enqueue(
        self, session: AsyncSession | async_scoped_session[Any], /, *args: P.args, **kwargs: P.kwargs
    ) -> Awaitable[Out]: ...

    @overload
    def enqueue(self, session: Session | scoped_session[Any], /, *args: P.args, **kwargs: P.kwargs) -> Out: ...

    def enqueue(self, session: Any, /, *args: P.args, **kwargs: P.kwargs) -> Any:
        """:meth:`TaskFunction.enqueue` with these options."""
        job = self.task.job(*args, **kwargs)
        resolved = resolve_session(session)
        if isinstance(resolved, AsyncSession) and self.unique_key is None:
            return _Ready(enqueue(resolved, job, **self.options))
        # With a key on an AsyncSession: enqueue()'s coroutine, which inserts when awaited
        # (the session's commit refuses to go on while it was not).
        return enqueue(resolved, job, unique_key=self.unique_key, **self.options)


class TaskDecorator(Protocol):
    """What ``@tasks.task(name=...)`` and ``@tasks.periodic(...)`` apply: the function
    becomes its task function, typed after it."""

    @overload
    def __call__(self, fn: Callable[Concatenate[J, S, P], R], /) -> TransactionalTaskFunction[J, S, P, R]: ...

    @overload
    def __call__(self, fn: Callable[Concatenate[J, P], R], /) -> PlainTaskFunction[J, P, R]: ...


class Tasks(TaskRegistry):
    """A registry of named task handlers for a :class:`~sqla_queue.TaskMixin` table::

        tasks = Tasks(Task)                       # Task: the task table

        @tasks.task
        def send_email(job, *, to, subject):      # runs for rows with task="send_email"
            mailer.send(to, subject)

        @tasks.task(name="billing.charge")
        def charge(job, session):                 # transactional: commits with completion
            session.add(Charge(**job.payload))

        @tasks.periodic("0 3 * * *", timezone="Europe/Paris")
        def nightly_report(job):                  # enqueued at 03:00 Paris time, once
            ...

        send_email.enqueue(session, to="ada@example.com", subject="Hi")
        Worker(engine, Task, tasks)

    ``model``: the task table the task functions enqueue into (``send_email.enqueue()``
    needs it; a registry without one still serves a worker). The decorators return a
    :class:`TaskFunction`: the function, callable as before, that can also enqueue.
    """

    def _function(self, name: str, resolved: ResolvedHandler) -> Any:
        kind = TransactionalTaskFunction if resolved.transactional else PlainTaskFunction
        assert resolved.function is not None
        return kind(self, name, resolved.function)

    @overload
    def task(self, fn: Callable[Concatenate[J, S, P], R], /) -> TransactionalTaskFunction[J, S, P, R]: ...

    @overload
    def task(self, fn: Callable[Concatenate[J, P], R], /) -> PlainTaskFunction[J, P, R]: ...

    @overload
    def task(self, /, *, name: str | None = None, timeout: float | None = None) -> TaskDecorator: ...

    def task(self, fn: Any = None, /, *, name: str | None = None, timeout: float | None = None) -> Any:
        """Register ``fn`` under ``name`` (default: the function's ``__name__``);
        ``timeout``: seconds one attempt of the task may run (a job's own ``timeout``
        wins, and this one wins over the worker's). Returns its :class:`TaskFunction`."""

        if fn is not None and not callable(fn):
            # tasks.task("send_email"): the name must be given by keyword.
            raise TypeError(
                f"Tasks.task takes the function (@tasks.task) or keyword arguments "
                f"(@tasks.task(name={fn!r})), got {fn!r}"
            )

        def register(func: Handler) -> Any:
            function = unwrapped(func)
            task_name = name or function.__name__
            return self._function(task_name, self.register(task_name, function, timeout=timeout))

        return register(fn) if fn is not None else register

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
    ) -> TaskDecorator:
        """Register the function as task ``task`` (default: its ``__name__``; a task
        registered already under that name is kept) and enqueue a job of it with
        ``payload`` on every tick of ``cron`` in ``timezone`` (or ``every`` seconds).
        A function taking its payload as keywords has ``payload`` checked against them
        now (:class:`~sqla_queue.TaskArgumentError`).

        The schedule is named ``name`` (default: the task's name): give two schedules of
        one task names of their own. Each worker of this registry runs the schedules,
        every tick enqueued once however many run (see :class:`~sqla_queue.Schedule`).
        """

        def register(func: Handler) -> Any:
            function = unwrapped(func)
            task_name = task or function.__name__
            # Built and checked first: a schedule refused leaves nothing registered.
            schedule = Schedule(
                name or task_name, cron, every=every, timezone=timezone,
                values={"task": task_name, "payload": dict(payload or {})},
                queue=queue, priority=priority, max_attempts=max_attempts, backfill=backfill,
            )
            if schedule.name in self._schedules:
                raise ValueError(f"a schedule named {schedule.name!r} is already registered: give name=")
            found = self._handlers.get(task_name)
            if found is not None and found.function is not function:
                raise ValueError(f"task {task_name!r} is already registered with another function")
            signature = payload_signature(function)
            if signature is not None:
                check_payload(task_name, function, signature, payload or {})
            resolved = found or self.register(task_name, function)
            self.schedule(schedule)
            if isinstance(func, TaskFunction) and func.registry is self and func.name == task_name:
                return func
            return self._function(task_name, resolved)

        return cast("TaskDecorator", register)
