"""The sqla-queue command line: run workers, enqueue, sweep, inspect, requeue, cancel, pause, limit, prune.

TARGET is module:attribute (the module importable from the current directory): a
sqla_queue Worker or AsyncWorker, a function returning one, or, for the commands that do
not run jobs, a queue model together with --url (or DATABASE_URL). worker, stats, jobs
and dashboard take several: one worker per table in one process, each table in turn, or
every table on one dashboard.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError, ProgrammingError

from . import admin
from .cli_targets import (
    CommandError,
    dashboard_targets,
    database_url,
    load_target,
    on_admin_target,
    on_each_target,
    worker_from,
)
from .enqueue._rules import check_queue
from .errors import SqlaQueueError
from .model import JobStatus, queue_table

T = TypeVar("T")

__all__ = ["main"]


def _add_alembic_commands(subparsers: argparse._SubParsersAction[Any]) -> None:
    """``sqla-queue alembic init DIR``: a migrations folder from ``alembic_templates/``."""
    alembic = _subcommand(subparsers, "alembic", "Alembic migrations for queue tables")
    alembic_commands = alembic.add_subparsers(dest="alembic_command", required=True)
    init = _subcommand(alembic_commands, "init", "create a migrations folder wired for sqla_queue")
    init.add_argument("directory", help="the migrations folder to create (must be empty or absent)")
    init.add_argument(
        "-c", "--config", default="alembic.ini", help="the alembic.ini to write, unless it exists"
    )
    init.add_argument(
        "--package", action="store_true", help="write __init__.py files into the folders"
    )
    init.set_defaults(func=_alembic_init)


def _alembic_init(args: argparse.Namespace) -> int:
    """What was created and what to do next; not Alembic's line per file, nor the INFO
    lines of its plugin set-up (shown with ``--log-level DEBUG``)."""
    if args.log_level > logging.DEBUG:
        logging.getLogger("alembic").setLevel(logging.WARNING)
    # Imported here: the other commands need not load Alembic.
    from alembic.util import CommandError as AlembicError

    from .alembic import init

    try:
        created = init(args.directory, config_file=args.config, package=args.package, quiet=True)
    except AlembicError as exc:
        raise CommandError(str(exc)) from None
    folder = args.directory.rstrip("/" + os.sep) or args.directory
    config = Path(args.config).resolve()
    inside = [path.name + ("/" if path.is_dir() else "") for path in created if path.resolve() != config]
    wrote_config = len(inside) < len(created)
    print(f"Created {folder}/ ({', '.join(inside)})" + (f" and {args.config}." if wrote_config else "."))
    if not wrote_config:
        print(f"Kept the existing {args.config}: its script_location must name {folder}.")
    print(
        f"Next: set target_metadata in {os.path.join(folder, 'env.py')} and sqlalchemy.url in "
        f"{args.config}, then run\n"
        f'  alembic revision --autogenerate -m "queue table"\n'
        f"  alembic upgrade head"
    )
    return 0


# -- argument types: a bad value is a usage error naming its option, never a traceback ------


_DURATION = re.compile(r"^\s*([-+]?\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class DurationError(argparse.ArgumentTypeError, ValueError):
    """Not a duration; argparse and click both report the message as a usage error."""


def parse_duration(text: str | timedelta) -> timedelta:
    """``90``, ``90s``, ``15m``, ``12h``, ``7d``, ``2w``; never negative."""
    if isinstance(text, timedelta):
        return text
    match = _DURATION.match(text)
    if not match:
        raise DurationError(f"not a duration: {text!r} (try 30s, 15m, 12h, 7d)")
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if seconds < 0:
        raise DurationError(f"a duration must not be negative, got {text!r}")
    try:
        return timedelta(seconds=seconds)
    except OverflowError:
        raise DurationError(f"duration too long: {text!r} (at most {timedelta.max.days} days)") from None


#: The longest age ``--older-than`` and ``--retention`` take: a cutoff further back is
#: out of PostgreSQL's timestamp range (the server would answer with a DataError).
MAX_AGE = timedelta(days=365_000)


def parse_age(text: str | timedelta) -> timedelta:
    """A retention age, ``7d``, ``12h``, ``2w``: a duration with its unit, at most
    :data:`MAX_AGE`. A bare number is refused: ``7`` meant seven seconds, never the
    seven days its writer had in mind."""
    if isinstance(text, timedelta):
        return text
    match = _DURATION.match(text)
    if match and not match.group(2):
        raise DurationError(f"give the unit of {text!r}: s, m, h, d or w (e.g. {text.strip()}d)")
    age = parse_duration(text)
    if age > MAX_AGE:
        raise DurationError(f"age too long: {text!r} (at most {MAX_AGE.days} days)")
    return age


def _seconds(*, positive: bool) -> Callable[[str], float]:
    def seconds(text: str) -> float:
        value = parse_duration(text).total_seconds()
        if positive and value <= 0:
            raise DurationError(f"must be longer than 0, got {text!r}")
        return value

    return seconds


_FINISHED = ("done", "failed", "cancelled")


def retention_age(text: str) -> tuple[str | None, float]:
    """``7d`` (done and cancelled jobs) or ``STATUS=AGE`` (``failed=30d``)."""
    status, sep, age = text.rpartition("=")
    if sep and status not in _FINISHED:
        raise argparse.ArgumentTypeError(f"not a finished status: {status!r} (one of {', '.join(_FINISHED)})")
    seconds = parse_age(age).total_seconds()
    if seconds <= 0:
        raise DurationError(f"a retention must be longer than 0, got {text!r}")
    return (status or None), seconds


def retention_option(given: Sequence[tuple[str | None, float]]) -> float | dict[str, float]:
    """The ``retention`` worker option of ``--retention`` values: one age alone stays
    one age; ages named by status make a mapping (an unnamed one then stands for done
    and cancelled)."""
    if len(given) == 1 and given[0][0] is None:
        return given[0][1]
    ages: dict[str, float] = {}
    for status, seconds in given:
        for name in (status,) if status is not None else ("done", "cancelled"):
            ages[name] = seconds
    return ages


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None


def port_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is between 0 and 65535, got {value}")
    return value


def _nonempty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def queue_name(text: str) -> str:
    """The rules ``enqueue()`` applies: a name it would refuse can hold no job to claim."""
    try:
        check_queue(text, "a queue name")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(text: str) -> int:
    name = text.upper()
    if name not in _LEVELS:
        raise argparse.ArgumentTypeError(f"unknown level {text!r} (one of {', '.join(_LEVELS)})")
    level = logging.getLevelName(name)
    assert isinstance(level, int)
    return level


# -- commands -------------------------------------------------------------------------------


def worker_overrides(
    *,
    concurrency: int | None = None,
    batch_size: int | None = None,
    lease: float | None = None,
    heartbeat: float | None = None,
    poll_interval: float | None = None,
    sweep_interval: float | None = None,
    shutdown_grace: float | None = None,
    queue: Sequence[str] | None = None,
    no_listen: bool = False,
    metrics_port: int | None = None,
    timeout: float | None = None,
    retention: Sequence[tuple[str | None, float]] | None = None,
    no_periodic: bool = False,
) -> dict[str, Any]:
    """Worker options given on a command line (only those given)."""
    given = {
        "concurrency": concurrency,
        "batch_size": batch_size,
        "lease": lease,
        "heartbeat_interval": heartbeat,
        "poll_interval": poll_interval,
        "sweep_interval": sweep_interval,
        "shutdown_grace": shutdown_grace,
        "queues": tuple(queue) if queue else None,
        "listen": False if no_listen else None,
        "metrics_port": metrics_port,
        "timeout": timeout,
        "retention": retention_option(retention) if retention else None,
        "periodic": False if no_periodic else None,
    }
    return {key: value for key, value in given.items() if value is not None}


def check_overrides(overrides: dict[str, Any]) -> None:
    """Refuse (ValueError) option values no worker accepts, before the target is imported.

    A heartbeat given without a lease is checked later, against the target's own lease.
    """
    from .worker import Worker

    alone = dict(overrides)
    if "heartbeat_interval" in alone and "lease" not in alone:
        del alone["heartbeat_interval"]
    Worker.check_options(**alone)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return worker_overrides(
        concurrency=args.concurrency,
        batch_size=args.batch_size,
        lease=args.lease,
        heartbeat=args.heartbeat,
        poll_interval=args.poll_interval,
        sweep_interval=args.sweep_interval,
        shutdown_grace=args.shutdown_grace,
        queue=args.queue,
        timeout=args.timeout,
        no_listen=args.no_listen,
        metrics_port=args.metrics_port,
        retention=args.retention,
        no_periodic=args.no_periodic,
    )


def check_database(engine: Any, model: Any) -> None:
    """Connect and check the queue table once: a wrong URL fails at start with the
    database's own message (``OperationalError``), a missing or unmigrated table with
    the worker's :class:`~sqla_queue.WorkerStartError`, not later in a retry loop."""
    admin.check_table(engine, model)


