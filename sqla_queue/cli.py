"""The ``sqla-queue`` command line: run workers, sweep, inspect, requeue and prune.

TARGET is ``module:attribute`` (``module`` importable from the current directory):
a :class:`~sqla_queue.Worker`, a function returning one, or, for the commands that do
not run jobs, a queue model together with ``--url`` (or ``DATABASE_URL``).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from . import admin

__all__ = ["main"]


def _add_alembic_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``sqla-queue alembic init DIR``: a migrations folder from ``alembic_templates/``."""
    alembic = subparsers.add_parser("alembic", help="Alembic migrations for queue tables")
    alembic_commands = alembic.add_subparsers(dest="alembic_command", required=True)
    init = alembic_commands.add_parser("init", help="create a migrations folder wired for sqla_queue")
    init.add_argument("directory", help="the migrations folder to create (must be empty or absent)")
    init.add_argument(
        "-c", "--config", default="alembic.ini", help="the alembic.ini to write, unless it exists"
    )
    init.add_argument(
        "--package", action="store_true", help="write __init__.py files into the folders"
    )
    init.set_defaults(func=_alembic_init)


def _alembic_init(args: argparse.Namespace) -> int:
    # Imported here: the other commands need not load Alembic.
    from alembic.util import CommandError as AlembicError

    from .alembic import init

    try:
        init(args.directory, config_file=args.config, package=args.package)
    except AlembicError as exc:
        raise CommandError(str(exc)) from None
    print(f"Then set target_metadata in {os.path.join(args.directory, 'env.py')}.")
    return 0


# -- targets --------------------------------------------------------------------------------


class CommandError(Exception):
    """A usage error worth one clear line, not a traceback."""


def load_target(spec: str) -> Any:
    """Import ``module:attr.path``; the current directory is importable, as for ``python -m``."""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise CommandError(f"TARGET must look like 'module:attribute', got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise CommandError(f"cannot import {module_name!r}: {exc}") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise CommandError(f"{spec!r}: {module_name} has no attribute {attr_path!r}") from None
    return obj


def _worker_from(target: Any) -> Any:
    from .worker import Worker

    if isinstance(target, Worker):
        return target
    if callable(target) and not isinstance(target, type):
        made = target()
        if isinstance(made, Worker):
            return made
        raise CommandError(f"{target!r} returned {type(made).__name__}, not a sqla_queue.Worker")
    raise CommandError(f"{target!r} is not a sqla_queue.Worker nor a function returning one")


def _engine_and_model(args: argparse.Namespace) -> tuple[Any, Any]:
    from sqlalchemy import create_engine

    from .errors import NotAQueueModel
    from .model import queue_table
    from .worker import Worker

    target = load_target(args.target)
    if isinstance(target, type):
        url = args.url or os.environ.get("DATABASE_URL")
        if not url:
            raise CommandError("a model TARGET needs --url or DATABASE_URL")
        try:
            queue_table(target)
        except NotAQueueModel as exc:
            raise CommandError(str(exc)) from None
        return create_engine(_psycopg_url(url)), target
    worker = target if isinstance(target, Worker) else _worker_from(target)
    return worker.engine, worker.model


def _psycopg_url(url: str) -> str:
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    return url


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class DurationError(argparse.ArgumentTypeError, ValueError):
    """Not a duration; argparse and click both report the message as a usage error."""


def parse_duration(text: str | timedelta) -> timedelta:
    """``90``, ``90s``, ``15m``, ``12h``, ``7d``, ``2w``."""
    if isinstance(text, timedelta):
        return text
    match = _DURATION.match(text)
    if not match:
        raise DurationError(f"not a duration: {text!r} (try 30s, 15m, 12h, 7d)")
    return timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])


def _seconds(text: str) -> float:
    return parse_duration(text).total_seconds()


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
    }
    return {key: value for key, value in given.items() if value is not None}


def cmd_worker(args: argparse.Namespace) -> int:
    worker = _worker_from(load_target(args.target))
    overrides = worker_overrides(
        concurrency=args.concurrency,
        batch_size=args.batch_size,
        lease=args.lease,
        heartbeat=args.heartbeat,
        poll_interval=args.poll_interval,
        sweep_interval=args.sweep_interval,
        shutdown_grace=args.shutdown_grace,
        queue=args.queue,
        no_listen=args.no_listen,
    )
    worker.with_options(**overrides).run(until_idle=args.until_idle)
    return 0


