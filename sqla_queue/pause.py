"""Pause and resume a queue, and set its limits, in the caller's transaction.

:func:`pause` marks a queue paused in the queue table's :func:`~sqla_queue.queues_table`;
from the commit on, no claim of any worker takes a job of that queue (the claims read
the row), and the jobs already running finish as usual. :func:`resume` clears the mark
and NOTIFYs the queue's workers with the commit, as an enqueue does, so an idle worker
claims at once rather than at its next poll. :func:`set_queue_limits` gives a queue
limits of its own in place of the model's per-queue rules, from the commit on, and wakes
its workers the same way (a raised limit lets them start more). All are refused, before
anything is written, for a queue table without a declared queues table: its workers
would not read the change.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, overload

from sqlalchemy import Connection, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from .flow import required_queues_table
from .model import QueueTable, check_queue, flow_rules, notify_channel, queue_table
from .rules import check_queue_limits
from .sql import pause_queue, resume_queue
from .sql import set_queue_limits as set_queue_limits_statement
from .sql._notify import pg_notify

__all__ = ["pause", "resume", "set_queue_limits"]


@overload
def pause(bind: AsyncSession | AsyncConnection, model: Any, queue: str) -> Coroutine[Any, Any, bool]: ...
@overload
def pause(bind: Session | Connection, model: Any, queue: str) -> bool: ...
def pause(bind: Any, model: Any, queue: str) -> bool | Coroutine[Any, Any, bool]:
    """Pause ``queue`` of ``model``'s table in the transaction of ``bind`` (a ``Session``
    or a ``Connection``; an ``AsyncSession`` or ``AsyncConnection`` returns a coroutine).

    Returns whether this call paused it (False: it was paused already). Nothing changes
    until the caller commits; then no worker claims a job of that queue until it is
    resumed, whatever it was doing: a claim that started before the commit may still
    take one batch. Running jobs are left to finish, and retries and new jobs wait."""
    return _run(bind, model, queue, _pause, "pause")


@overload
def resume(bind: AsyncSession | AsyncConnection, model: Any, queue: str) -> Coroutine[Any, Any, bool]: ...
@overload
def resume(bind: Session | Connection, model: Any, queue: str) -> bool: ...
def resume(bind: Any, model: Any, queue: str) -> bool | Coroutine[Any, Any, bool]:
    """Resume ``queue`` of ``model``'s table in the transaction of ``bind``, as
    :func:`pause` pauses it. Returns whether this call resumed it (False: it was not
    paused). With the commit, the queue's workers are woken as by an enqueue."""
    return _run(bind, model, queue, _resume, "resume")


@overload
def set_queue_limits(
    bind: AsyncSession | AsyncConnection, model: Any, queue: str, *, concurrency: int | None = None,
    rate: int | None = None,
) -> Coroutine[Any, Any, bool]: ...
@overload
def set_queue_limits(
    bind: Session | Connection, model: Any, queue: str, *, concurrency: int | None = None, rate: int | None = None
) -> bool: ...
def set_queue_limits(
    bind: Any, model: Any, queue: str, *, concurrency: int | None = None, rate: int | None = None
) -> bool | Coroutine[Any, Any, bool]:
    """Set the limits of ``queue`` of ``model``'s table in the transaction of ``bind``,
    as :func:`pause` pauses it: ``concurrency`` in place of the limit of the model's
    ``Concurrency(…, key="queue")`` for this queue, ``rate`` in place of its
    ``RateLimit(…, key="queue")``'s (starts per the rule's period); None, the model's
    limit. Both are set by each call: a limit not given goes back to the model's.

    From the commit on, every claim counts against them; jobs already running finish
    (a lowered limit starts nothing new until the queue is under it). Refused with
    ``ValueError``, before anything is written, for a limit that is not an integer from
    1 to ``MAX_CONCURRENCY`` or that no declared rule has. Returns True."""
    qt = queue_table(model)
    check_queue(queue)
    required_queues_table(model)
    check_queue_limits(_owner(qt), flow_rules(qt.table), concurrency, rate)

    def change(target: Session | Connection, model: Any, queue: str) -> bool:
        target.execute(set_queue_limits_statement(model, queue, concurrency=concurrency, rate=rate))
        _wake(target, model, queue)
        return True

    return _run(bind, model, queue, change, "set_queue_limits")


def _run(
    bind: Any, model: Any, queue: str, change: Callable[[Session | Connection, Any, str], bool], what: str
) -> bool | Coroutine[Any, Any, bool]:
    qt = queue_table(model)  # NotAQueueModel before anything else
    check_queue(queue)
    required_queues_table(model)
    target = qt.mapped_class or qt.table
    if isinstance(bind, AsyncSession | AsyncConnection):
        return bind.run_sync(change, target, queue)
    if not isinstance(bind, Session | Connection):
        raise TypeError(
            f"{what}() needs a Session or a Connection (or their async kinds), got {type(bind).__qualname__}"
        )
    return change(bind, target, queue)


def _pause(bind: Session | Connection, model: Any, queue: str) -> bool:
    return bind.execute(pause_queue(model, queue)).first() is not None


def _resume(bind: Session | Connection, model: Any, queue: str) -> bool:
    resumed = bind.execute(resume_queue(model, queue)).first() is not None
    if resumed:
        _wake(bind, model, queue)
    return resumed


def _wake(bind: Session | Connection, model: Any, queue: str) -> None:
    """NOTIFY the queue's workers with the commit: the wake-up of an enqueue (the queue's
    name), delivered at commit, never on rollback."""
    conn = bind.connection() if isinstance(bind, Session) else bind
    translate = conn.get_execution_options().get("schema_translate_map")
    conn.execute(select(pg_notify(notify_channel(queue_table(model).table, translate), queue)))


def _owner(qt: QueueTable) -> str:
    """The model's name in an error (the table's, for a bare Table)."""
    return qt.mapped_class.__name__ if qt.mapped_class is not None else qt.table.name