def cmd_worker(args: argparse.Namespace) -> int:
    from .group import Workers
    from .worker.aio import AsyncWorker

    overrides = _overrides(args)
    workers = []
    for spec in args.target:  # each target's own worker; the flags apply to every one
        try:
            workers.append(worker_from(load_target(spec)).with_options(**overrides))
        except (TypeError, ValueError) as exc:
            raise CommandError(str(exc)) from None
    kinds = {isinstance(w, AsyncWorker) for w in workers}
    if len(kinds) > 1:
        raise CommandError("the targets mix Workers and AsyncWorkers: one process runs one kind")
    tables = [w.model for w in workers]
    if len({id(queue_table(m).table) for m in tables}) != len(tables):
        raise CommandError("two targets serve the same table: give each table once")
    # Every worker checks the database and its table as it starts (WorkerStartError).
    if kinds == {True}:
        asyncio.run(_run_async(workers, until_idle=args.until_idle))
        return 0
    if len(workers) == 1:
        workers[0].run(until_idle=args.until_idle)
    else:
        Workers(workers).run(until_idle=args.until_idle)
    return 0


async def _run_async(workers: list[Any], *, until_idle: bool) -> None:
    """Run AsyncWorkers (each start checks the database), then close their engines'
    connections while the event loop that made them still runs."""
    from .group import AsyncWorkers

    try:
        if len(workers) == 1:
            await workers[0].run(until_idle=until_idle)
        else:
            await AsyncWorkers(workers).run(until_idle=until_idle)
    finally:
        for engine in {id(w.engine): w.engine for w in workers}.values():
            await engine.dispose()


