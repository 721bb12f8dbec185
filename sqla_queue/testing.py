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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, select
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm import Session

from .model import queue_table
from .tasks import Tasks
from .worker import Worker, WorkerStats
from .worker.aio import AsyncWorker

__all__ = [
    "arun_until_idle",
    "assert_enqueued",
    "assert_not_enqueued",
    "enqueued",
    "run_until_idle",
]

J = TypeVar("J")

#: Worker options that suit a test: no LISTEN connection, a short poll (the worker only
#: polls when idle, and stops as soon as nothing is due within it), no sweeper thread.
TEST_WORKER_OPTIONS: Mapping[str, Any] = {"listen": False, "poll_interval": 0.05, "sweep_interval": 0}

_ANY = object()


def enqueued(
    source: Session | Connection | Engine,
    model: type[J],
    *,
    status: str | None = "pending",
    **fields: Any,
) -> list[J]:
    """The jobs of ``model``'s table whose columns equal ``fields``, oldest first.

    ``status``: ``"pending"`` by default (enqueued, not run yet, scheduled ones
    included); another status, or None for every job. ``source`` is the session your
    code enqueued in (its unflushed jobs are flushed and seen), a connection (its
    transaction's rows are seen) or an engine (committed rows only). The jobs are
    loaded as ``model`` instances; change them through a session of your own.
    """
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
    source: Session | Connection | Engine,
    model: type[J],
    *,
    count: int | None = None,
    status: str | None = "pending",
    **fields: Any,
) -> list[J]:
    """Fail unless a job matching ``fields`` was enqueued (exactly ``count`` of them
    when given); return the matching jobs. The failure lists what the queue holds, so
    a near miss (a wrong queue, a typo in a payload) shows at once."""
    jobs = enqueued(source, model, status=status, **fields)
    if (count is None and jobs) or (count is not None and len(jobs) == count):
        return jobs
    wanted = "a job" if count is None else f"{count} job(s)"
    held = enqueued(source, model, status=status)
    raise AssertionError(
        f"expected {wanted} in {queue_table(model).table.name} with {_describe(status, fields)}, "
        f"found {len(jobs)}; the table holds {len(held)} {status or 'any-status'} job(s)"
        + "".join(f"\n  {_show(job, fields)}" for job in held[:20])
        + ("\n  ..." if len(held) > 20 else "")
    )


def assert_not_enqueued(
    source: Session | Connection | Engine,
    model: type[Any],
    *,
    status: str | None = "pending",
    **fields: Any,
) -> None:
    """Fail if any job matching ``fields`` was enqueued."""
    jobs = enqueued(source, model, status=status, **fields)
    if jobs:
        raise AssertionError(
            f"expected no job in {queue_table(model).table.name} with {_describe(status, fields)}, "
            f"found {len(jobs)}" + "".join(f"\n  {_show(job, fields)}" for job in jobs[:20])
        )


def run_until_idle(
    engine: Engine,
    model: Any,
    handler: Callable[..., Any] | Tasks,
    **options: Any,
) -> WorkerStats:
    """Run a thread :class:`~sqla_queue.Worker` until no job is runnable, none is
    running and none falls due within its poll interval; return its stats.

    Jobs must be committed to be seen. ``options`` are the worker's options, on top of
    test-friendly ones (no LISTEN connection, a 50 ms poll, no sweeper); jobs that
    fail are retried with the usual backoff, so a retry due later than the poll is
    left pending: pass ``backoff=`` to retry at once, or check ``stats.retried``.
    """
    worker = Worker(engine, model, handler, **{**TEST_WORKER_OPTIONS, **options})
    worker.run(install_signal_handlers=False, until_idle=True)
    return worker.stats


async def arun_until_idle(
    engine: AsyncEngine,
    model: Any,
    handler: Callable[..., Any] | Tasks,
    **options: Any,
) -> WorkerStats:
    """:func:`run_until_idle` on an :class:`~sqla_queue.AsyncWorker` (async handlers)."""
    worker = AsyncWorker(engine, model, handler, **{**TEST_WORKER_OPTIONS, **options})
    await worker.run(install_signal_handlers=False, until_idle=True)
    return worker.stats


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