@contextmanager
def _admin_target(args: argparse.Namespace) -> Iterator[tuple[Any, Any]]:
    """The command's engine and model; the engine's pooled connections closed afterwards
    (left open, only the garbage collector would close them)."""
    engine, model = _engine_and_model(args)
    try:
        yield engine, model
    finally:
        engine.dispose()


def cmd_sweep(args: argparse.Namespace) -> int:
    with _admin_target(args) as (engine, model):
        back, dead = admin.sweep(engine, model, limit=args.limit)
    print(f"swept {back + dead} expired lease(s): {back} back to pending, {dead} dead-lettered")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    with _admin_target(args) as (engine, model):
        print(admin.format_stats(engine, model))
    return 0


def cmd_requeue(args: argparse.Namespace) -> int:
    with _admin_target(args) as (engine, model):
        count = admin.requeue(engine, model, ids=args.id, queues=args.queue)
    print(f"requeued {count} dead-lettered job(s)")
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    statuses = args.status or ["done", "cancelled"]
    with _admin_target(args) as (engine, model):
        count = admin.prune(engine, model, older_than=args.older_than, statuses=statuses, limit=args.limit)
    print(f"pruned {count} finished job(s) ({', '.join(statuses)}) older than {args.older_than}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sqla-queue", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    subparsers = parser.add_subparsers(dest="command", required=True)

    worker = subparsers.add_parser("worker", help="run a worker until SIGTERM/SIGINT")
    worker.add_argument("target", help="module:attr of a Worker, or of a function returning one")
    worker.add_argument("--concurrency", type=int, help="handler threads")
    worker.add_argument("--batch-size", type=int, help="most jobs per claim")
    worker.add_argument("--lease", type=_seconds, help="lease length (e.g. 60s)")
    worker.add_argument("--heartbeat", type=_seconds, help="heartbeat interval (default lease/3)")
    worker.add_argument("--queue", action="append", help="claim from this queue (repeatable)")
    worker.add_argument("--poll-interval", type=_seconds, help="poll at least this often")
    worker.add_argument("--sweep-interval", type=_seconds, help="sweep expired leases this often (0: never)")
    worker.add_argument("--shutdown-grace", type=_seconds, help="time running jobs get to finish on SIGTERM")
    worker.add_argument("--no-listen", action="store_true", help="poll only (PgBouncer transaction pooling)")
    worker.add_argument("--until-idle", action="store_true", help="exit once no runnable job is left")
    worker.set_defaults(func=cmd_worker)

    def admin(name: str, help: str) -> argparse.ArgumentParser:
        sub = subparsers.add_parser(name, help=help)
        sub.add_argument("target", help="module:attr of a Worker (or factory), or of a queue model")
        sub.add_argument("--url", help="database URL when TARGET is a model (default: DATABASE_URL)")
        return sub

    sweep = admin("sweep", "return expired leases to pending (or failed) once")
    sweep.add_argument("--limit", type=int, default=1000, help="rows per statement")
    sweep.set_defaults(func=cmd_sweep)

    stats = admin("stats", "jobs per queue and status, and the oldest runnable job's age")
    stats.set_defaults(func=cmd_stats)

    requeue = admin("requeue", "give dead-lettered jobs a fresh set of attempts")
    requeue.add_argument("--id", type=int, action="append", help="only this job (repeatable)")
    requeue.add_argument("--queue", action="append", help="only this queue (repeatable)")
    requeue.set_defaults(func=cmd_requeue)

    prune = admin("prune", "delete finished jobs older than a cutoff")
    prune.add_argument("--older-than", type=parse_duration, required=True, help="e.g. 7d")
    prune.add_argument(
        "--status",
        action="append",
        choices=["done", "failed", "cancelled"],
        help="statuses to prune (repeatable; default done and cancelled, dead letters kept)",
    )
    prune.add_argument("--limit", type=int, default=10_000, help="rows per statement")
    prune.set_defaults(func=cmd_prune)

    _add_alembic_commands(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s",
    )
    try:
        return int(args.func(args))
    except CommandError as exc:
        print(f"sqla-queue: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
