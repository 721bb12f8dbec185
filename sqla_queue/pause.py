"""Pause and resume a queue, in the caller's transaction.

:func:`pause` marks a queue paused in the queue table's :func:`~sqla_queue.queues_table`;
from the commit on, no claim of any worker takes a job of that queue (the claims read
the row), and the jobs already running finish as usual. :func:`resume` clears the mark
and NOTIFYs the queue's workers with the commit, as an enqueue does, so an idle worker
claims at once rather than at its next poll. Both are refused, before anything is
written, for a queue table without a declared queues table: its workers would not read
the pause.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, overload

from sqlalchemy import Connection, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from .flow import required_queues_table
from .model import check_queue, notify_channel, queue_table
from .sql import pause_queue, resume_queue
from .sql._notify import pg_notify

__all__ = ["pause", "resume"]


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
        conn = bind.connection() if isinstance(bind, Session) else bind
        translate = conn.get_execution_options().get("schema_translate_map")
        # The queue's name: the wake-up of an enqueue, delivered at commit, never on rollback.
        conn.execute(select(pg_notify(notify_channel(queue_table(model).table, translate), queue)))
    return resumed
