"""The sqla_queue migration operations as typed functions: ``sq_ops.create_index_concurrently(...)``.

Operations registered on Alembic's ``Operations`` are reachable as ``op.<name>`` at run
time, but Alembic's ``op`` stubs do not know them, so a migration calling
``op.create_index_concurrently`` fails ``mypy --strict``. These functions take the same
arguments, are typed, and run the same operations on the migration being run (through
``op.invoke``). Autogenerate writes calls to them::

    from sqla_queue import alembic_ops as sq_ops

    sq_ops.create_index_concurrently("ix_email_jobs_recipient", "email_jobs", ["recipient"])

Importing this module imports :mod:`sqla_queue.alembic`, which registers the operations,
so ``op.create_index_concurrently(...)`` keeps working in hand-written migrations too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from alembic import op
from sqlalchemy.sql.elements import ColumnElement, TextClause

from .alembic import (
    CreateIndexConcurrentlyOp,
    CreateQueueIndexesOp,
    DropIndexConcurrentlyOp,
    DropQueueIndexesOp,
)
from .model import UniqueJobs

__all__ = [
    "create_index_concurrently",
    "create_queue_indexes",
    "drop_index_concurrently",
    "drop_queue_indexes",
]


def create_index_concurrently(
    index_name: str | None,
    table_name: str,
    columns: Sequence[str | TextClause | ColumnElement[Any]],
    *,
    schema: str | None = None,
    unique: bool = False,
    if_not_exists: bool | None = None,
    **kw: Any,
) -> None:
    """``op.create_index``, built with ``CREATE INDEX CONCURRENTLY`` on PostgreSQL.

    It runs outside the migration's transaction (what came before it in the migration
    is committed first); elsewhere it is the plain operation.
    """
    op.invoke(
        CreateIndexConcurrentlyOp(
            index_name,
            table_name,
            columns,
            schema=schema,
            unique=unique,
            if_not_exists=if_not_exists,
            **kw,
        )
    )


def drop_index_concurrently(
    index_name: str,
    table_name: str | None = None,
    *,
    schema: str | None = None,
    if_exists: bool | None = None,
    **kw: Any,
) -> None:
    """``op.drop_index``, with ``DROP INDEX CONCURRENTLY`` on PostgreSQL."""
    op.invoke(
        DropIndexConcurrentlyOp(
            index_name, table_name=table_name, schema=schema, if_exists=if_exists, **kw
        )
    )


def create_queue_indexes(
    table_name: str,
    *,
    schema: str | None = None,
    primary_key: str = "id",
    concurrently: bool = False,
    check: bool = False,
    unique: UniqueJobs | None = None,
) -> None:
    """The partial indexes ``JobMixin`` gives ``table_name`` (and its status CHECK)."""
    op.invoke(
        CreateQueueIndexesOp(
            table_name,
            schema=schema,
            primary_key=primary_key,
            concurrently=concurrently,
            check=check,
            unique=unique,
        )
    )


def drop_queue_indexes(
    table_name: str,
    *,
    schema: str | None = None,
    primary_key: str = "id",
    concurrently: bool = False,
    check: bool = False,
    unique: UniqueJobs | None = None,
) -> None:
    """Drop what :func:`create_queue_indexes` creates."""
    op.invoke(
        DropQueueIndexesOp(
            table_name,
            schema=schema,
            primary_key=primary_key,
            concurrently=concurrently,
            check=check,
            unique=unique,
        )
    )
