"""LISTEN for committed jobs and wake the claim loop.

The listener holds one dedicated autocommit connection (a connection idle in a
transaction receives nothing). NOTIFY is not durable: notifications sent while the
connection is down are lost, so after every reconnect the listener wakes the claim loop
once, and the claim loop polls on its own timer regardless.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any

from psycopg import sql as pgsql
from sqlalchemy import Connection, Engine

from ._loops import BackgroundLoop

__all__ = ["Listener", "close_dedicated", "dedicated_connection"]

log = logging.getLogger("sqla_queue.worker")


def dedicated_connection(engine: Engine, *, autocommit: bool = False) -> Connection:
    """A connection made by ``engine`` (its URL, ``connect_args`` and events) but kept
    out of its pool, so a busy pool can never starve a heartbeat or the listener."""
    conn = engine.connect()
    if autocommit:
        conn.execution_options(isolation_level="AUTOCOMMIT")
    conn.detach()
    return conn


def close_dedicated(conn: Connection) -> None:
    """Close a :func:`dedicated_connection` and its DBAPI connection, now.

    On a detached connection ``invalidate()`` only forgets the DBAPI connection, which
    would then stay open until the garbage collector finds it; so close that one too.
    """
    alive = not (conn.closed or conn.invalidated)
    dbapi = conn.connection.dbapi_connection if alive else None
    try:
        conn.invalidate()
        conn.close()
    except Exception:  # noqa: BLE001 - the connection may already be broken
        pass
    if dbapi is not None:
        dbapi.close()


class Listener(BackgroundLoop):
    """Wake ``on_wake`` when a job is committed to ``channel`` for one of ``queues``."""

    name = "listener"

    def __init__(
        self,
        engine: Engine,
        channel: str,
        on_wake: Callable[[], None],
        *,
        queues: Collection[str] | None = None,
        timeout: float = 0.25,
    ) -> None:
        super().__init__(interval=0.0)
        self._engine = engine
        self._channel = channel
        self._on_wake = on_wake
        self._queues = set(queues) if queues is not None else None
        self._timeout = timeout
        self._conn: Connection | None = None
        self.connected_count = 0  # connections made so far; > 1 means it reconnected

    def _driver(self) -> Any:
        if self._conn is None:
            conn = dedicated_connection(self._engine, autocommit=True)
            driver: Any = conn.connection.dbapi_connection
            try:
                driver.execute(pgsql.SQL("LISTEN {}").format(pgsql.Identifier(self._channel)))
            except BaseException:
                close_dedicated(conn)
                raise
            self._conn = conn
            self.connected_count += 1
            if self.connected_count > 1:
                log.info("listener: reconnected; polling once for jobs sent meanwhile")
            # Jobs committed while we were not listening sent their NOTIFY into the void.
            self._on_wake()
        return self._conn.connection.dbapi_connection

    def tick(self) -> float:
        driver = self._driver()
        relevant = False
        for note in driver.notifies(timeout=self._timeout, stop_after=1):
            if self._queues is None or note.payload in self._queues:
                relevant = True
        if relevant:
            self._on_wake()
        return 0.0

    def on_error(self, exc: BaseException) -> None:
        self._drop()

    def close(self) -> None:
        self._drop()

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            close_dedicated(conn)
