"""Flask-SQLAlchemy integration: ``queue.enqueue()`` and ``flask queue …`` commands.

::

    db = SQLAlchemy(app)
    queue = FlaskQueue(app, db)
    queue.add_worker(EmailJob, send_confirmation, concurrency=4)

    @app.post("/orders")
    def place_order():
        db.session.add(order)
        queue.enqueue(EmailJob(order=order))   # commits with the order, or not at all
        db.session.commit()

    $ flask queue worker            # every registered worker (here EmailJob's), in one process
    $ flask queue stats

``queue.enqueue``/``enqueue_many`` act on the current ``db.session`` and are typed.
Flask-SQLAlchemy's ``db.session`` is a ``scoped_session``, which forwards only the
methods SQLAlchemy knows; ``init_app`` also gives that object ``enqueue`` and
``enqueue_many`` (invisible to type checkers), without touching Flask-SQLAlchemy internals.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, overload

import click
from flask import Flask, current_app
from flask.cli import AppGroup
from sqlalchemy.exc import OperationalError, ProgrammingError
from sqlalchemy.orm import Session
from typing_extensions import Unpack

from . import admin
from .cli import (
    LOG_FORMAT,
    REQUEUE_NEEDS_A_SELECTION,
    DurationError,
    check_database,
    parse_age,
    parse_duration,
    retention_age,
    worker_overrides,
)
from .driver import WorkerStartError
from .enqueue._rules import check_queue
from .enqueue.bulk import DEFAULT_BATCH_SIZE, Method, enqueue_many
from .enqueue.options import EnqueueKwargs
from .enqueue.session import enqueue
from .enqueue.unique import Enqueued, EnqueuedMany, UniqueKey
from .errors import QueuesTableNotDeclared
from .group import Workers
from .model import JobStatus, queue_table
from .periodic import Schedule
from .tasks import Handler, TaskRegistry
from .worker import Worker, WorkerConfig

__all__ = ["FlaskQueue"]

J = TypeVar("J")
T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class _Registration:
    model: Any
    handler: Handler | TaskRegistry
    options: dict[str, Any] = field(default_factory=dict)


class FlaskQueue:
    """The sqla_queue extension for a Flask-SQLAlchemy app (``init_app`` style)."""

    def __init__(self, app: Flask | None = None, db: Any = None) -> None:
        self.db = db
        self._workers: dict[str, _Registration] = {}
        if app is not None:
            self.init_app(app, db)

    def init_app(self, app: Flask, db: Any = None) -> None:
        db = db if db is not None else self.db
        if db is None:
            db = app.extensions.get("sqlalchemy")
        if db is None:
            raise RuntimeError("FlaskQueue needs Flask-SQLAlchemy: init SQLAlchemy(app) first or pass db")
        self.db = db
        _give_enqueue(db.session)
        app.extensions["sqla_queue"] = self
        app.cli.add_command(_queue_commands)

    def add_worker(
        self, model: Any, handler: Handler | TaskRegistry, *, name: str | None = None, **options: Any
    ) -> None:
        """Register the worker ``flask queue worker NAME`` runs (NAME defaults to the table)."""
        key = name or queue_table(model).table.name
        if key in self._workers:
            raise ValueError(f"a worker named {key!r} is already registered")
        Worker.check_options(**options)
        self._workers[key] = _Registration(model, handler, options)

    @overload
    def enqueue(self, job: J, *, unique_key: UniqueKey, **options: Unpack[EnqueueKwargs]) -> Enqueued[J]: ...

    @overload
    def enqueue(self, job: J, *, unique_key: None = None, **options: Unpack[EnqueueKwargs]) -> J: ...

    def enqueue(self, job: J, *, unique_key: Any = None, **options: Unpack[EnqueueKwargs]) -> Any:
        """:func:`sqla_queue.enqueue` with the current ``db.session``: the job commits with it
        (with ``unique_key=``, inserted at once or skipped: an :class:`~sqla_queue.Enqueued`)."""
        return enqueue(self._session(), job, unique_key=unique_key, **options)

    def enqueue_many(
        self,
        model: Any,
        rows: Iterable[Any],
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        method: Method = "auto",
        **options: Unpack[EnqueueKwargs],
    ) -> EnqueuedMany:
        """:func:`sqla_queue.enqueue_many` with the current ``db.session`` (COPY on psycopg)."""
        return enqueue_many(self._session(), model, rows, batch_size=batch_size, method=method, **options)

    def _session(self) -> Session:
        if self.db is None:
            raise RuntimeError("FlaskQueue is not initialised: call init_app(app, db) first")
        session: Session = self.db.session()
        return session

    def dashboard(
        self, *, auth: Any, read_only: bool = False, name: str = "sqla_queue_dashboard",
        trusted_hosts: Sequence[str] | None = None, api_actions: bool = False,
    ) -> Any:
        """The web dashboard over the registered workers' tables, as a blueprint to
        register (``app.register_blueprint(queue.dashboard(auth=...), url_prefix=
        "/queue")``); see :func:`sqla_queue.dashboard.dashboard_blueprint`, whose
        ``trusted_hosts`` and ``api_actions`` this passes on (None: your app's
        ``TRUSTED_HOSTS`` decide; the JSON API is read-only unless ``api_actions``).
        Needs the ``dashboard`` extra and ``app.secret_key``."""
        from .dashboard import dashboard_blueprint

        models = list(dict.fromkeys(registration.model for registration in self._workers.values()))
        if not models:
            raise RuntimeError("register a worker (add_worker) before building the dashboard")
        leases = {float(reg.options.get("lease", WorkerConfig.lease)) for reg in self._workers.values()}
        schedules: dict[Any, dict[str, Schedule]] = {model: {} for model in models}
        for registration in self._workers.values():
            own = registration.handler.schedules if isinstance(registration.handler, TaskRegistry) else ()
            for schedule in (*own, *registration.options.get("schedules", ())):
                schedules[registration.model][schedule.name] = schedule
        db = self.db
        return dashboard_blueprint(
            lambda: db.engine, models, auth=auth, read_only=read_only, name=name,
            lease=leases.pop() if len(leases) == 1 else None, trusted_hosts=trusted_hosts,
            api_actions=api_actions,
            schedules={model: tuple(found.values()) for model, found in schedules.items()},
        )

    @property
    def worker_names(self) -> list[str]:
        return sorted(self._workers)

    def make_worker(self, name: str | None = None, **overrides: Any) -> Worker:
        """Build a registered worker; call inside an app context.

        Its handlers run inside an app context of their own, with ``db.session`` as the
        session of transactional handlers.
        """
        registration = self._registration(name)
        app = current_app._get_current_object()  # type: ignore[attr-defined]
        db = self.db
        return Worker(
            db.engine,
            registration.model,
            registration.handler,
            session_factory=lambda: db.session(),
            job_context=app.app_context,
            **{**registration.options, **overrides},
        )

    def _registration(self, name: str | None) -> _Registration:
        if name is None:
            if len(self._workers) != 1:
                raise click.UsageError(
                    f"name the worker: one of {', '.join(self.worker_names) or '(none registered)'}"
                )
            return next(iter(self._workers.values()))
        try:
            return self._workers[name]
        except KeyError:
            raise click.UsageError(
                f"no worker named {name!r}; registered: {', '.join(self.worker_names) or 'none'}"
            ) from None


def _give_enqueue(scoped: Any) -> None:
    """``scoped.enqueue(...)``/``enqueue_many(...)`` act on the session of the current scope."""

    def scoped_enqueue(job: Any, **options: Any) -> Any:
        return enqueue(scoped(), job, **options)

    def scoped_enqueue_many(model: Any, rows: Iterable[Any], **options: Any) -> EnqueuedMany:
        session: Session = scoped()  # Flask-SQLAlchemy's sessions are synchronous
        return enqueue_many(session, model, rows, **options)

    scoped.enqueue = scoped_enqueue
    scoped.enqueue_many = scoped_enqueue_many


def _extension() -> FlaskQueue:
    ext = current_app.extensions.get("sqla_queue")
    if not isinstance(ext, FlaskQueue):
        raise click.UsageError("sqla_queue.flask.FlaskQueue is not initialised on this app")
    return ext


def _engine_and_model(name: str | None) -> tuple[Any, Any]:
    ext = _extension()
    return ext.db.engine, ext._registration(name).model


def _queue_names(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    """The queue-name rules of ``sqla-queue``: an empty name would claim nothing, silently."""
    for value in values:
        try:
            check_queue(value, "a queue name")
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
    return values


def _retention(
    ctx: click.Context, param: click.Parameter, values: tuple[str, ...]
) -> tuple[tuple[str | None, float], ...] | None:
    """``--retention 7d`` / ``--retention failed=30d``, as ``sqla-queue worker`` reads them."""
    try:
        return tuple(retention_age(value) for value in values) or None
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise click.BadParameter(str(exc)) from None


if TYPE_CHECKING:  # generic in recent click releases only: subscripted for the type checker alone
    _ParamType = click.ParamType[timedelta, str]
else:
    _ParamType = click.ParamType


class _Duration(_ParamType):
    """``90s``, ``15m``, ``7d`` (:func:`~sqla_queue.cli.parse_duration`, or with ``age``
    :func:`~sqla_queue.cli.parse_age`), shown as DURATION or AGE in ``--help``, not as the
    parsing function's name."""

    def __init__(self, *, age: bool = False) -> None:
        self.name = "age" if age else "duration"
        self._parse = parse_age if age else parse_duration

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> timedelta:
        try:
            return self._parse(value)
        except DurationError as exc:
            self.fail(str(exc), param, ctx)


