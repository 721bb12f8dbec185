"""A job's result: read in the caller's transaction, or waited for.

:func:`result` reads the result of a job of a table that keeps results
(:class:`~sqla_queue.ResultMixin`) in the caller's transaction. :func:`wait_for_result`
waits until the job has finished, on a connection of its own taken from the engine: the
statements that finish jobs of such a table NOTIFY their ids with their commit (see
:mod:`sqla_queue.sql._results`), and the waiter reads its job again when its id comes,
and at least every ``poll_interval`` seconds whatever comes (a job dead-lettered by the
sweeper sends nothing). A job that ended ``failed`` or ``cancelled`` raises
:class:`~sqla_queue.JobFailedError` or :class:`~sqla_queue.JobCancelledError`, with the
job's ``last_error``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Coroutine
from typing import Any, overload

from sqlalchemy import Connection, Engine, Row
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from .driver import notify_payloads, notify_payloads_async
from .errors import JobCancelledError, JobFailedError, NoSuchJob, ResultNotReady, ResultTimeout
from .model import JobStatus, queue_table, results_channel
from .sql import job_result, parents_of

__all__ = ["parent_counts", "parent_results", "result", "wait_for_result"]

#: How long :func:`wait_for_result` waits by default, and how often it reads the job
#: whatever it hears.
DEFAULT_TIMEOUT = 60.0
DEFAULT_POLL_INTERVAL = 1.0


@overload
def result(bind: AsyncSession | AsyncConnection, model: Any, job_id: Any) -> Coroutine[Any, Any, Any]: ...
@overload
def result(bind: Session | Connection, model: Any, job_id: Any) -> Any: ...
def result(bind: Any, model: Any, job_id: Any) -> Any:
    """The result of job ``job_id`` of ``model``'s table, read in ``bind``'s transaction
    (a ``Session`` or ``Connection``; an ``AsyncSession`` or ``AsyncConnection`` returns
    a coroutine). What the handler returned (None if it returned nothing).

    Raises :class:`~sqla_queue.ResultNotReady` while the job waits or runs,
    :class:`~sqla_queue.JobFailedError` or :class:`~sqla_queue.JobCancelledError` if it
    ended so, :class:`~sqla_queue.NoSuchJob` if there is no such job (or no longer:
    retention deletes a result with its job), and ``TypeError`` for a table that keeps
    no results."""
    stmt = job_result(model, job_id)
    name = queue_table(model).table.name
    if isinstance(bind, AsyncSession | AsyncConnection):
        return _result_async(bind, stmt, job_id, name)
    if not isinstance(bind, Session | Connection):
        raise TypeError(
            f"result() needs a Session or a Connection (or their async kinds), got {type(bind).__qualname__}"
        )
    row = bind.execute(stmt).first()
    return _settled(row, job_id, name, ready=True)[1]


async def _result_async(bind: AsyncSession | AsyncConnection, stmt: Any, job_id: Any, name: str) -> Any:
    row = (await bind.execute(stmt)).first()
    return _settled(row, job_id, name, ready=True)[1]


@overload
def parent_results(
    bind: AsyncSession | AsyncConnection, model: Any, job_id: Any
) -> Coroutine[Any, Any, dict[Any, Any]]: ...
@overload
def parent_results(bind: Session | Connection, model: Any, job_id: Any) -> dict[Any, Any]: ...
def parent_results(bind: Any, model: Any, job_id: Any) -> Any:
    """The results of the parents of job ``job_id`` (a job of a :class:`~sqla_queue.
    Workflow`) that ended ``done``, by key, read in ``bind``'s transaction: what a child's
    handler reads of the jobs it waited for. A parent that ended otherwise (under the
    ``"run"`` policy) is not among them. Needs a table that keeps results."""
    qt = queue_table(model)
    stored = job_result(model, job_id).selected_columns[1]  # TypeError on a table that keeps no results
    stmt = parents_of(model, job_id, qt.pk, qt.c.status, stored)
    return _read(bind, stmt, lambda rows: {row[0]: row[2] for row in rows if row[1] == JobStatus.DONE.value})


@overload
def parent_counts(
    bind: AsyncSession | AsyncConnection, model: Any, job_id: Any
) -> Coroutine[Any, Any, dict[str, int]]: ...
@overload
def parent_counts(bind: Session | Connection, model: Any, job_id: Any) -> dict[str, int]: ...
def parent_counts(bind: Any, model: Any, job_id: Any) -> Any:
    """How many parents of job ``job_id`` are in each status (``done``, ``failed``,
    ``cancelled``, and any other): what a batch's callback reads
    (:meth:`~sqla_queue.Workflow.batch`), read in ``bind``'s transaction. Every status
    has a key, zero when no parent has it."""
    stmt = parents_of(model, job_id)

    def count(rows: Any) -> dict[str, int]:
        counts = dict.fromkeys((status.value for status in JobStatus), 0)
        for row in rows:
            counts[row[1]] = counts.get(row[1], 0) + 1
        return counts

    return _read(bind, stmt, count)


def _read(bind: Any, stmt: Any, decode: Any) -> Any:
    if isinstance(bind, AsyncSession | AsyncConnection):
        async def run() -> Any:
            return decode((await bind.execute(stmt)).all())
        return run()
    if not isinstance(bind, Session | Connection):
        raise TypeError(f"needs a Session or a Connection (or their async kinds), got {type(bind).__qualname__}")
    return decode(bind.execute(stmt).all())


@overload
def wait_for_result(
    bind: AsyncEngine | AsyncSession | AsyncConnection, model: Any, job_id: Any, *,
    timeout: float = DEFAULT_TIMEOUT, poll_interval: float = DEFAULT_POLL_INTERVAL,
) -> Coroutine[Any, Any, Any]: ...
@overload
def wait_for_result(
    bind: Engine | Session | Connection, model: Any, job_id: Any, *,
    timeout: float = DEFAULT_TIMEOUT, poll_interval: float = DEFAULT_POLL_INTERVAL,
) -> Any: ...
def wait_for_result(
    bind: Any, model: Any, job_id: Any, *, timeout: float = DEFAULT_TIMEOUT,
    poll_interval: float = DEFAULT_POLL_INTERVAL,
) -> Any:
    """Wait until job ``job_id`` of ``model``'s table has finished and return its result,
    as :func:`result` does; :class:`~sqla_queue.ResultTimeout` (a ``TimeoutError``) after
    ``timeout`` seconds.

    ``bind`` gives the engine (an ``Engine``, or the engine of a ``Session`` or
    ``Connection``; their async kinds return a coroutine); the wait runs on a connection
    of its own, never in the caller's transaction, which would not see the job finish.
    So commit the job before waiting for it: an uncommitted job is not found
    (:class:`~sqla_queue.NoSuchJob`). It is woken by the NOTIFY of the statement that
    finished the job, delivered at its commit, and reads the job at least every
    ``poll_interval`` seconds in any case (an engine whose driver is not psycopg polls
    only)."""
    stmt = job_result(model, job_id)
    table = queue_table(model).table
    _check_times(timeout, poll_interval)
    if isinstance(bind, AsyncEngine | AsyncSession | AsyncConnection):
        return _wait_async(_async_engine(bind), stmt, job_id, table, timeout, poll_interval)
    return _wait(_engine(bind), stmt, job_id, table, timeout, poll_interval)


def _check_times(timeout: float, poll_interval: float) -> None:
    for name, value in (("timeout", timeout), ("poll_interval", poll_interval)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    if poll_interval == 0:
        raise ValueError("poll_interval must be more than 0 seconds")


def _engine(bind: Any) -> Engine:
    if isinstance(bind, Engine):
        return bind
    if isinstance(bind, Connection):
        return bind.engine
    if isinstance(bind, Session):
        found = bind.get_bind()
        return found if isinstance(found, Engine) else found.engine
    raise TypeError(
        f"wait_for_result() needs an Engine, a Session or a Connection (or their async kinds), "
        f"got {type(bind).__qualname__}"
    )


def _async_engine(bind: AsyncEngine | AsyncSession | AsyncConnection) -> AsyncEngine:
    if isinstance(bind, AsyncEngine):
        return bind
    if isinstance(bind, AsyncConnection):
        return bind.engine
    found = bind.get_bind()
    return AsyncEngine._retrieve_proxy_for_target(found if isinstance(found, Engine) else found.engine)


def _settled(row: Row[Any] | None, job_id: Any, table: str, *, ready: bool) -> tuple[bool, Any]:
    """``(True, result)`` for a done job; ``(False, status)`` for one still unfinished,
    or with ``ready`` :class:`ResultNotReady`; the errors of a job that ended otherwise."""
    if row is None:
        raise NoSuchJob(job_id, table)
    status, value, last_error = tuple(row)
    if status == JobStatus.DONE:
        return True, value
    if status == JobStatus.FAILED:
        raise JobFailedError(job_id, status, last_error)
    if status == JobStatus.CANCELLED:
        raise JobCancelledError(job_id, status, last_error)
    if ready:
        raise ResultNotReady(job_id, status)
    return False, status


def _mentions(payloads: list[str], wanted: str) -> bool:
    """Whether one of the finishing statements' payloads lists ``wanted`` (``*``: too
    many ids to list, every waiter reads its job)."""
    return any(p == "*" or wanted in p.split(",") for p in payloads)


def _listen_sql(conn: Connection | AsyncConnection, channel: str, verb: str) -> str:
    return f"{verb} {conn.dialect.identifier_preparer.quote_identifier(channel)}"


def _wait(engine: Engine, stmt: Any, job_id: Any, table: Any, timeout: float, poll: float) -> Any:
    channel = results_channel(table)
    wanted = str(job_id)
    give_up = time.monotonic() + timeout
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        conn.exec_driver_sql(_listen_sql(conn, channel, "LISTEN"))
        try:
            while True:
                done, found = _settled(conn.execute(stmt).first(), job_id, table.name, ready=False)
                if done:
                    return found
                next_read = min(time.monotonic() + poll, give_up)
                while True:  # until our id is heard, the next read or the timeout
                    left = next_read - time.monotonic()
                    if left <= 0:
                        break
                    payloads = notify_payloads(conn, left)
                    if payloads is None:
                        time.sleep(left)
                    elif _mentions(payloads, wanted):
                        break
                if time.monotonic() >= give_up:
                    done, found = _settled(conn.execute(stmt).first(), job_id, table.name, ready=False)
                    if done:
                        return found
                    raise ResultTimeout(job_id, found, timeout)
        finally:
            # The connection goes back to the engine's pool: it must not keep listening,
            # nor keep what it heard for its next user.
            if not conn.invalidated:
                conn.exec_driver_sql(_listen_sql(conn, channel, "UNLISTEN"))
                notify_payloads(conn, 0.0)


async def _wait_async(engine: AsyncEngine, stmt: Any, job_id: Any, table: Any, timeout: float, poll: float) -> Any:
    channel = results_channel(table)
    wanted = str(job_id)
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout
    async with engine.connect() as conn:
        conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
        raw = (await conn.get_raw_connection()).driver_connection
        await conn.exec_driver_sql(_listen_sql(conn, channel, "LISTEN"))
        try:
            while True:
                done, found = _settled((await conn.execute(stmt)).first(), job_id, table.name, ready=False)
                if done:
                    return found
                next_read = min(loop.time() + poll, give_up)
                while True:
                    left = next_read - loop.time()
                    if left <= 0:
                        break
                    payloads = await notify_payloads_async(raw, left)
                    if payloads is None:
                        await asyncio.sleep(left)
                    elif _mentions(payloads, wanted):
                        break
                if loop.time() >= give_up:
                    done, found = _settled((await conn.execute(stmt)).first(), job_id, table.name, ready=False)
                    if done:
                        return found
                    raise ResultTimeout(job_id, found, timeout)
        finally:
            if not conn.invalidated:
                await conn.exec_driver_sql(_listen_sql(conn, channel, "UNLISTEN"))
                await notify_payloads_async(raw, 0.0)