def cmd_sweep(args: argparse.Namespace) -> int:
    back, dead = on_admin_target(args, lambda engine, model: admin.sweep(engine, model, limit=args.limit))
    print(f"swept {back + dead} expired lease(s): {back} back to pending, {dead} dead-lettered")
    return 0


def _sections(found: list[tuple[str, str]]) -> str:
    """One target's text as it is; several, each under its table's name."""
    if len(found) == 1:
        return found[0][1]
    return "\n\n".join(f"== {table} ==\n{text}" for table, text in found)


def cmd_stats(args: argparse.Namespace) -> int:
    if args.json:
        found = on_each_target(args, admin.stats_json)
        # One target: its object, as ever; several: a list of them (each names its table).
        print(json.dumps(found[0][1] if len(found) == 1 else [stats for _, stats in found], indent=2))
    else:
        print(_sections(on_each_target(args, admin.format_stats)))
    return 0


def _filters(args: argparse.Namespace, model: Any, *, ids: bool = True) -> admin.JobFilters:
    """The filter options given, as :class:`~sqla_queue.admin.JobFilters`; bad ids are a
    usage error naming the option."""
    try:
        parsed = tuple(admin.parse_job_id(model, value) for value in (getattr(args, "id", None) or ())) if ids else ()
    except ValueError as exc:
        raise CommandError(f"argument --id: {exc}") from None
    return admin.JobFilters(
        queues=tuple(args.queue or ()),
        statuses=tuple(getattr(args, "status", None) or ()),
        tasks=tuple(getattr(args, "task", None) or ()),
        error_contains=getattr(args, "error", None),
        ids=parsed,
    )