_DURATION, _AGE = _Duration(), _Duration(age=True)


def _version() -> str:
    from . import __version__

    return __version__


_queue_commands = AppGroup("queue", help="Run and inspect sqla_queue workers.")
_queue_commands = click.version_option(_version(), "--version", prog_name="sqla_queue", message="%(prog)s %(version)s")(
    _queue_commands
)
_name = click.argument("name", required=False)


@_queue_commands.command("worker")
@_name
@click.option("--concurrency", type=click.IntRange(min=1), help="handler threads")
@click.option("--batch-size", type=click.IntRange(min=1), help="most jobs per claim")
@click.option("--lease", type=_DURATION, help="lease length (e.g. 60s)")
@click.option("--heartbeat-interval", "--heartbeat", "heartbeat", type=_DURATION,
              help="heartbeat interval, the worker's heartbeat_interval (default lease/3)")
@click.option("--queue", multiple=True, callback=_queue_names, help="claim from this queue (repeatable)")
@click.option("--poll-interval", type=_DURATION, help="poll at least this often")
@click.option("--sweep-interval", type=_DURATION, help="sweep expired leases this often (0: never)")
@click.option("--shutdown-grace", type=_DURATION, help="time running jobs get on SIGTERM")
@click.option("--no-listen", is_flag=True, help="poll only (PgBouncer transaction pooling)")
@click.option("--timeout", type=_DURATION, help="how long one attempt may run (default: no limit)")
@click.option("--retention", multiple=True, callback=_retention, metavar="[STATUS=]AGE",
              help="prune finished jobs this old: 7d (done and cancelled) or failed=30d (repeatable)")
