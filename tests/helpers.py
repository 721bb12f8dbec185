"""Small helpers for tests: the server under test and polls with deadlines."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import URL

from sqla_queue.embedded import EmbeddedPostgres

T = TypeVar("T")


@dataclass
class Server:
    url: URL
    admin_url: URL
    embedded: EmbeddedPostgres | None

    @property
    def conninfo(self) -> str:
        """The URL as libpq conninfo, for raw psycopg connections."""
        return self.url.set(drivername="postgresql").render_as_string(hide_password=False)


def wait_for(
    predicate: Callable[[], T], *, timeout: float = 20.0, interval: float = 0.02, what: str = ""
) -> T:
    """Poll ``predicate`` until it returns something truthy, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


def notifications(conn: Any, timeout: float) -> list[tuple[str, str]]:
    """Every notification ``conn`` receives within ``timeout`` seconds."""
    return [(n.channel, n.payload) for n in conn.notifies(timeout=timeout)]


SENTINEL_CHANNEL = "sqla_queue_test_sentinel"


def notifications_until_sentinel(listen_conn: Any, conninfo: str, timeout: float = 10.0) -> list[tuple[str, str]]:
    """Notifications delivered to ``listen_conn`` before a sentinel sent now.

    PostgreSQL delivers notifications in commit order, so whatever an earlier commit sent
    arrives before the sentinel: no fixed wait is needed to prove that nothing came.
    ``listen_conn`` must already LISTEN on :data:`SENTINEL_CHANNEL`.
    """
    import uuid

    import psycopg

    token = uuid.uuid4().hex
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("SELECT pg_notify(%s, %s)", (SENTINEL_CHANNEL, token))
    received: list[tuple[str, str]] = []
    for note in listen_conn.notifies(timeout=timeout):
        if note.channel == SENTINEL_CHANNEL and note.payload == token:
            return received
        received.append((note.channel, note.payload))
    raise AssertionError(f"sentinel not received within {timeout}s; got {received}")