def _with_filters(
    args: argparse.Namespace, command: Callable[[Engine, Any, admin.JobFilters], T]
) -> Callable[[Engine, Any], T]:
    """``command(engine, model, filters)``, the filters read once the model is known (it
    gives the type of ``--id``); a filter the table cannot take is a usage error."""

    def run(engine: Engine, model: Any) -> T:
        filters = _filters(args, model)
        try:
            return command(engine, model, filters)
        except (TypeError, ValueError) as exc:  # e.g. --task on a table without a task column
            raise CommandError(str(exc)) from None

    return run


#: As ``delete`` and ``cancel``: requeueing every dead letter is asked for, not a default.
REQUEUE_NEEDS_A_SELECTION = (
    "name the jobs to requeue: --id, or at least one of --queue, --task, --error, --status "
    "(--status failed: every dead letter)"
)


def cmd_requeue(args: argparse.Namespace) -> int:
    statuses = args.status or ["failed"]
    if not (args.id or args.queue or args.task or args.error or args.status):
        raise CommandError(REQUEUE_NEEDS_A_SELECTION)

    def requeue(engine: Engine, model: Any, filters: admin.JobFilters) -> int:
        kwargs = filters.builder_kwargs()
        return admin.requeue(
            engine, model, ids=kwargs["ids"], queues=kwargs["queues"], tasks=kwargs["tasks"],
            error_contains=kwargs["error_contains"], statuses=statuses,
        )

    count = on_admin_target(args, _with_filters(args, requeue))
    what = " or ".join(statuses) if args.status else "dead-lettered"
    print(f"requeued {count} {what} job(s)")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    if not args.id and not args.queue:
        raise CommandError("give --id or --queue (it never cancels every job by default)")

    def cancel(engine: Engine, model: Any, filters: admin.JobFilters) -> list[Any]:
        return admin.cancel(engine, model, ids=list(filters.ids) or None, queues=list(filters.queues) or None)

    cancelled = on_admin_target(args, _with_filters(args, cancel))
    print(f"cancelled {len(cancelled)} job(s)")
    return 0


def cmd_pause(args: argparse.Namespace) -> int:
    changed = on_admin_target(args, lambda engine, model: admin.pause_queues(engine, model, args.queue))
    for queue, paused in changed:
        print(f"paused {queue}" if paused else f"{queue} was paused already")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    changed = on_admin_target(args, lambda engine, model: admin.resume_queues(engine, model, args.queue))
    for queue, resumed in changed:
        print(f"resumed {queue}" if resumed else f"{queue} was not paused")
    return 0


def cmd_limit(args: argparse.Namespace) -> int:
    def limit(engine: Engine, model: Any) -> None:
        try:
            admin.set_queue_limits(engine, model, args.queue, concurrency=args.concurrency, rate=args.rate)
        except ValueError as exc:
            raise CommandError(str(exc)) from None

    on_admin_target(args, limit)
    def shown(value: int | None) -> str:
        return "the model's" if value is None else str(value)

    for queue in dict.fromkeys(args.queue):
        print(f"limits of {queue}: concurrency {shown(args.concurrency)}, rate {shown(args.rate)}")
    return 0


def cmd_enqueue(args: argparse.Namespace) -> int:
    try:
        values = json.loads(args.json)
    except json.JSONDecodeError as exc:
        raise CommandError(f"argument --json: not JSON ({exc})") from None
    if not isinstance(values, dict):
        raise CommandError(f"argument --json: a JSON object is needed, got {type(values).__name__}")
    options = {
        name: getattr(args, name)
        for name in ("queue", "priority", "max_attempts", "delay", "timeout")
        if getattr(args, name) is not None
    }

    def enqueue(engine: Engine, model: Any) -> Any:
        from .enqueue import enqueue_values

        qt = queue_table(model)
        if qt.is_task_table:
            if args.task is None:
                raise CommandError(f"{qt.table.name!r} is a task table: name the TASK, and give its payload in --json")
            _check_task(getattr(args, "handler_found", None), args.task, values)
            row: dict[str, Any] = {"task": args.task, "payload": values}
        elif args.task is not None:
            raise CommandError(f"{qt.table.name!r} has no task column: give the job's columns in --json, and no TASK")
        else:
            row = values
        with engine.begin() as conn:
            try:
                return enqueue_values(conn, model, row, unique_key=args.unique_key, **options)
            except (TypeError, ValueError) as exc:
                raise CommandError(str(exc)) from None

    found = on_admin_target(args, enqueue)
    if args.unique_key is None:
        print(f"enqueued job {found}")
    elif found.inserted:
        print(f"enqueued job {found.job_id}")
    else:
        print(f"skipped: job {found.job_id} holds the key {args.unique_key!r}")
    return 0


