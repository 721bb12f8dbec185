"""Helpers for testing code that enqueues jobs, and the handlers that run them.

They work on the real queue table in your test database (no fake queue to drift from
what production does): look at what was enqueued in a session or on a connection,
assert on it, and run a worker in the test until no job is left to run::

    from sqla_queue.testing import assert_enqueued, run_until_idle

    def test_signup_sends_a_welcome_mail(session, engine):
        signup(session, "ada@example.com")          # your code: session.enqueue(...)
        session.commit()
        assert_enqueued(session, EmailJob, recipient="ada@example.com")
        stats = run_until_idle(engine, EmailJob, send_email)
        assert stats.done == 1

The job lookups flush the session first (as any ORM query does), so jobs enqueued in a
transaction that is not committed yet are seen too, from that same session.

Async apps: :func:`aenqueued`, :func:`aassert_enqueued` and :func:`aassert_not_enqueued`
take an ``AsyncSession``, ``AsyncConnection`` or ``AsyncEngine`` (awaited, so a session's
uncommitted jobs are read on its own connection); the synchronous helpers also take an
``AsyncEngine`` (committed rows, read on a synchronous psycopg connection of their own),
which suits a test that drives the app with a synchronous client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeAlias, TypeVar

from sqlalchemy import Connection, Engine, create_engine, select
from sqlalchemy.exc import UnboundExecutionError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, async_scoped_session
from sqlalchemy.orm import Session, scoped_session

from .model import queue_table
from .tasks import TaskRegistry
from .worker import Worker, WorkerStats
from .worker.aio import AsyncWorker

__all__ = [
    "aassert_enqueued",
    "aassert_not_enqueued",
    "aenqueued",
    "arun_until_idle",
    "assert_enqueued",
    "assert_not_enqueued",
    "enqueued",
    "run_until_idle",
]

J = TypeVar("J")
R = TypeVar("R")

#: What the synchronous helpers read: a session (its own uncommitted jobs too), a
#: connection (its transaction's rows) or an engine (committed rows; an AsyncEngine too).
Source: TypeAlias = "Session | scoped_session[Any] | Connection | Engine | AsyncEngine"
#: What the awaited helpers read, with the same meaning.
AsyncSource: TypeAlias = "AsyncSession | async_scoped_session[Any] | AsyncConnection | AsyncEngine"

#: Worker options that suit a test: no LISTEN connection, a short poll (the worker only
#: polls when idle, and stops as soon as nothing is due within it), no sweeper thread.
TEST_WORKER_OPTIONS: Mapping[str, Any] = {"listen": False, "poll_interval": 0.05, "sweep_interval": 0}

_ANY = object()


def enqueued(
    source: Source,
    model: type[J],
    *,
    status: str | None = "pending",
    **fields: Any,
) -> list[J]:
    """The jobs of ``model``'s table whose columns equal ``fields``, oldest first.

    ``status``: ``"pending"`` by default (enqueued, not run yet, scheduled ones
    included); another status, or None for every job. ``source`` is the session your
    code enqueued in (its unflushed jobs are flushed and seen), a connection (its
    transaction's rows are seen) or an engine (committed rows only; an ``AsyncEngine``
    is read through a synchronous connection of its own). The jobs are loaded as
    ``model`` instances; change them through a session of your own. For an
    ``AsyncSession`` or ``AsyncConnection``, await :func:`aenqueued`.
    """
    with _readable(source, "enqueued") as readable:
        return _enqueued(readable, model, status, fields)


def _enqueued(source: Session | Connection | Engine, model: type[J], status: str | None,
              fields: Mapping[str, Any]) -> list[J]:
    qt = queue_table(model)
    columns = qt.table.c
    unknown = sorted(name for name in fields if name not in columns)
    if unknown:
        raise TypeError(f"{qt.table.name} has no column(s) {', '.join(unknown)}")
    stmt = select(model)
    if status is not None:
        stmt = stmt.where(columns.status == status)
    for name, value in fields.items():
        column = columns[name]
        stmt = stmt.where(column.is_(None) if value is None else column == value)
    stmt = stmt.order_by(columns[qt.pk.name])
    if isinstance(source, Session):
        return list(source.scalars(stmt))
    with Session(bind=source, expire_on_commit=False) as session:
        jobs = list(session.scalars(stmt))
        session.expunge_all()
        return jobs


def assert_enqueued(
    source: Source,
    model: type[J],
    *,
    count: int | None = None,
    status: str | None = "pending",
    **fields: Any,
) -> list[J]:
    """Fail unless a job matching ``fields`` was enqueued (exactly ``count`` of them
    when given); return the matching jobs. The failure lists what the queue holds, so
    a near miss (a wrong queue, a typo in a payload) shows at once."""
    with _readable(source, "assert_enqueued") as readable:
        return _assert_enqueued(readable, model, count, status, fields)


def _assert_enqueued(source: Session | Connection | Engine, model: type[J], count: int | None,
                     status: str | None, fields: Mapping[str, Any]) -> list[J]:
    jobs = _enqueued(source, model, status, fields)
    if (count is None and jobs) or (count is not None and len(jobs) == count):
        return jobs
    wanted = "a job" if count is None else f"{count} job(s)"
    held = _enqueued(source, model, status, {})
    raise AssertionError(
        f"expected {wanted} in {queue_table(model).table.name} with {_describe(status, fields)}, "
        f"found {len(jobs)}; the table holds {len(held)} {status or 'any-status'} job(s)"
        + "".join(f"\n  {_show(job, fields)}" for job in held[:20])
        + ("\n  ..." if len(held) > 20 else "")
    )


def assert_not_enqueued(
    source: Source,
    model: type[Any],
    *,
    status: str | None = "pending",
    **fields: Any,
) -> None:
    """Fail if any job matching ``fields`` was enqueued."""
    with _readable(source, "assert_not_enqueued") as readable:
        _assert_not_enqueued(readable, model, status, fields)


def _assert_not_enqueued(source: Session | Connection | Engine, model: type[Any], status: str | None,
                         fields: Mapping[str, Any]) -> None:
    jobs = _enqueued(source, model, status, fields)
    if jobs:
        raise AssertionError(
            f"expected no job in {queue_table(model).table.name} with {_describe(status, fields)}, "
            f"found {len(jobs)}" + "".join(f"\n  {_show(job, fields)}" for job in jobs[:20])
        )


def run_until_idle(
    engine: Engine,
    model: Any,
    handler: Callable[..., Any] | TaskRegistry,
    **options: Any,
) -> WorkerStats:
    """Run a thread :class:`~sqla_queue.Worker` until no job is runnable, none is
    running and none falls due within its poll interval; return its stats.

    Jobs must be committed to be seen. ``options`` are the worker's options, on top of
    test-friendly ones (no LISTEN connection, a 50 ms poll, no sweeper); jobs that
    fail are retried with the usual backoff, so a retry due later than the poll is
    left pending: pass ``backoff=`` to retry at once, or check ``stats.retried``.
    """
    if isinstance(engine, AsyncEngine) or (isinstance(engine, Engine) and engine.dialect.is_async):
        raise TypeError(
            "sqla_queue.testing.run_until_idle() runs a thread Worker, which needs a synchronous Engine, "
            "not an async one: await sqla_queue.testing.arun_until_idle(async_engine, ...) instead"
        )
    worker = Worker(engine, model, handler, **{**TEST_WORKER_OPTIONS, **options})
    worker.run(install_signal_handlers=False, until_idle=True)
    return worker.stats


async def arun_until_idle(
    engine: AsyncEngine,
    model: Any,
    handler: Callable[..., Any] | TaskRegistry,
    **options: Any,
) -> WorkerStats:
    """:func:`run_until_idle` on an :class:`~sqla_queue.AsyncWorker` (async handlers)."""
    if not isinstance(engine, AsyncEngine):
        raise TypeError(
            f"sqla_queue.testing.arun_until_idle() runs an AsyncWorker, which needs an AsyncEngine, "
            f"not {type(engine).__name__}: create_async_engine(url), or run_until_idle(engine, ...) "
            "for a thread Worker"
        )
    worker = AsyncWorker(engine, model, handler, **{**TEST_WORKER_OPTIONS, **options})
    await worker.run(install_signal_handlers=False, until_idle=True)
    return worker.stats


async def aenqueued(
    source: AsyncSource,
    model: type[J],
    *,
    status: str | None = "pending",
    **fields: Any,
) -> list[J]:
    """:func:`enqueued` for async code: an ``AsyncSession`` (its uncommitted jobs too,
    read on its own connection), an ``AsyncConnection`` (its transaction's rows) or an
    ``AsyncEngine`` (committed rows)."""
    return await _on_async(source, "aenqueued", lambda readable: _enqueued(readable, model, status, fields))


async def aassert_enqueued(
    source: AsyncSource,
    model: type[J],
    *,
    count: int | None = None,
    status: str | None = "pending",
    **fields: Any,
) -> list[J]:
    """:func:`assert_enqueued` for async code (the sources of :func:`aenqueued`)."""
    return await _on_async(
        source, "aassert_enqueued", lambda readable: _assert_enqueued(readable, model, count, status, fields)
    )


async def aassert_not_enqueued(
    source: AsyncSource,
    model: type[Any],
    *,
    status: str | None = "pending",
    **fields: Any,
) -> None:
    """:func:`assert_not_enqueued` for async code (the sources of :func:`aenqueued`)."""
    await _on_async(
        source, "aassert_not_enqueued", lambda readable: _assert_not_enqueued(readable, model, status, fields)
    )


def _is_async(bind: Any) -> bool:
    dialect = getattr(bind, "dialect", None)
    return bool(getattr(dialect, "is_async", False))


@contextmanager
def _readable(source: Any, name: str) -> Iterator[Session | Connection | Engine]:
    """What a synchronous helper can read without an event loop: ``source`` itself, or for
    an async engine (or its ``sync_engine``) a synchronous psycopg engine on its URL,
    disposed afterwards. Async sessions and connections are refused with the helper to
    await: their transaction is only reachable through their own (awaited) connection."""
    if isinstance(source, scoped_session):
        source = source()
    if isinstance(source, async_scoped_session | AsyncSession | AsyncConnection):
        raise TypeError(
            f"sqla_queue.testing.{name}() got an {type(source).__name__}, which is read with await: "
            f"use `await sqla_queue.testing.a{name}(...)` (an AsyncEngine works in {name}() too)"
        )
    if isinstance(source, Session):
        try:
            bind: Any = source.get_bind()
        except UnboundExecutionError:  # binds per mapper only: nothing to check
            bind = None
        if _is_async(bind):
            raise TypeError(
                f"sqla_queue.testing.{name}() got the sync_session of an AsyncSession: pass the "
                f"AsyncSession to `await sqla_queue.testing.a{name}(...)`"
            )
        yield source
        return
    if isinstance(source, Connection):
        if _is_async(source):
            raise TypeError(
                f"sqla_queue.testing.{name}() got the sync_connection of an AsyncConnection: pass the "
                f"AsyncConnection to `await sqla_queue.testing.a{name}(...)`"
            )
        yield source
        return
    if isinstance(source, AsyncEngine) or (isinstance(source, Engine) and _is_async(source)):
        url = source.url
        engine = create_engine(url.set(drivername="postgresql+psycopg"))
        try:
            yield engine
        finally:
            engine.dispose()
        return
    if isinstance(source, Engine):
        yield source
        return
    raise TypeError(
        f"sqla_queue.testing.{name}() reads a Session, Connection, Engine or AsyncEngine, "
        f"not {type(source).__name__}"
    )


async def _on_async(source: Any, name: str, read: Callable[[Any], R]) -> R:
    """``read(sync_session_or_connection)`` run in SQLAlchemy's greenlet on ``source``'s
    own connection (an AsyncEngine: a connection of its own, committed rows)."""
    if isinstance(source, async_scoped_session):
        source = source()
    if isinstance(source, AsyncSession | AsyncConnection):
        return await source.run_sync(read)
    if isinstance(source, AsyncEngine):
        async with source.connect() as conn:
            return await conn.run_sync(read)
    sync_name = name[1:]
    raise TypeError(
        f"sqla_queue.testing.{name}() reads an AsyncSession, AsyncConnection or AsyncEngine, "
        f"not {type(source).__name__}: call sqla_queue.testing.{sync_name}(...) without await for it"
    )


def _describe(status: str | None, fields: Mapping[str, Any]) -> str:
    shown = {**({"status": status} if status is not None else {}), **fields}
    return ", ".join(f"{name}={value!r}" for name, value in shown.items()) or "any columns"


def _show(job: Any, fields: Mapping[str, Any]) -> str:
    names: Sequence[str] = ["id", "queue", "status", *(n for n in ("task", "payload") if hasattr(job, n)), *fields]
    seen: dict[str, Any] = {}
    for name in names:
        if name not in seen:
            seen[name] = getattr(job, name, _ANY)
    return ", ".join(f"{name}={value!r}" for name, value in seen.items() if value is not _ANY)