@click.option("--no-periodic", is_flag=True, help="enqueue no periodic jobs from this worker")
@click.option("--until-idle", is_flag=True, help="exit once no runnable job is left")
@click.option("--metrics-port", type=click.IntRange(min=1, max=65535),
              help="serve Prometheus metrics on this port (the prometheus extra)")
@click.option(
    "--log-level",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], case_sensitive=False),
    default="INFO",
    show_default=True,
    help="logging level, unless the app configured logging itself",
)
def _worker_command(name: str | None, until_idle: bool, log_level: str, **options: Any) -> None:
    """Run a registered worker until SIGTERM/SIGINT; without NAME, every registered
    worker, in this one process, with one shutdown."""
    # As the sqla-queue command does: without it the worker's log lines go nowhere.
    # basicConfig leaves a logging set-up the app made itself alone.
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)

    def seconds(value: Any) -> Any:
        return value.total_seconds() if isinstance(value, timedelta) else value

    overrides = worker_overrides(**{k: seconds(v) for k, v in options.items()})
    ext = _extension()
    names = [name] if name is not None else ext.worker_names
    if not names:
        raise click.UsageError("no worker is registered: queue.add_worker(Model, handler) first")
    try:
        workers = [ext.make_worker(each, **overrides) for each in names]
    except ValueError as exc:  # e.g. a heartbeat not shorter than the lease
        raise click.UsageError(str(exc)) from None
    try:
        for worker in workers:
            check_database(worker.engine, worker.model)
    except (OperationalError, ProgrammingError, WorkerStartError) as exc:
        raise click.ClickException(str(getattr(exc, "orig", exc)).strip().splitlines()[0]) from None
    if len(workers) == 1:
        workers[0].run(until_idle=until_idle)
    else:  # one per registration: a signal stops them all, their graces side by side
        Workers(workers).run(until_idle=until_idle)