def _check_task(handler: Any, name: str, payload: dict[str, Any]) -> None:
    """With a worker TARGET, the task must be one its registry runs, and a function that
    takes its payload as keywords must take this one (as ``task.enqueue()`` checks it)."""
    from .errors import TaskArgumentError, UnknownTask
    from .task_functions import check_payload
    from .tasks import TaskRegistry, payload_signature

    if not isinstance(handler, TaskRegistry):
        return  # a model TARGET: no code to check against
    try:
        function = handler.lookup(name).function or handler.lookup(name).fn
        signature = payload_signature(function)
        if signature is not None:
            check_payload(name, function, signature, payload)
    except (UnknownTask, TaskArgumentError) as exc:
        raise CommandError(str(exc)) from None


def cmd_workers(args: argparse.Namespace) -> int:
    def workers(engine: Engine, model: Any) -> str:
        try:
            rows = admin.registered_workers(engine, model)
        except TypeError as exc:
            raise CommandError(str(exc)) from None
        return admin.format_workers(rows, args.lease)

    print(on_admin_target(args, workers))
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    if args.before is not None and len(args.target) > 1:
        raise CommandError("argument --before: a page of one table's jobs: give its TARGET alone")

    def jobs(engine: Engine, model: Any, filters: admin.JobFilters) -> str:
        before = None
        if args.before is not None:
            try:
                before = admin.parse_job_id(model, args.before)
            except ValueError as exc:
                raise CommandError(f"argument --before: {exc}") from None
        page = admin.list_jobs(engine, model, filters, before=before, limit=args.limit,
                               columns=admin.listed_columns(model))
        return admin.format_jobs(model, page)

    print(_sections(on_each_target(args, _with_filters(args, jobs))))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    def show(engine: Engine, model: Any) -> str | None:
        try:
            job_id = admin.parse_job_id(model, args.job_id)
        except ValueError as exc:
            raise CommandError(f"argument ID: {exc}") from None
        row = admin.get_job(engine, model, job_id)
        return None if row is None else admin.format_job(row)

    shown = on_admin_target(args, show)
    if shown is None:
        print(f"sqla-queue: no job {args.job_id}", file=sys.stderr)
        return 1
    print(shown)
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    def delete(engine: Engine, model: Any, filters: admin.JobFilters) -> tuple[int, int]:
        if filters.empty:
            raise CommandError("name the jobs to delete: --id, or at least one of --queue, --status, --task, --error")
        deleted = admin.delete_jobs(engine, model, filters, limit=args.limit, free_keys=args.free_keys)
        return deleted, 0 if args.free_keys else admin.key_holders(engine, model, filters)

    count, kept = on_admin_target(args, _with_filters(args, delete))
    print(f"deleted {count} job(s)")
    if kept:
        print(
            f"sqla-queue: kept {kept} finished job(s) that still hold their unique key: deleting one frees "
            "its key, so the same work could be enqueued and run again; add --free-keys to delete them anyway",
            file=sys.stderr,
        )
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from .dashboard import serve, served_hosts

    try:
        trusted_hosts = served_hosts(args.host, args.trusted_host)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    engine, models, lease, schedules = dashboard_targets(args)
    if args.lease is not None:
        lease = args.lease
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"sqla-queue: warning: the dashboard has no login of its own and now listens on {args.host}: "
            "put it behind your authentication (or mount dashboard_blueprint in your app with auth=)",
            file=sys.stderr,
        )
    try:
        for model in models:
            admin.check_table(engine, model)
        serve(engine, models, host=args.host, port=args.port, read_only=args.read_only, lease=lease,
              trusted_hosts=trusted_hosts, api_actions=args.api_actions, schedules=schedules)
    finally:
        engine.dispose()
    return 0


