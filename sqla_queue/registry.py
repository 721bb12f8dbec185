"""The workers table: each live worker of a queue table records itself in it.

:func:`workers_table` adds ``<table>_workers`` to the model's metadata. Declaring it is
what makes the workers of that queue table record themselves: a row per worker (name,
host, pid, queues, concurrency, runtime, version, when it started), written when it
starts, updated with each heartbeat (when it was last seen, how many jobs it holds and
which), deleted when it stops. A worker that died keeps its row, whose ``last_seen``
then ages: past a lease it is shown as gone, and after :data:`FORGET_AFTER_LEASES`
leases any worker's sweeper deletes it. A queue table without it records nothing.
"""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy import JSON, Column, DateTime, Integer, String, Table, func
from sqlalchemy.dialects.postgresql import JSONB

from .model import companion_table, queue_table

__all__ = ["FORGET_AFTER_LEASES", "declared_workers_table", "workers_table"]

_INFO_KEY: Final = "sqla_queue.workers_table"
#: Leases after which a worker's row that no heartbeat updated is deleted.
FORGET_AFTER_LEASES: Final = 10
#: The most ids of running jobs a worker's row lists.
LISTED_JOBS: Final = 20


def workers_table(model: Any) -> Table:
    """The workers table of ``model``'s queue table: one row per worker alive (or lately
    dead), named ``<table>_workers``, in the queue table's schema and ``MetaData`` (so
    ``create_all`` and Alembic autogenerate see it). Call it beside the model, in the
    module every worker imports; it returns the same Table on every call."""
    table = queue_table(model).table
    return companion_table(
        table,
        "workers",
        _INFO_KEY,
        # The worker's lease owner name: host, pid and a random part.
        Column("name", String(200), primary_key=True),
        Column("host", String(255), nullable=False),
        Column("pid", Integer, nullable=False),
        # The queues it claims (a JSON list), NULL: every queue.
        Column("queues", JSON().with_variant(JSONB(), "postgresql")),
        Column("concurrency", Integer, nullable=False),
        Column("runtime", String(16), nullable=False),
        Column("version", String(32), nullable=False),
        Column("started_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
        Column("last_seen", DateTime(timezone=True), nullable=False, server_default=func.now()),
        # Jobs it holds now, and the ids of the first LISTED_JOBS of them (a JSON list).
        Column("running", Integer, nullable=False, server_default="0"),
        Column("jobs", JSON().with_variant(JSONB(), "postgresql")),
    )


def declared_workers_table(table: Table) -> Table | None:
    """The workers table :func:`workers_table` declared for the queue ``table``, if any."""
    found: Table | None = table.info.get(_INFO_KEY)
    return found
