"""Queue tables for SQLModel: the columns, CHECK and partial indexes of ``JobMixin``.

SQLModel builds its tables from Pydantic fields and rejects a SQLAlchemy ``Mapped[...]``
mixin, so a SQLModel model cannot use :class:`~sqla_queue.JobMixin`. :class:`JobModel`
and :class:`TaskModel` are SQLModel field bases instead::

    class EmailJob(JobModel, table=True):
        __tablename__ = "email_jobs"
        order_id: int = Field(foreign_key="orders.id")

Nothing about a column is written twice: each field is made from the column
``JobMixin`` gives a reference table (type, nullability, Python and server defaults,
identity), and the status CHECK and partial indexes are attached by the same
propagating mapper event as the mixin's, so they survive a ``__table_args__`` of the
user's. The field annotations are spelled out so type checkers know them; a column that
only the database fills in (``id``, ``run_after``, ``created_at``) is ``T | None``
defaulting to None, as SQLModel models write their keys, and the ORM leaves a None out
of the INSERT, so the server default applies.

A column added to ``JobMixin`` gets its field here in one line,
``name: T = mixin_field("name")`` (the tests fail until it has one); an optional mixin's
columns get a field base of their own the same way, ``mixin_field("name", ThatMixin)``,
as :class:`IdempotencyKeyModel` for :class:`~sqla_queue.IdempotencyKeyMixin`.

Sessions: :class:`QueueSession` and :class:`AsyncQueueSession` are SQLModel's sessions
(with ``exec()``) that also have ``enqueue()`` and ``enqueue_many()``.

Importing this module needs SQLModel (``pip install 'sqla-queue[sqlmodel]'``);
importing :mod:`sqla_queue` does not.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, Final, overload

from sqlalchemy import Column, Integer, MetaData, Table, event
from sqlalchemy.orm import mapped_column, registry
from sqlalchemy.schema import SchemaItem

try:
    from sqlmodel import Field, SQLModel
    from sqlmodel import Session as _SQLModelSession
    from sqlmodel.ext.asyncio.session import AsyncSession as _SQLModelAsyncSession
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "sqla_queue.sqlmodel needs SQLModel: pip install 'sqla-queue[sqlmodel]'"
    ) from exc

from .enqueue import session as _session
from .model import IdempotencyKeyMixin, JobMixin, TaskMixin, _on_instrument

__all__ = ["AsyncQueueSession", "IdempotencyKeyModel", "JobModel", "QueueSession", "TaskModel", "mixin_field"]


class _FreshItems(Sequence[Any]):
    """``sa_column_args`` whose schema items are copied on every read.

    SQLModel reads a field's ``sa_column_args`` once per table class, and a schema item
    such as ``Identity()`` belongs to one column: a shared one would end up claiming
    the last table's column as its own.
    """

    def __init__(self, items: Iterable[SchemaItem]) -> None:
        self._items = tuple(items)

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, index: int) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Any]: ...
    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [item._copy() for item in self._items[index]]  # type: ignore[attr-defined]
        return self._items[index]._copy()  # type: ignore[attr-defined]


def _reference_table(mixin: type[Any]) -> Table:
    """``mixin``'s columns as declarative resolves them (nullability comes from the
    ``Mapped`` annotations), on a private registry no application sees."""
    reference = registry(metadata=MetaData())
    namespace = {
        "__tablename__": f"sqla_queue_{mixin.__name__.lower()}",
        # A mapping needs a primary key, which a mixin of extra columns lacks.
        "sqla_queue_reference_key": mapped_column(Integer, primary_key=True),
    }
    mapped: Any = reference.mapped(type(f"_{mixin.__name__}Reference", (mixin,), namespace))
    table: Table = mapped.__table__
    return table


_REFERENCES: Final[dict[type[Any], Table]] = {}


def mixin_field(name: str, mixin: type[Any] = JobMixin, **field_options: Any) -> Any:
    """A SQLModel ``Field`` for the column ``name`` of a declarative ``mixin``.

    The column's type, nullability, primary key, uniqueness, index, comment, Python
    default, server default and identity are the mixin's. A column without a Python
    default defaults to None on the Pydantic side when the database fills it in (or it
    is nullable); a NOT NULL column that nothing fills in is a required field.
    A callable default taking no argument becomes the field's ``default_factory``.
    ``field_options`` go to ``Field`` (a ``description``...).
    """
    table = _REFERENCES.get(mixin)
    if table is None:
        table = _REFERENCES[mixin] = _reference_table(mixin)
    column: Column[Any] = table.c[name]
    kwargs: dict[str, Any] = {}
    if column.server_default is not None and column.identity is None:
        kwargs["server_default"] = getattr(column.server_default, "arg", column.server_default)
    args: list[SchemaItem] = []
    if column.identity is not None:
        args.append(column.identity)
    if column.comment is not None:
        kwargs["comment"] = column.comment
    options: dict[str, Any] = {
        "sa_type": column.type,
        "primary_key": column.primary_key,
        "nullable": column.nullable,
        "unique": bool(column.unique),
        "index": bool(column.index),
        "sa_column_kwargs": kwargs,
    }
    if args:
        options["sa_column_args"] = _FreshItems(args)
    default = column.default
    if "default_factory" not in field_options:
        if default is None:
            if column.nullable or column.server_default is not None or column.identity is not None:
                options["default"] = None  # else required: the caller must give it
        elif default.is_scalar:
            options["default"] = getattr(default, "arg", None)
        else:
            # SQLAlchemy wraps a callable taking no argument, keeping it as __wrapped__;
            # one taking the execution context has no Pydantic equivalent.
            factory = getattr(getattr(default, "arg", None), "__wrapped__", None)
            if factory is None:
                raise TypeError(f"{mixin.__name__}.{name}: pass default_factory= for its callable default")
            options["default_factory"] = factory
    return Field(**options, **field_options)


class JobModel(SQLModel):
    """Queue columns for a SQLModel table model the user owns.

    ::

        class EmailJob(JobModel, table=True):
            __tablename__ = "email_jobs"
            recipient: str = Field(max_length=200)

    The same columns, status CHECK and partial indexes as a :class:`~sqla_queue.JobMixin`
    model, with the same names: ``enqueue()``, ``enqueue_values()``,
    ``enqueue_many()``, both workers and Alembic autogenerate treat it alike.
    """

    id: int | None = mixin_field("id")
    queue: str = mixin_field("queue")
    status: str = mixin_field("status")
    #: Higher runs first.
    priority: int = mixin_field("priority")
    #: Not claimed before this time (delays, scheduled jobs, retry backoff).
    run_after: datetime | None = mixin_field("run_after")
    #: Attempts started so far; the claim increments it, so it is also the fencing token.
    attempts: int = mixin_field("attempts")
    max_attempts: int = mixin_field("max_attempts")
    lease_owner: str | None = mixin_field("lease_owner")
    lease_expires_at: datetime | None = mixin_field("lease_expires_at")
    last_error: str | None = mixin_field("last_error")
    #: Set by the sweeper when an attempt ended with its lease expiring; such jobs run alone.
    isolated: bool = mixin_field("isolated")
    created_at: datetime | None = mixin_field("created_at")
    finished_at: datetime | None = mixin_field("finished_at")
    trace_context: dict[str, str] | None = mixin_field("trace_context")
    #: At most one job per key (``enqueue(..., unique_key=...)``); None: no key.
    unique_key: str | None = mixin_field("unique_key")
    timeout: float | None = mixin_field("timeout")
    started_at: datetime | None = mixin_field("started_at")
    deadline_at: datetime | None = mixin_field("deadline_at")


class TaskModel(JobModel):
    """A generic task table on SQLModel: a registered task name and a JSON payload
    (JSONB on PostgreSQL), as :class:`~sqla_queue.TaskMixin`."""

    task: str = mixin_field("task", TaskMixin)
    payload: dict[str, Any] = mixin_field("payload", TaskMixin)


class IdempotencyKeyModel(SQLModel):
    """The ``idempotency_key`` of :class:`~sqla_queue.IdempotencyKeyMixin` for SQLModel:
    a random UUID per job, for the external systems a handler calls. Opt-in, beside
    :class:`JobModel` or :class:`TaskModel`::

        class EmailJob(JobModel, IdempotencyKeyModel, table=True):
            __tablename__ = "email_jobs"

    A new instance holds its key from construction (the field's ``default_factory``);
    ``enqueue_many`` and ``enqueue_values`` give each row one too, and the server
    (``gen_random_uuid()``) a row another program inserts.
    """

    idempotency_key: uuid.UUID = mixin_field("idempotency_key", IdempotencyKeyMixin)


# The CHECK and partial indexes, from the listener JobMixin's tables get them from.
event.listen(JobModel, "instrument_class", _on_instrument, propagate=True)


class QueueSession(_session.QueueSession, _SQLModelSession):
    """SQLModel's ``Session`` (``exec()``) with ``enqueue()`` and ``enqueue_many()``;
    use ``QueueSession(engine)`` or ``sessionmaker(engine, class_=QueueSession)``."""


class AsyncQueueSession(_session.AsyncQueueSession, _SQLModelAsyncSession):
    """SQLModel's ``AsyncSession`` (``exec()``) with ``enqueue()`` and ``enqueue_many()``.

    Its synchronous session is a :class:`QueueSession`, whose commit hooks send the
    NOTIFY.
    """

    sync_session_class = QueueSession
    sync_session: QueueSession
