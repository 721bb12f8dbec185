"""Cancel jobs, pending or running, in the caller's transaction.

:func:`cancel` runs :func:`~sqla_queue.sql.cancel_jobs` where the caller's other writes
run, and NOTIFYs the workers of the running jobs it cancelled (delivered when, and only
if, that transaction commits). A cancelled attempt can no longer complete: its worker's
every statement is fenced by ``status = 'running'``, so a transactional handler's writes
roll back whatever it does, and a completion racing the cancel either commits first (the
cancel then matches nothing and does not report that job) or matches nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Coroutine, Iterable, Sequence
from typing import Any, overload

from sqlalchemy import Connection, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from .control import cancel_payloads
from .model import JobStatus, has_workflows, notify_channel, queue_table
from .sql import _queue_names, cancel_jobs, wake_values
from .sql._notify import pg_notify

__all__ = ["cancel"]


@overload
def cancel(
    bind: AsyncSession | AsyncConnection, model: Any, *, ids: Iterable[Any] | None = None,
    queues: Sequence[str] | None = None, workflow: uuid.UUID | None = None,
) -> Coroutine[Any, Any, list[Any]]: ...


@overload
def cancel(
    bind: Session | Connection, model: Any, *, ids: Iterable[Any] | None = None,
    queues: Sequence[str] | None = None, workflow: uuid.UUID | None = None,
) -> list[Any]: ...


def cancel(
    bind: Any, model: Any, *, ids: Iterable[Any] | None = None, queues: Sequence[str] | None = None,
    workflow: uuid.UUID | None = None,
) -> list[Any] | Coroutine[Any, Any, list[Any]]:
    """Cancel the pending and running jobs ``ids`` (and/or every unfinished job of
    ``queues``) of ``model``'s table, in the transaction of ``bind`` (a ``Session`` or a
    ``Connection``; an ``AsyncSession`` or ``AsyncConnection`` returns a coroutine).

    Returns the keys of the jobs it cancelled: a job already finished (done, failed,
    cancelled), or whose completion committed first, is not among them. Nothing is
    cancelled until the caller commits; a running job's worker then learns it from the
    NOTIFY sent with the commit (or its next poll, see the worker guide), tells the
    handler (an ``async def`` one is cancelled; a plain one sees
    ``sqla_queue.current_job().cancelled``), and records nothing: the row says
    ``cancelled``. ``ids`` and ``queues`` are checked before anything is written; giving
    neither is refused (cancel every unfinished job with ``queues=[...]``, by name).
    ``workflow``: the id of a :class:`~sqla_queue.Workflow`, every unfinished job of it
    (with ``ids`` or ``queues``: those of them).
    """
    qt = queue_table(model)  # NotAQueueModel before anything else
    wanted = _check_ids(ids)
    names = _queue_names(queues)
    if workflow is not None and not isinstance(workflow, uuid.UUID):
        raise TypeError(f"workflow must be a workflow's id (a uuid.UUID), got {type(workflow).__qualname__}")
    if wanted is None and names is None and workflow is None:
        raise ValueError("cancel() needs ids, queues or workflow: it never cancels every job of a table by default")
    if workflow is not None and not has_workflows(qt.table):
        raise TypeError(f"table {qt.table.name!r} keeps no workflows: mix sqla_queue.WorkflowMixin into its model")
    if isinstance(bind, AsyncSession | AsyncConnection):
        return bind.run_sync(request_cancel, qt.mapped_class or qt.table, wanted, names, workflow)
    if not isinstance(bind, Session | Connection):
        raise TypeError(
            f"cancel() needs a Session or a Connection (or their async kinds), got {type(bind).__qualname__}"
        )
    return request_cancel(bind, qt.mapped_class or qt.table, wanted, names, workflow)


def _check_ids(ids: Iterable[Any] | None) -> list[Any] | None:
    if ids is None:
        return None
    if isinstance(ids, str | bytes):
        raise TypeError("ids must be a collection of job ids, not a single string")
    wanted = list(ids)
    if any(i is None for i in wanted):
        raise ValueError("ids must not contain None")
    return wanted


def request_cancel(
    bind: Session | Connection, model: Any, ids: list[Any] | None, queues: list[str] | None,
    workflow: uuid.UUID | None = None,
) -> list[Any]:
    """The cancel's UPDATE, and the NOTIFY of the running jobs it cancelled, in ``bind``'s
    transaction (checked arguments: :func:`cancel` is the public call)."""
    if ids is not None and not ids:
        return []
    stmt = cancel_jobs(model, ids=ids, queues=queues, workflow_id=workflow)
    return tell_cancelled(bind, model, list(bind.execute(stmt, wake_values(model, bind)).all()))


def tell_cancelled(bind: Session | Connection, model: Any, rows: Sequence[Any]) -> list[Any]:
    """The cancel message to the workers of the running jobs among ``rows`` (the ``(pk,
    status before)`` a cancel statement returned), in ``bind``'s transaction; the keys
    of every row. What makes a cancel statement (:func:`~sqla_queue.sql.cancel_jobs`,
    :func:`~sqla_queue.sql.cancel_batch`) the cancel :func:`cancel` is."""
    running = [row[0] for row in rows if row[1] == JobStatus.RUNNING.value]
    if running:
        conn = bind.connection() if isinstance(bind, Session) else bind
        translate = conn.get_execution_options().get("schema_translate_map")
        channel = notify_channel(queue_table(model).table, translate)
        for payload in cancel_payloads(running):
            # Delivered at commit, with the cancel; never if the caller rolls back.
            conn.execute(select(pg_notify(channel, payload)))
    return [row[0] for row in rows]