@_queue_commands.command("sweep")
@_name
def _sweep_command(name: str | None) -> None:
    """Return expired leases to pending (or failed) once."""
    back, dead = admin.sweep(*_engine_and_model(name))
    click.echo(f"swept {back + dead} expired lease(s): {back} back to pending, {dead} dead-lettered")


@_queue_commands.command("stats")
@_name
@click.option("--json", "as_json", is_flag=True, help="as JSON (with the table's dead tuples)")
def _stats_command(name: str | None, as_json: bool) -> None:
    """Jobs per queue and status, and the oldest runnable job's age."""
    if as_json:
        click.echo(json.dumps(admin.stats_json(*_engine_and_model(name)), indent=2))
    else:
        click.echo(admin.format_stats(*_engine_and_model(name)))


def _filter_options(*, statuses: list[str] | None, ids: bool = True) -> Callable[[F], F]:
    """The inspection filters of ``sqla-queue jobs|requeue|delete``, as click options."""

    def decorate(command: F) -> F:
        options = [
            click.option("--error", "error", help="only jobs whose last_error contains TEXT", metavar="TEXT"),
            click.option("--task", "tasks", multiple=True, help="only this task, on a task table (repeatable)"),
        ]
        if statuses:
            options.append(
                click.option("--status", "statuses", multiple=True, type=click.Choice(statuses),
                             help="only this status (repeatable)")
            )
        options.append(
            click.option("--queue", "queues", multiple=True, callback=_queue_names, help="only this queue (repeatable)")
        )
        if ids:
            options.append(click.option("--id", "ids", multiple=True, help="only this job (repeatable)"))
        for option in options:
            command = option(command)
        return command

    return decorate


def _filters(model: Any, *, ids: tuple[str, ...] = (), queues: tuple[str, ...] = (), statuses: tuple[str, ...] = (),
             tasks: tuple[str, ...] = (), error: str | None = None) -> admin.JobFilters:
    try:
        parsed = tuple(admin.parse_job_id(model, value) for value in ids)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--id") from None
    if error == "":
        raise click.BadParameter("must not be empty", param_hint="--error")
    return admin.JobFilters(queues=queues, statuses=statuses, tasks=tasks, error_contains=error, ids=parsed)


def _usage(run: Any) -> Any:
    """``run()``, a filter the table cannot take (``--task`` on a typed table) a usage error."""
    try:
        return run()
    except (TypeError, ValueError) as exc:
        raise click.UsageError(str(exc)) from None


_STATUSES = [s.value for s in JobStatus]


@_queue_commands.command("requeue")
@_name
@_filter_options(statuses=None)
@click.option("--status", "statuses", multiple=True, type=click.Choice(["failed", "cancelled"]),
              help="requeue jobs in this state (repeatable; default failed)")