def cmd_schedules(args: argparse.Namespace) -> int:
    def schedules(engine: Engine, model: Any) -> str:
        # Set once the target turned out to be a worker: a model alone does not say
        # which schedules its code declares.
        found = getattr(args, "schedules_found", None)
        return admin.format_schedules(engine, model, found or (), code_known=found is not None)

    print(on_admin_target(args, schedules))
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    statuses = args.status or ["done", "cancelled"]
    count = on_admin_target(
        args,
        lambda engine, model: admin.prune(
            engine, model, older_than=args.older_than, statuses=statuses, limit=args.limit
        ),
    )
    print(f"pruned {count} finished job(s) ({', '.join(statuses)}) older than {args.older_than}")
    return 0


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, ``sqla-queue worker: error: ...``, with exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _subcommand(
    subparsers: argparse._SubParsersAction[Any], name: str, help: str
) -> argparse.ArgumentParser:
    """A subcommand that also takes ``--log-level`` after its name.

    SUPPRESS as its default: the value given before the subcommand, or the main parser's
    default, is kept unless the option is repeated here.
    """
    sub: argparse.ArgumentParser = subparsers.add_parser(name, help=help, description=help)
    sub.add_argument(
        "--log-level", type=log_level, default=argparse.SUPPRESS, metavar="LEVEL", help=_LOG_LEVEL_HELP
    )
    return sub


_LOG_LEVEL_HELP = "DEBUG, INFO, WARNING, ERROR or CRITICAL (default INFO)"


