"""The TARGETs of the sqla-queue command line: what ``module:attribute`` names (a Worker or
AsyncWorker, a function returning one, or a queue model with a URL), the engine and
model each stands for, and a command run on one of them or on each of several.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar, cast

from sqlalchemy import URL, Engine
from sqlalchemy.exc import ArgumentError

from . import admin
from .model import queue_table
from .urls import psycopg_url

T = TypeVar("T")

__all__ = [
    "CommandError",
    "dashboard_targets",
    "database_url",
    "engine_and_model",
    "load_target",
    "on_admin_target",
    "on_each_target",
    "resolve_target",
    "worker_from",
]


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


def worker_from(target: Any) -> Any:
    """The Worker or AsyncWorker ``target`` is, or that calling it returns."""
    from .worker import Worker
    from .worker.aio import AsyncWorker

    kinds = (Worker, AsyncWorker)
    if isinstance(target, kinds):
        return target
    if callable(target) and not isinstance(target, type):
        made = target()
        if isinstance(made, kinds):
            return made
        if inspect.iscoroutine(made):
            made.close()  # never awaited: closed, so no "never awaited" warning follows the error
            raise CommandError(f"{target!r} is a coroutine function: make it a plain one returning the worker")
        raise CommandError(
            f"{target!r} returned {type(made).__name__}, not a sqla_queue.Worker or AsyncWorker"
        )
    raise CommandError(
        f"{target!r} is not a sqla_queue.Worker or AsyncWorker, nor a function returning one"
    )


def engine_and_model(args: argparse.Namespace) -> tuple[Any, Any]:
    """The engine (an ``AsyncEngine`` for an AsyncWorker target) and the queue model."""
    engine, model, worker = resolve_target(args.target, args.url)
    if worker is not None:
        args.schedules_found = tuple(worker.schedules)
        args.handler_found = worker.handler
    return engine, model


def resolve_target(spec: str, url: URL | None) -> tuple[Any, Any, Any]:
    """``(engine, model, worker)`` of a TARGET: a model (with ``url`` or DATABASE_URL;
    worker None), a Worker or AsyncWorker, or a function returning one (called once)."""
    from sqlalchemy import create_engine

    from .errors import NotAQueueModel
    from .worker import Worker
    from .worker.aio import AsyncWorker

    target = load_target(spec)
    if isinstance(target, type):
        if url is None:
            raw = os.environ.get("DATABASE_URL")
            if not raw:
                raise CommandError("a model TARGET needs --url or DATABASE_URL")
            try:
                url = database_url(raw)
            except argparse.ArgumentTypeError as exc:
                raise CommandError(f"DATABASE_URL: {exc}") from None
        try:
            queue_table(target)
        except NotAQueueModel as exc:
            raise CommandError(str(exc)) from None
        return create_engine(url), target, None
    worker = target if isinstance(target, Worker | AsyncWorker) else worker_from(target)
    return worker.engine, worker.model, worker


def database_url(text: str) -> URL:
    """A PostgreSQL URL whose driver is installed; ``postgresql://`` means psycopg 3."""
    try:
        url = psycopg_url(text)
        dialect = url.get_dialect()
    except ArgumentError as exc:  # also NoSuchModuleError: an unknown dialect or driver
        raise argparse.ArgumentTypeError(f"not a usable database URL ({exc})") from None
    if url.get_backend_name() != "postgresql":
        raise argparse.ArgumentTypeError(f"sqla_queue needs PostgreSQL, not {url.get_backend_name()!r}")
    try:
        dialect.import_dbapi()
    except ImportError:
        raise argparse.ArgumentTypeError(
            f"the driver of {url.drivername!r} is not installed (postgresql+psycopg:// uses psycopg 3)"
        ) from None
    return url


def on_admin_target(args: argparse.Namespace, command: Callable[[Engine, Any], T]) -> T:
    """``command(engine, model)`` on the target's own engine, its pooled connections closed
    afterwards (left open, only the garbage collector would close them).

    An AsyncWorker's engine is used as SQLAlchemy's asyncio extension uses it: its
    synchronous core, run in a greenlet on an event loop. So the command connects exactly
    as the worker does (URL, ``connect_args``, events), not through a look-alike engine.
    """
    from sqlalchemy.ext.asyncio import AsyncEngine
    from sqlalchemy.util import greenlet_spawn

    engine, model = engine_and_model(args)

    def checked(engine: Engine, model: Any) -> T:
        admin.check_table(engine, model)  # the worker's words for a missing or unmigrated table
        return command(engine, model)

    if not isinstance(engine, AsyncEngine):
        try:
            return checked(engine, model)
        finally:
            engine.dispose()
    async_engine = engine

    async def run() -> T:
        try:
            return cast("T", await greenlet_spawn(checked, async_engine.sync_engine, model))
        finally:
            await async_engine.dispose()

    return asyncio.run(run())


def on_each_target(args: argparse.Namespace, command: Callable[[Engine, Any], T]) -> list[tuple[str, T]]:
    """``command(engine, model)`` on each TARGET of ``args.target`` (a list), in the order
    given, each as :func:`on_admin_target` runs it on one (its table checked, its engine
    closed after), with the name of each one's table."""

    def named(engine: Engine, model: Any) -> tuple[str, T]:
        return queue_table(model).table.fullname, command(engine, model)

    return [on_admin_target(argparse.Namespace(**{**vars(args), "target": spec}), named) for spec in args.target]


def dashboard_targets(
    args: argparse.Namespace,
) -> tuple[Engine, list[Any], float | None, dict[Any, tuple[Any, ...]]]:
    """One synchronous engine (the first target's; an AsyncWorker's URL is reached with
    psycopg's synchronous side) and every target's model, with the workers' lease when
    they all have the same, and the schedules of each model a worker target runs (a
    model target's are not known)."""
    from sqlalchemy import create_engine
    from sqlalchemy.ext.asyncio import AsyncEngine

    engine: Any = None
    models: list[Any] = []
    leases: set[float] = set()
    schedules: dict[Any, tuple[Any, ...]] = {}
    for spec in args.target:
        target_engine, model, worker = resolve_target(spec, args.url)
        if worker is not None:
            leases.add(float(worker.config.lease))
            known = {s.name: s for s in schedules.get(model, ())}
            schedules[model] = tuple({**known, **{s.name: s for s in worker.schedules}}.values())
        if engine is None:
            engine = target_engine
        elif target_engine is not engine:  # not connected yet: nothing to close but the pool
            (target_engine.sync_engine if isinstance(target_engine, AsyncEngine) else target_engine).dispose()
        if model not in models:
            models.append(model)
    if isinstance(engine, AsyncEngine):
        engine = create_engine(engine.url.set(drivername="postgresql+psycopg"))
    return engine, models, (leases.pop() if len(leases) == 1 else None), schedules
