"""Wake-ups sent after the commit, coalesced: for queue tables with many concurrent writers.

A transaction that issued NOTIFY takes a database-wide lock at its commit and holds it
through the commit's WAL flush (PostgreSQL delivers notifications in commit order), so
concurrent enqueuing commits wait for each other: with 32 writers on one server, a third
of the commits per second of the same transactions without the NOTIFY
(``benchmarks/pressure.py``). For a model that declares ``__queue_wake__ =
"after_commit"``, the outbox sends nothing in the caller's transaction: once its COMMIT
has returned, it hands the ``(channel, queue)`` pairs to :func:`wake_after_commit`, and
one thread per process sends them in a transaction of its own, with
``synchronous_commit`` off (a notification is not durable anyway, so that commit waits
for no flush and holds the lock only for moments). Every pair that arrives while a send
is in flight goes out in the next one: at most one wake-up transaction of this process
at a time, whatever the number of writers.

What it gives up: a process that dies between its commit and the send, or a send that
fails (the server is away), wakes nobody, and the jobs wait for the workers' poll
(``poll_interval``). The default (``"with_commit"``) keeps "no job waits for the poll".
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterable
from contextlib import suppress
from typing import Any, Final

import psycopg
from psycopg import sql as pgsql

from ..cache import plans
from ..ratelimit import PerMinute
from ..sql._notify import notify_sql

__all__ = ["flush", "wake_after_commit"]

log = logging.getLogger("sqla_queue.waker")

#: Seconds between attempts to reach a server whose last send failed, and most failures
#: logged per minute (the rest are counted only: :func:`failures`).
RETRY_SECONDS = 1.0
_FAILURE_LOGS_PER_MINUTE = 5
#: Seconds between two sends of a process's waker, at least: a wake-up after a quiet
#: spell goes at once, one in a busy spell waits this much at most and shares the send
#: (each is a transaction the server pays for: 100 a second per process at most).
MIN_INTERVAL = 0.01
#: How long the interpreter's exit waits for the wake-ups not yet sent.
EXIT_FLUSH_SECONDS = 1.0


#: Each connection's :func:`_server_key`, worked out once (libpq builds it anew per call).
_keys: weakref.WeakKeyDictionary[Any, tuple[str, str | None]] = weakref.WeakKeyDictionary()


def _server_key(raw: Any) -> tuple[str, str | None]:
    """How to connect to the server ``raw`` (a psycopg connection, sync or async) is
    connected to: its effective connection string and password."""
    key = _keys.get(raw)
    if key is None:
        info = raw.info
        key = _keys[raw] = (info.dsn, info.password)
    return key


class _Waker:
    """The process's sender: pending pairs per server, one thread, one connection per server."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._pending: dict[tuple[str, str | None], set[tuple[str, str]]] = {}
        #: A send in flight (its pairs taken from ``_pending``): :meth:`flush` waits for it.
        self._sending = False
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._connections: dict[tuple[str, str | None], psycopg.Connection[Any]] = {}
        self._down_until: dict[tuple[str, str | None], float] = {}
        self._failures = 0
        self._last_send = 0.0
        self._failure_logs = PerMinute(_FAILURE_LOGS_PER_MINUTE)
        self._stopping = False

    def wake(self, raw: Any, pairs: Iterable[tuple[str, str]]) -> None:
        key = _server_key(raw)
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's thread is not here
                self._reset()
            self._pending.setdefault(key, set()).update(pairs)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sqla_queue-waker", daemon=True)
                self._thread.start()
            self._lock.notify()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._thread = None
        self._sending = False
        self._pending.clear()
        self._connections = {}  # the parent's: never used, nor closed, here
        self._down_until.clear()

    def flush(self, timeout: float) -> bool:
        """Wait until every pair handed over so far was sent (or given up): True if so."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending or self._sending:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None:
                    return False
                self._lock.wait(left)
        return True

    def failures(self) -> int:
        return self._failures

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._pending:
                    if self._stopping:
                        return
                    self._lock.wait()
                self._sending = True
            # At most one send per MIN_INTERVAL: the first after a quiet spell at once,
            # the next ones gathering whatever comes meanwhile.
            wait = self._last_send + MIN_INTERVAL - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            with self._lock:
                batch, self._pending = self._pending, {}
            self._last_send = time.monotonic()
            try:
                for key, pairs in batch.items():
                    self._send(key, pairs)
            finally:
                with self._lock:
                    self._sending = False
                    self._lock.notify_all()

    def _send(self, key: tuple[str, str | None], pairs: set[tuple[str, str]]) -> None:
        if time.monotonic() < self._down_until.get(key, 0.0):
            self._failed(key, len(pairs), None)  # not retried at once: the poll covers it
            return
        conn = self._connections.get(key)
        try:
            if conn is None or conn.closed:
                dsn, password = key
                conn = self._connections[key] = psycopg.connect(
                    dsn, password=password, autocommit=True, connect_timeout=5
                )
            conn.execute(_statement(pairs))
            self._down_until.pop(key, None)
        except Exception as exc:  # noqa: BLE001 - a lost wake-up is the poll's to cover
            self._connections.pop(key, None)
            if conn is not None:
                with suppress(Exception):  # closing a broken connection
                    conn.close()
            self._down_until[key] = time.monotonic() + RETRY_SECONDS
            self._failed(key, len(pairs), exc)

    def _failed(self, key: tuple[str, str | None], n: int, exc: Exception | None) -> None:
        self._failures += n
        if exc is not None and self._failure_logs.allow():
            log.warning("wake-up after commit not sent (%d queue(s)); workers find the jobs at their "
                        "next poll: %s: %s", n, type(exc).__name__, exc)

    def stop(self, timeout: float) -> None:
        """At exit: send what is pending, within ``timeout``."""
        if self._pid == os.getpid() and self._thread is not None:
            self.flush(timeout)
            with self._lock:
                self._stopping = True
                self._lock.notify_all()


def _statement(pairs: set[tuple[str, str]]) -> bytes:
    """One simple-protocol query: a transaction of its own whose commit waits for no WAL
    flush, with one ``pg_notify`` per pair (built once per set of pairs)."""
    key = (_STATEMENT, frozenset(pairs))
    query: bytes | None = plans.get(key)
    if query is None:
        notifies = notify_sql(sorted(pairs))
        query = plans.put(
            key, pgsql.SQL("BEGIN; SET LOCAL synchronous_commit = off; {}; COMMIT").format(notifies).as_bytes(None)
        )
    return query


#: Key of the waker's statements in the shared cache.
_STATEMENT: Final = "sqla_queue.waker.statement"


_waker = _Waker()
atexit.register(_waker.stop, EXIT_FLUSH_SECONDS)


def wake_after_commit(raw: Any, pairs: Iterable[tuple[str, str]]) -> None:
    """Send ``pg_notify(channel, queue)`` for ``pairs`` soon, from the process's waker
    thread, to the server the psycopg connection ``raw`` (sync or async) is on. Call it
    after a commit returned; it does no I/O itself."""
    _waker.wake(raw, pairs)


def flush(timeout: float = 5.0) -> bool:
    """Wait until the wake-ups handed over so far in this process were sent: True if
    they were within ``timeout`` seconds (tests, and code about to exit, use it)."""
    return _waker.flush(timeout)


def failures() -> int:
    """Wake-ups (queue pairs) this process could not send after commit, ever."""
    return _waker.failures()