def _requeue_command(
    name: str | None, ids: tuple[str, ...], queues: tuple[str, ...], tasks: tuple[str, ...], error: str | None,
    statuses: tuple[str, ...],
) -> None:
    """Give dead-lettered (or cancelled) jobs a fresh set of attempts."""
    if not (ids or queues or tasks or error or statuses):
        raise click.UsageError(REQUEUE_NEEDS_A_SELECTION)
    engine, model = _engine_and_model(name)
    filters = _filters(model, ids=ids, queues=queues, tasks=tasks, error=error).builder_kwargs()
    count = _usage(lambda: admin.requeue(
        engine, model, ids=filters["ids"], queues=filters["queues"], tasks=filters["tasks"],
        error_contains=filters["error_contains"], statuses=statuses or ("failed",),
    ))
    what = " or ".join(statuses) if statuses else "dead-lettered"
    click.echo(f"requeued {count} {what} job(s)")


@_queue_commands.command("cancel")
@_name
@click.option("--id", "ids", multiple=True, help="this job (repeatable)")
@click.option("--queue", "queues", multiple=True, callback=_queue_names,
              help="every unfinished job of this queue (repeatable)")
def _cancel_command(name: str | None, ids: tuple[str, ...], queues: tuple[str, ...]) -> None:
    """Cancel pending and running jobs: their attempts can no longer complete."""
    if not ids and not queues:
        raise click.UsageError("give --id or --queue (it never cancels every job by default)")
    engine, model = _engine_and_model(name)
    filters = _filters(model, ids=ids, queues=queues)
    cancelled = _usage(lambda: admin.cancel(
        engine, model, ids=list(filters.ids) or None, queues=list(filters.queues) or None
    ))
    click.echo(f"cancelled {len(cancelled)} job(s)")


def _controls(run: Callable[[], T]) -> T:
    """``run()``, a refused control a clean error: a model without a queues table (the
    change would not be read), or a limit no rule has (a usage error)."""
    try:
        return run()
    except QueuesTableNotDeclared as exc:
        raise click.ClickException(str(exc)) from None
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


@_queue_commands.command("pause")
@_name
@click.option("--queue", "queues", multiple=True, required=True, callback=_queue_names,
              help="the queue to pause (repeatable)")
def _pause_command(name: str | None, queues: tuple[str, ...]) -> None:
    """Stop claiming the jobs of a queue, on every worker (running jobs finish)."""
    engine, model = _engine_and_model(name)
    for queue, paused in _controls(lambda: admin.pause_queues(engine, model, queues)):
        click.echo(f"paused {queue}" if paused else f"{queue} was paused already")


@_queue_commands.command("resume")
@_name
@click.option("--queue", "queues", multiple=True, required=True, callback=_queue_names,
              help="the queue to resume (repeatable)")
def _resume_command(name: str | None, queues: tuple[str, ...]) -> None:
    """Claim the jobs of a paused queue again, on every worker."""
    engine, model = _engine_and_model(name)
    for queue, resumed in _controls(lambda: admin.resume_queues(engine, model, queues)):
        click.echo(f"resumed {queue}" if resumed else f"{queue} was not paused")


@_queue_commands.command("limit")
@_name
@click.option("--queue", "queues", multiple=True, required=True, callback=_queue_names,
              help="the queue to set (repeatable)")
@click.option("--concurrency", type=click.IntRange(min=1),
              help="most running jobs of the queue (its Concurrency(key='queue')); default: the model's")
@click.option("--rate", type=click.IntRange(min=1),
              help="most starts per the period of the model's RateLimit(key='queue'); default: the model's")
def _limit_command(name: str | None, queues: tuple[str, ...], concurrency: int | None, rate: int | None) -> None:
    """Set a queue's own limits, on every worker, in place of the model's per-queue rules."""
    engine, model = _engine_and_model(name)
    _controls(lambda: admin.set_queue_limits(engine, model, queues, concurrency=concurrency, rate=rate))

    def shown(value: int | None) -> str:
        return "the model's" if value is None else str(value)

    for queue in dict.fromkeys(queues):
        click.echo(f"limits of {queue}: concurrency {shown(concurrency)}, rate {shown(rate)}")


