"""NOTIFY: the one builder of the ``pg_notify(channel, payload)`` every sender sends.

Every wake-up and control message of the package is a ``pg_notify`` call. Where a
statement of SQLAlchemy's carries it (the INSERT of ``enqueue_values()`` returns one per
row, the outbox's SELECT before a commit, ``cancel()``), it is :func:`pg_notify`'s
expression; where SQL text goes straight to the psycopg cursor as one simple-protocol
query (the outbox's NOTIFY-and-COMMIT, the waker's transaction of its own, the sweeper's
wake-up), it is :func:`notify_sql`'s, the values quoted as literals by psycopg.

PostgreSQL delivers a notification when its transaction commits, never on a rollback,
and the identical notifications of one transaction once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from psycopg import sql as pgsql
from sqlalchemy import String, func, literal
from sqlalchemy.sql.elements import ColumnElement

__all__ = ["notify_sql", "pg_notify"]


def _text(value: str | ColumnElement[Any]) -> ColumnElement[Any]:
    return literal(value, String()) if isinstance(value, str) else value


def pg_notify(channel: str | ColumnElement[Any], payload: str | ColumnElement[Any]) -> ColumnElement[Any]:
    """``pg_notify(channel, payload)`` as an expression, to select or return: a text is
    bound as a value, an expression (a column, a bound parameter) goes in as it is."""
    return func.pg_notify(_text(channel), _text(payload))


def notify_sql(pairs: Iterable[tuple[str, str]]) -> pgsql.Composed:
    """``SELECT pg_notify('channel', 'payload'); …``, one statement per pair in their
    order: the same notifications as SQL text with the values quoted as literals, for a
    query without parameters on the psycopg cursor (which sends it with the simple
    protocol, several statements in one round trip)."""
    return pgsql.SQL("; ").join(
        pgsql.SQL("SELECT pg_notify({}, {})").format(pgsql.Literal(channel), pgsql.Literal(payload))
        for channel, payload in pairs
    )
