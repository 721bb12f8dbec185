"""Flow control declared beside a queue table: the queues table, where a queue is paused
and its limits are set at run time.

:func:`queues_table` adds ``<table>_queues`` to the model's metadata, one row per queue
that was ever paused or given limits of its own (``paused_at`` set while it is paused;
``concurrency`` and ``rate`` while they are set). Declaring it is what makes every claim
of that queue table honour them: the claim statements read it (see
:func:`~sqla_queue.sql.unpaused`), so a change holds from the commit of the transaction
that made it, on every worker, with no message to be lost. A queue table without it
claims as before, at no cost.
"""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy import Column, DateTime, Integer, Table, func

from .errors import QueuesTableNotDeclared
from .model import companion_table, queue_table

__all__ = ["queues_table"]

_INFO_KEY: Final = "sqla_queue.queues_table"


def queues_table(model: Any) -> Table:
    """The control table of ``model``'s queue table: one row per queue paused or given
    limits at least once, ``paused_at`` set while it is paused, ``concurrency`` and
    ``rate`` while the queue has limits of its own (:func:`~sqla_queue.set_queue_limits`).
    Named ``<table>_queues``, in the queue table's schema and ``MetaData`` (so
    ``create_all`` and Alembic autogenerate see it).

    Call it beside the model (``queues_table(EmailJob)``), in the module every worker
    imports: from then on the claims of this queue table skip paused queues, and
    :func:`~sqla_queue.pause` can pause them. It returns the same Table on every call,
    and follows the queue table into whatever schema a ``schema_translate_map`` puts it.
    """
    table = queue_table(model).table
    return companion_table(
        table,
        "queues",
        _INFO_KEY,
        Column("queue", table.c.queue.type, primary_key=True),
        # Set while the queue is paused: no claim takes its jobs.
        Column("paused_at", DateTime(timezone=True)),
        # The queue's own limits, set at run time (sqla_queue.set_queue_limits), in place
        # of the model's Concurrency / RateLimit with key="queue"; NULL: the model's.
        Column("concurrency", Integer),
        Column("rate", Integer),
        Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    )


def declared_queues_table(table: Table) -> Table | None:
    """The queues table :func:`queues_table` declared for the queue ``table``, if any."""
    found: Table | None = table.info.get(_INFO_KEY)
    return found



def required_queues_table(model: Any) -> Table:
    """The declared queues table of ``model``'s queue table, or
    :class:`~sqla_queue.errors.QueuesTableNotDeclared`: a pause is refused rather than
    written where workers that never declared the table would not read it."""
    qt = queue_table(model)
    found = declared_queues_table(qt.table)
    if found is None:
        raise QueuesTableNotDeclared(
            f"{qt.table.name!r} has no queues table: call sqla_queue.queues_table({_model_name(model)}) beside "
            f"the model, in the module every worker imports, then create or migrate it (Alembic autogenerate adds it)"
        )
    return found


def _model_name(model: Any) -> str:
    return getattr(model, "__name__", None) or "Model"
