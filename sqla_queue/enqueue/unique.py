"""Unique jobs on the enqueue side: a job with a key is inserted, or skipped, never refused.

A key is held by at most one job in the statuses of the model's
:class:`~sqla_queue.UniqueJobs` (one partial unique index). Every keyed insert is
``INSERT … ON CONFLICT (key) WHERE … DO NOTHING`` (:func:`sqla_queue.sql.insert_unique`)
in the caller's transaction: a duplicate inserts nothing and raises nothing, so no
``IntegrityError`` can abort the caller's transaction, at the call or at its commit. A
keyed ``enqueue()`` therefore never adds an object for the flush to insert (the flush
cannot skip a row): it runs the insert itself, at the call, and attaches the job to the
session as persistent when it went in. Two transactions inserting the same key at once
end with one job: PostgreSQL makes the second insert wait for the first transaction and
skips it if that one committed (inserts it, if it rolled back).

The answer says what happened (:class:`Enqueued`): inserted, or skipped and which job
holds the key. That holder is read by a second statement, whose fresh snapshot sees the
holder a waiting insert was skipped for; should the holder leave the statuses in between
(it finished), the insert is simply tried again.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeAlias, TypeVar

from sqlalchemy import Connection
from sqlalchemy.orm import Mapper, Session, make_transient_to_detached
from sqlalchemy.orm import attributes as orm_attributes
from sqlalchemy.orm.attributes import set_committed_value

from ..errors import EnqueueError
from ..sql import insert_unique, unique_holder
from ..unique_index import check_unique_index
from .outbox import install_hooks, notify_on_commit
from .rows import TablePlan

__all__ = ["Enqueued", "EnqueuedMany", "UniqueKey", "enqueue_keyed", "holder_of"]

J = TypeVar("J")
#: What a unique key may be: a string for the mixin's ``unique_key`` column, or a value of
#: the user's own key column (:class:`~sqla_queue.UniqueJobs`).
UniqueKey: TypeAlias = "str | int | uuid.UUID"

#: Tries of a keyed insert whose holder vanished between the insert and its lookup (it
#: finished just then); each try that finds neither means a holder did finish.
MAX_TRIES: Final = 8


@dataclass(frozen=True, slots=True)
class Enqueued(Generic[J]):
    """What an enqueue with ``unique_key=`` did.

    ``inserted``: the job went in; otherwise it was skipped, because the job ``job_id``
    holds the key. ``job_id``: the new job's primary key, or the holder's. ``job``: with
    ``enqueue()``, the job object, persistent in the session, when it was inserted (None
    when skipped, and with ``enqueue_values()``). Truthy when inserted.
    """

    inserted: bool
    job_id: Any
    job: J | None = None

    @property
    def skipped(self) -> bool:
        """A job already held the key: nothing was inserted."""
        return not self.inserted

    def __bool__(self) -> bool:
        return self.inserted


class EnqueuedMany(int):
    """What ``enqueue_many()`` wrote: the number of rows inserted (it is that ``int``),
    and of rows with a key, how many were ``skipped`` as duplicates (of a job already
    there, or of an earlier row of the same call)."""

    inserted: int
    skipped: int

    def __new__(cls, inserted: int, skipped: int = 0) -> EnqueuedMany:
        self = super().__new__(cls, inserted)
        self.inserted = inserted
        self.skipped = skipped
        return self

    def __repr__(self) -> str:
        return f"EnqueuedMany(inserted={self.inserted}, skipped={self.skipped})"

    def __reduce__(self) -> tuple[type[EnqueuedMany], tuple[int, int]]:
        return type(self), (self.inserted, self.skipped)


def holder_of(conn: Connection, plan: TablePlan, key: Any) -> Any:
    """The primary key of the job holding ``key``, or None if none does (any more)."""
    return conn.execute(unique_holder(plan.table, key=key)).scalar()


def enqueue_keyed(
    sync: Session, job: J, plan: TablePlan, mapper: Mapper[Any], values: Mapping[str, Any]
) -> Enqueued[J]:
    """``enqueue()`` of a checked ``job`` with a key: inserted now, or skipped.

    ``values`` are the options' column values (the key among them) over the job's own.
    Inserted, the job is filled from the row (defaults, primary key) and attached to
    ``sync`` as persistent; its queue is woken on commit.
    """
    state = orm_attributes.instance_state(job)
    attrs, relationships = plan.instance_attrs(mapper)
    data = state.dict
    for rel in relationships:
        if data.get(rel) is not None:
            raise EnqueueError(
                f"{type(job).__qualname__} job: relationship {rel!r} is set; a job with a unique key is "
                "inserted at once, without the flush: set the foreign key column instead"
            )
    evaluates_none = plan.evaluates_none
    row = {
        key: data[attr]
        for attr, key in attrs
        if attr in data and (data[attr] is not None or key in evaluates_none)
    }
    row.update(values)
    key_value = row[plan.unique_column]  # type: ignore[index]
    table = plan.table
    statement = insert_unique(table).values(row).returning(*table.c)
    if sync.autoflush:
        sync.flush()  # the job may reference pending business rows by foreign key
    conn = sync.connection(bind_arguments=plan.bind_arguments)
    check_unique_index(conn, table)
    for _ in range(MAX_TRIES):
        inserted = conn.execute(statement).first()
        if inserted is not None:
            mapping = inserted._mapping
            for attr, key in attrs:
                set_committed_value(job, attr, mapping[table.c[key]])
            make_transient_to_detached(job)
            install_hooks(sync)
            sync.add(job)
            qt = plan.qt
            notify_on_commit(sync, qt.mapped_class or qt.table, mapping[table.c.queue])
            return Enqueued(True, mapping[plan.qt.pk], job)
        holder = holder_of(conn, plan, key_value)
        if holder is not None:
            return Enqueued(False, holder, None)
    raise EnqueueError(f"unique key {key_value!r}: its holders kept finishing; nothing was inserted")