@_queue_commands.command("jobs")
@_name
@_filter_options(statuses=_STATUSES, ids=False)
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True, help="jobs per page")
@click.option("--before", metavar="ID", help="the page after this job id (printed under a full page)")
def _jobs_command(name: str | None, limit: int, before: str | None, **options: Any) -> None:
    """List jobs, newest first, by queue, status, task or error text."""
    engine, model = _engine_and_model(name)
    filters = _filters(model, **options)
    try:
        after = admin.parse_job_id(model, before) if before is not None else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--before") from None
    page = _usage(lambda: admin.list_jobs(engine, model, filters, before=after, limit=limit,
                                          columns=admin.listed_columns(model)))
    click.echo(admin.format_jobs(model, page))


@_queue_commands.command("show")
@click.argument("names", nargs=-1, metavar="[NAME] ID")
@click.option("--table", "table", hidden=True, help="the registered worker: give it as NAME, before ID")
def _show_command(names: tuple[str, ...], table: str | None) -> None:
    """Every column of one job, and its full last_error.

    NAME first, then ID, as every other command takes NAME (--table NAME still works).
    """
    if len(names) not in (1, 2):
        raise click.UsageError("give [NAME] ID: the registered worker (if there are several), then the job's id")
    if len(names) == 2 and table is not None:
        raise click.UsageError("give the worker either as NAME or as --table, not both")
    name, job_id = (names[0], names[1]) if len(names) == 2 else (table, names[0])
    engine, model = _engine_and_model(name)
    try:
        key = admin.parse_job_id(model, job_id)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="ID") from None
    row = admin.get_job(engine, model, key)
    if row is None:
        raise click.ClickException(f"no job {job_id}")
    click.echo(admin.format_job(row))


@_queue_commands.command("delete")
@_name
@_filter_options(statuses=[s for s in _STATUSES if s != JobStatus.RUNNING.value])
@click.option("--limit", type=click.IntRange(min=1), default=10_000, show_default=True, help="rows per statement")
@click.option("--free-keys", is_flag=True,
              help="also delete finished jobs that hold a unique key (UNIQUE_EVER): their work may then run again")
def _delete_command(name: str | None, limit: int, free_keys: bool, **options: Any) -> None:
    """Delete jobs by id or filter (never running ones)."""
    engine, model = _engine_and_model(name)
    filters = _filters(model, **options)
    if filters.empty:
        raise click.UsageError("name the jobs to delete: --id, or at least one of --queue, --status, --task, --error")
    count = _usage(lambda: admin.delete_jobs(engine, model, filters, limit=limit, free_keys=free_keys))
    click.echo(f"deleted {count} job(s)")
    kept = 0 if free_keys else admin.key_holders(engine, model, filters)
    if kept:
        click.echo(
            f"kept {kept} finished job(s) that still hold their unique key: deleting one frees its key, so the "
            "same work could be enqueued and run again; add --free-keys to delete them anyway",
            err=True,
        )


@_queue_commands.command("prune")
@_name
@click.option("--older-than", type=_AGE, required=True, help="with its unit: 12h, 7d, 2w")
@click.option("--status", "statuses", multiple=True, type=click.Choice(["done", "failed", "cancelled"]))
def _prune_command(name: str | None, older_than: timedelta, statuses: tuple[str, ...]) -> None:
    """Delete finished jobs older than a cutoff (dead letters kept unless --status failed)."""
    chosen = list(statuses) or ["done", "cancelled"]
    count = admin.prune(*_engine_and_model(name), older_than=older_than, statuses=chosen)
    click.echo(f"pruned {count} finished job(s) ({', '.join(chosen)}) older than {older_than}")


@_queue_commands.command("schedules")
@_name
def _schedules_command(name: str | None) -> None:
    """List the periodic schedules with their last and next tick."""
    ext = _extension()
    registration = ext._registration(name)
    own = registration.handler.schedules if isinstance(registration.handler, TaskRegistry) else ()
    schedules = [*own, *registration.options.get("schedules", ())]
    click.echo(admin.format_schedules(ext.db.engine, registration.model, schedules))