def _version() -> str:
    from . import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sqla-queue", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", type=log_level, default=logging.INFO, metavar="LEVEL", help=_LOG_LEVEL_HELP)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    seconds, positive_seconds = _seconds(positive=False), _seconds(positive=True)

    worker = _subcommand(subparsers, "worker", "run a worker until SIGTERM/SIGINT")
    worker.add_argument("target", nargs="+", help="module:attr of a Worker or AsyncWorker, or of a function "
                        "returning one; several: one worker per table, in one process, with one shutdown")
    worker.add_argument("--concurrency", type=positive_int, help="handler threads (tasks, for an AsyncWorker)")
    worker.add_argument("--batch-size", type=positive_int, help="most jobs per claim")
    worker.add_argument("--lease", type=positive_seconds, help="lease length (e.g. 60s)")
    worker.add_argument(
        "--heartbeat-interval", "--heartbeat", dest="heartbeat", type=positive_seconds,
        help="heartbeat interval, the worker's heartbeat_interval (default lease/3)",
    )
    worker.add_argument("--queue", type=queue_name, action="append", help="claim from this queue (repeatable)")
    worker.add_argument("--poll-interval", type=positive_seconds, help="poll at least this often")
    worker.add_argument("--sweep-interval", type=seconds, help="sweep expired leases this often (0: never)")
    worker.add_argument("--shutdown-grace", type=seconds, help="time running jobs get to finish on SIGTERM")
    worker.add_argument("--no-listen", action="store_true", help="poll only (PgBouncer transaction pooling)")
    worker.add_argument("--timeout", type=positive_seconds, help="how long one attempt may run (default: no limit)")
    worker.add_argument(
        "--retention", type=retention_age, action="append", metavar="[STATUS=]AGE",
        help="prune finished jobs this old: 7d (done and cancelled) or failed=30d (repeatable)",
    )
    worker.add_argument("--no-periodic", action="store_true", help="enqueue no periodic jobs from this worker")
    worker.add_argument("--until-idle", action="store_true", help="exit once no runnable job is left")
    worker.add_argument("--metrics-port", type=positive_int, metavar="PORT",
                        help="serve Prometheus metrics on this port (the prometheus extra)")
    worker.set_defaults(func=cmd_worker, parser=worker)

    def admin(name: str, help: str, *, several: bool = False) -> argparse.ArgumentParser:
        sub = _subcommand(subparsers, name, help)
        if several:
            sub.add_argument("target", nargs="+", help="module:attr of a Worker or AsyncWorker (or factory), or of "
                             "a queue model; several: each table in turn")
        else:
            sub.add_argument("target", help="module:attr of a Worker or AsyncWorker (or factory), or of a queue model")
        sub.add_argument(
            "--url",
            type=database_url,
            help="database URL when TARGET is a model (default: DATABASE_URL); postgresql:// uses psycopg 3",
        )
        return sub

    sweep = admin("sweep", "return expired leases to pending (or failed) once")
    sweep.add_argument("--limit", type=positive_int, default=1000, help="rows per statement")
    sweep.set_defaults(func=cmd_sweep)

    stats = admin("stats", "jobs per queue and status, and the oldest runnable job's age", several=True)
    stats.add_argument("--json", action="store_true",
                       help="as JSON (with the table's dead tuples); several targets: a list, one object per table")
    stats.set_defaults(func=cmd_stats)

    def filters(sub: argparse.ArgumentParser, *, statuses: Sequence[str] | None, ids: bool = True) -> None:
        if ids:
            sub.add_argument("--id", action="append", metavar="ID", help="only this job (repeatable)")
        sub.add_argument("--queue", type=queue_name, action="append", help="only this queue (repeatable)")
        if statuses:
            sub.add_argument("--status", action="append", choices=statuses, help="only this status (repeatable)")
        sub.add_argument("--task", action="append", help="only this task, on a task table (repeatable)")
        sub.add_argument("--error", metavar="TEXT", type=_nonempty, help="only jobs whose last_error contains TEXT")

    requeue = admin("requeue", "give dead-lettered jobs a fresh set of attempts")
    filters(requeue, statuses=None)
    requeue.add_argument(
        "--status", action="append", choices=["failed", "cancelled"],
        help="requeue jobs in this state (repeatable; default failed)",
    )
    requeue.set_defaults(func=cmd_requeue)

    cancel = admin("cancel", "cancel pending and running jobs (their attempts can no longer complete)")
    cancel.add_argument("--id", action="append", metavar="ID", help="this job (repeatable)")
    cancel.add_argument(
        "--queue", type=queue_name, action="append", help="every unfinished job of this queue (repeatable)"
    )
    cancel.set_defaults(func=cmd_cancel)

    for name, verb, func in (("pause", "stop claiming", cmd_pause), ("resume", "claim again", cmd_resume)):
        sub = admin(name, f"{verb} the jobs of a queue, on every worker (running jobs finish)")
        sub.add_argument(
            "--queue", type=queue_name, action="append", required=True, help=f"the queue to {name} (repeatable)"
        )
        sub.set_defaults(func=func)

    limit = admin("limit", "set a queue's own limits, on every worker, in place of the model's per-queue rules")
    limit.add_argument("--queue", type=queue_name, action="append", required=True,
                       help="the queue to set (repeatable)")
    limit.add_argument("--concurrency", type=positive_int,
                       help="most running jobs of the queue (its Concurrency(key='queue')); default: the model's")
    limit.add_argument("--rate", type=positive_int,
                       help="most starts per the period of the model's RateLimit(key='queue'); default: the model's")
    limit.set_defaults(func=cmd_limit)

    enqueue = admin("enqueue", "enqueue one job: a task and its payload, or a typed job's columns, as JSON")
    enqueue.add_argument("task", nargs="?", help="the task's name (a task table); none for a typed table")
    enqueue.add_argument("--json", default="{}", metavar="OBJECT",
                         help="the payload (a task table) or the job's columns, as a JSON object (default {})")
    enqueue.add_argument("--queue", type=queue_name, help="the job's queue (default: the model's)")
    enqueue.add_argument("--priority", type=integer, help="higher runs first (default 0)")
    enqueue.add_argument("--max-attempts", type=positive_int, help="attempts before it is dead-lettered")
    enqueue.add_argument("--delay", type=seconds, help="not claimed before this long from now (e.g. 30s, 5m)")
    enqueue.add_argument("--timeout", type=positive_seconds, help="how long one attempt may run")
    enqueue.add_argument("--unique-key", type=_nonempty, help="skip it if a job holds this key")
    enqueue.set_defaults(func=cmd_enqueue)

    workers = admin("workers", "the workers recorded in the table's workers table, idle ones too")
    workers.add_argument("--lease", type=positive_seconds, default=60.0,
                         help="a worker not seen for this long is shown as gone (default 60s, the workers' lease)")
    workers.set_defaults(func=cmd_workers)

    jobs = admin("jobs", "list jobs, newest first, by queue, status, task or error text", several=True)
    filters(jobs, statuses=[s.value for s in JobStatus], ids=False)
    jobs.add_argument("--limit", type=positive_int, default=50, help="jobs per page (default 50)")
    jobs.add_argument("--before", metavar="ID", help="the page after this job id (printed under a full page)")
    jobs.set_defaults(func=cmd_jobs)

    show = admin("show", "every column of one job, and its full last_error")
    show.add_argument("job_id", metavar="ID", help="the job's id")
    show.set_defaults(func=cmd_show)

    delete = admin("delete", "delete jobs by id or filter (never running ones)")
    filters(delete, statuses=[s.value for s in JobStatus if s is not JobStatus.RUNNING])
    delete.add_argument("--limit", type=positive_int, default=10_000, help="rows per statement")
    delete.add_argument(
        "--free-keys", action="store_true",
        help="also delete finished jobs that hold a unique key (UNIQUE_EVER): their work may then run again",
    )
    delete.set_defaults(func=cmd_delete)

    dashboard = _subcommand(subparsers, "dashboard", "serve the web dashboard (127.0.0.1 unless --host)")
    dashboard.add_argument(
        "target", nargs="+", help="module:attr of a Worker or AsyncWorker (or factory), or of a queue model; "
        "several: every table on one dashboard"
    )
    dashboard.add_argument(
        "--url", type=database_url, help="database URL when TARGET is a model (default: DATABASE_URL)"
    )
    dashboard.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    dashboard.add_argument("--port", type=port_number, default=8787, help="port (default 8787; 0: any free port)")
    dashboard.add_argument(
        "--trusted-host", action="append", metavar="NAME",
        help="a name browsers reach the dashboard by (repeat it; .example.com takes subdomains); any other Host "
        "header is refused (default: localhost, 127.0.0.1 and ::1 on a loopback --host, else --host itself)",
    )
    dashboard.add_argument("--read-only", action="store_true", help="refuse every action (requeue, cancel, delete)")
    dashboard.add_argument(
        "--api-actions", action="store_true",
        help="allow actions through the JSON API under /api/ too (it is read-only without this flag)",
    )
    dashboard.add_argument(
        "--lease",
        type=positive_seconds,
        help="the workers' lease, to show their last heartbeat (default: the targets' own)",
    )
    dashboard.set_defaults(func=cmd_dashboard)

    prune = admin("prune", "delete finished jobs older than a cutoff")
    prune.add_argument(
        "--older-than", type=parse_age, required=True, metavar="AGE", help="with its unit: 12h, 7d, 2w"
    )
    prune.add_argument(
        "--status",
        action="append",
        choices=["done", "failed", "cancelled"],
        help="statuses to prune (repeatable; default done and cancelled, dead letters kept)",
    )
    prune.add_argument("--limit", type=positive_int, default=10_000, help="rows per statement")
    prune.set_defaults(func=cmd_prune)

    schedules = admin("schedules", "list the periodic schedules with their last and next tick")
    schedules.set_defaults(func=cmd_schedules)

    _add_alembic_commands(subparsers)
    return parser


def _first_line(exc: BaseException) -> str:
    """The driver's own message (``database "x" does not exist``), without SQLAlchemy's
    statement dump and background link."""
    cause = getattr(exc, "orig", None) or exc
    lines = str(cause).strip().splitlines()
    return lines[0] if lines else type(cause).__name__


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "worker":
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN and threading.current_thread() is threading.main_thread():
            # Inherited (a background job of a non-interactive shell): SIGINT must still
            # stop the worker, also while it imports its target and starts.
            signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            check_overrides(_overrides(args))
        except (TypeError, ValueError) as exc:
            args.parser.error(str(exc))
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT)
    try:
        return int(args.func(args))
    except CommandError as exc:
        print(f"sqla-queue: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the worker's own signal handling took over
        print("sqla-queue: interrupted", file=sys.stderr)
        return 130
    except (OperationalError, ProgrammingError, SqlaQueueError) as exc:
        print(f"sqla-queue: error: {_first_line(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
