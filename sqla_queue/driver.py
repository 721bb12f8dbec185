"""What the worker runtime needs from PostgreSQL and psycopg 3, and nothing else does.

The services of :mod:`sqla_queue.worker` talk to a :class:`Driver`: it makes dedicated
connections (kept out of the engine's pool, with keepalives and server-side timeouts),
compiles statements once (for :mod:`sqla_queue.ops`, which picks them) and runs them on
the psycopg connection, reads claimed rows so that one unreadable row cannot spoil its batch, LISTENs,
cuts a hung call short, and tells connection errors from the rest. An asyncio driver
offers the same operations as coroutines.
"""

from __future__ import annotations

import logging
import math
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, NamedTuple, final

import psycopg
from psycopg import sql as pgsql
from psycopg.pq.abc import PGcancelConn
from psycopg.types.string import TextLoader
from sqlalchemy import Connection, Engine, Table
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session
from sqlalchemy.sql import ClauseElement
from sqlalchemy.util.concurrency import await_only

from .activity import declared_activity_table
from .dbapi import CompileOnceError, SchemaMapKey, Statement, compile_statement, reraise_as_sqlalchemy, schema_map_key
from .errors import SqlaQueueError
from .flow import declared_queues_table
from .model import REQUIRED_COLUMNS, constraint_name, notify_channel, table_problem, translated_schema, unique_jobs
from .registry import declared_workers_table
from .runtime import AsyncRuntime, Runtime, ThreadRuntime
from .sql._notify import notify_sql
from .unique_index import INDEX_SQL, unique_index_problem

__all__ = [
    "AsyncDbConnection", "AsyncDriver", "CompileOnceError", "DbConnection", "Driver", "RowError",
    "SchemaMapKey", "Statement", "WorkerStartError", "compile_statement", "reraise_as_sqlalchemy", "schema_map_key",
]

log = logging.getLogger("sqla_queue.worker")

#: Seconds between two ``DISCARD PLANS`` on a runtime connection. psycopg prepares a
#: statement run five times, and PostgreSQL then keeps the statement's generic plan for
#: as long as nothing invalidates it (an ANALYZE of the table does; without autovacuum
#: nothing may): a plan made while the queue table was nearly empty (a sequential scan)
#: would stay while the table grows, and every claim would read all of it. Discarding
#: the plans makes the next execution plan for the table as it is now.
REPLAN_INTERVAL = 10.0
_DISCARD_PLANS = b"DISCARD PLANS"
#: Longest wait of a claim for the turn of a table with flow rules (``lock_timeout``;
#: less when the statement deadline is shorter): past it the claim fails as any claim
#: does, and the executor tries again later.
FLOW_LOCK_TIMEOUT = 5.0
#: Longest time a claim's transaction of a table with flow rules may sit idle between
#: its statements (``idle_in_transaction_session_timeout``): a worker stopped in it
#: (SIGSTOP, a paused VM) has it ended by the server, which releases the turn.
FLOW_IDLE_TIMEOUT = 3.0
_COMMIT = b"COMMIT"
_ROLLBACK = b"ROLLBACK"


class Turn(NamedTuple):
    """How a claim of a table with flow rules takes its turn: the advisory lock, and the
    transaction's bounds (milliseconds)."""

    lock: int
    lock_timeout_ms: int
    idle_timeout_ms: int


def take_turn(lock: int, deadline: float) -> Turn:
    """The turn of a claim on advisory lock ``lock``: it waits at most
    :data:`FLOW_LOCK_TIMEOUT` or half the statement ``deadline``, and its transaction may
    sit idle :data:`FLOW_IDLE_TIMEOUT`; for :meth:`DbConnection.fetch_claimed`."""
    return Turn(lock, max(1, int(min(FLOW_LOCK_TIMEOUT, deadline / 2) * 1000)), int(FLOW_IDLE_TIMEOUT * 1000))


#: The turn's one statement after BEGIN: its bounds (this transaction only), then the lock.
_TURN = (
    "SELECT set_config('lock_timeout', %s, true), "
    "set_config('idle_in_transaction_session_timeout', %s, true), pg_advisory_xact_lock(%s)"
)
_BEGIN = b"BEGIN"


def _turn_params(turn: Turn) -> tuple[str, str, int]:
    return f"{turn.lock_timeout_ms}ms", f"{turn.idle_timeout_ms}ms", turn.lock



class WorkerStartError(SqlaQueueError, RuntimeError):
    """The worker cannot start: no connection, not PostgreSQL, or no usable queue table."""


@final
@dataclass(frozen=True)
class RowError:
    """A claimed row psycopg could not read: its key and attempt, and why. Final: the
    claim's paths tell it from a row by ``type(row) is RowError``, no call a row."""

    pk: Any
    attempt: int
    error: BaseException


class DbConnection:
    """A dedicated connection: the SQLAlchemy ``Connection`` (for sessions) and its
    psycopg connection (for the runtime's own statements), autocommit between uses."""

    raw: psycopg.Connection[Any]

    def __init__(self, sa: Connection, purpose: str) -> None:
        raw: Any = sa.connection.dbapi_connection
        raw.autocommit = True
        self._init_state(sa, purpose, raw)

    def _init_state(self, sa: Connection, purpose: str, raw: Any) -> None:
        """What every dedicated connection keeps, whatever its flavour of psycopg."""
        self.sa = sa
        self.purpose = purpose
        self.raw = raw
        self._cursor = _runtime_cursor(raw)
        self.closed = False
        #: Cut by Driver.abort (a deadline, a stop): never to be used again.
        self.aborted = False
        self._replan_at = time.monotonic() + REPLAN_INTERVAL

    def _replan_due(self) -> bool:
        """Whether the connection's cached plans are due to be discarded (see
        :data:`REPLAN_INTERVAL`); when they are, the next one is scheduled."""
        now = time.monotonic()
        if now < self._replan_at:
            return False
        self._replan_at = now + REPLAN_INTERVAL
        return True

    @property
    def broken(self) -> bool:
        """Closed, known broken by psycopg, or cut by :meth:`Driver.abort`: a call whose
        answer was read before the cut still returns, but the connection is done for."""
        return self.closed or self.aborted or self.raw.closed or self.raw.broken

    def set_autocommit(self, on: bool) -> None:
        self.raw.autocommit = on

    def query(self, sql: Any, params: Any = None) -> list[tuple[Any, ...]]:
        """Run SQL text of the driver's own (LISTEN, catalog lookups) and return its rows."""
        cur = self.raw.execute(sql, params)
        return cur.fetchall() if cur.description else []

    def notifies(self, timeout: float) -> list[str]:
        """Payloads of the notifications that arrive within ``timeout`` seconds."""
        return [n.payload for n in self.raw.notifies(timeout=timeout, stop_after=1)]

    def describe(self, sql: Any) -> dict[str, int]:
        """The type code of each column of ``sql``'s result, by name."""
        cur = self.raw.execute(sql)
        return {d.name: d.type_code for d in cur.description or []}

    def execute(self, stmt: Statement, values: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        """Run ``stmt`` (autocommit: one round trip) and return its rows."""
        cur = self._cursor
        if self._replan_due():
            cur.execute(_DISCARD_PLANS)
        cur.execute(stmt.sql, stmt.params(values))
        return cur.fetchall() if cur.pgresult is not None and cur.description else []

    def fetch_claimed(
        self, stmt: Statement, values: Mapping[str, Any], pk_index: int, attempt_index: int, turn: Turn | None = None
    ) -> list[tuple[Any, ...] | RowError]:
        """Run a claim; a row psycopg cannot read comes back as a :class:`RowError`, with
        the values of its columns ``pk_index`` and ``attempt_index`` (the caller's to know).

        ``turn`` (:func:`take_turn`): the claim takes turns (a table with flow rules), in
        a transaction that first waits for an advisory lock, so the claim's snapshot,
        taken after it, sees every earlier claim committed; committed before the rows
        are returned."""
        cur = self._cursor
        if self._replan_due():
            cur.execute(_DISCARD_PLANS)
        if turn is None:
            cur.execute(stmt.sql, stmt.params(values))
            return self._claimed_rows(cur, pk_index, attempt_index)
        raw = self.raw
        try:
            # One pipeline: the server runs the four back to back, so the lock is held
            # for their execution only, never while this process waits for its GIL.
            with raw.pipeline():
                raw.execute(_BEGIN)
                raw.execute(_TURN, _turn_params(turn))
                cur.execute(stmt.sql, stmt.params(values))
                raw.execute(_COMMIT)
        except BaseException:
            self._roll_back()
            raise
        return self._claimed_rows(cur, pk_index, attempt_index)

    def _roll_back(self) -> None:
        """End a failed transaction of the driver's own; a broken connection is left as
        it is (its transaction ends with it)."""
        if self.broken:
            return
        try:
            self.raw.execute(_ROLLBACK)
        except Exception:  # the connection is then broken, and discarded
            log.debug("%s: rollback failed", self.purpose, exc_info=True)

    def _claimed_rows(
        self, cur: psycopg.Cursor[Any], pk_index: int, attempt_index: int
    ) -> list[tuple[Any, ...] | RowError]:
        try:
            return list(cur.fetchall())
        except Exception:  # noqa: BLE001 - find the unreadable rows one by one
            pass
        rows: list[tuple[Any, ...] | RowError] = []
        result = cur.pgresult
        assert result is not None
        for n in range(result.ntuples):
            cur.scroll(n, mode="absolute")
            try:
                row = cur.fetchone()
                assert row is not None
                rows.append(row)
            except Exception as error:  # noqa: BLE001 - this row fails alone
                rows.append(_row_error(cur, n, pk_index, attempt_index, error))
        return rows

    def fileno(self) -> int:
        return int(self.raw.pgconn.socket)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with suppress(Exception):
            self.sa.invalidate()
        with suppress(Exception):
            self.sa.close()
        with suppress(Exception):
            self._close_raw()

    def _close_raw(self) -> None:
        """Close the psycopg connection (its cursor with it), whatever SQLAlchemy did."""
        self.raw.close()


def _runtime_cursor(raw: Any) -> Any:
    """The cursor the runtime's statements run on. JSON is read as text and parsed per row
    by the loader, so one value Python cannot parse fails its own job, not the claim."""
    cursor = raw.cursor()
    for name in ("json", "jsonb"):
        cursor.adapters.register_loader(name, TextLoader)
    return cursor


def _load_one(cur: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any], row: int, col: int) -> Any:
    result = cur.pgresult
    assert result is not None
    data = result.get_value(row, col)
    oid, fmt = result.ftype(col), result.fformat(col)
    loader_class = cur.adapters.get_loader(oid, psycopg.pq.Format(fmt))
    if data is None or loader_class is None:
        return data
    return loader_class(oid, cur).load(data)


def _row_error(
    cur: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any], n: int, pk_index: int, attempt_index: int,
    error: BaseException,
) -> RowError:
    return RowError(_load_one(cur, n, pk_index), int(_load_one(cur, n, attempt_index)), error)


class AsyncDbConnection(DbConnection):
    """A dedicated connection of an asyncio engine, used from the runtime's greenlets.

    The same operations as :class:`DbConnection`; each is one coroutine on the psycopg
    ``AsyncConnection``, awaited on the event loop (``await_only``), so a service written
    as blocking code never blocks the loop.
    """

    raw: psycopg.AsyncConnection[Any]  # type: ignore[assignment]

    def __init__(self, sa: Connection, purpose: str) -> None:
        adapted: Any = sa.connection.dbapi_connection  # SQLAlchemy's adapter: awaits for us
        self._adapted = adapted
        adapted.autocommit = True
        self._init_state(sa, purpose, adapted.driver_connection)

    def set_autocommit(self, on: bool) -> None:
        self._adapted.autocommit = on  # awaited by the adapter

    def execute(self, stmt: Statement, values: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        return await_only(self._execute(stmt.sql, stmt.params(values)))

    async def _execute(self, sql: str, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        cur = self._cursor
        if self._replan_due():
            await cur.execute(_DISCARD_PLANS)
        await cur.execute(sql, params)
        return await cur.fetchall() if cur.pgresult is not None and cur.description else []

    def fetch_claimed(
        self, stmt: Statement, values: Mapping[str, Any], pk_index: int, attempt_index: int, turn: Turn | None = None
    ) -> list[tuple[Any, ...] | RowError]:
        return await_only(self._fetch_claimed(stmt.sql, stmt.params(values), pk_index, attempt_index, turn))

    async def _fetch_claimed(
        self, sql: str, params: Mapping[str, Any], pk_index: int, attempt_index: int, turn: Turn | None
    ) -> list[tuple[Any, ...] | RowError]:
        cur = self._cursor
        if self._replan_due():
            await cur.execute(_DISCARD_PLANS)
        if turn is None:
            await cur.execute(sql, params)
            return await self._aclaimed_rows(cur, pk_index, attempt_index)
        raw = self.raw
        try:
            async with raw.pipeline():
                await raw.execute(_BEGIN)
                await raw.execute(_TURN, _turn_params(turn))
                await cur.execute(sql, params)
                await raw.execute(_COMMIT)
        except BaseException:
            await self._aroll_back()
            raise
        return await self._aclaimed_rows(cur, pk_index, attempt_index)

    async def _aroll_back(self) -> None:
        if self.broken:
            return
        try:
            await self.raw.execute(_ROLLBACK)
        except Exception:  # the connection is then broken, and discarded
            log.debug("%s: rollback failed", self.purpose, exc_info=True)

    @staticmethod
    async def _aclaimed_rows(
        cur: psycopg.AsyncCursor[Any], pk_index: int, attempt_index: int
    ) -> list[tuple[Any, ...] | RowError]:
        try:
            return list(await cur.fetchall())
        except Exception:  # noqa: BLE001 - find the unreadable rows one by one
            pass
        rows: list[tuple[Any, ...] | RowError] = []
        result = cur.pgresult
        assert result is not None
        for n in range(result.ntuples):
            await cur.scroll(n, mode="absolute")
            try:
                row = await cur.fetchone()
                assert row is not None
                rows.append(row)
            except Exception as error:  # noqa: BLE001 - this row fails alone
                rows.append(_row_error(cur, n, pk_index, attempt_index, error))
        return rows

    def query(self, sql: Any, params: Any = None) -> list[tuple[Any, ...]]:
        return await_only(self._query(sql, params))

    async def _query(self, sql: Any, params: Any) -> list[tuple[Any, ...]]:
        cur = await self.raw.execute(sql, params)
        return await cur.fetchall() if cur.description else []

    def notifies(self, timeout: float) -> list[str]:
        return await_only(self._notifies(timeout))

    def describe(self, sql: Any) -> dict[str, int]:
        return await_only(self._describe(sql))

    async def _describe(self, sql: Any) -> dict[str, int]:
        cur = await self.raw.execute(sql)
        return {d.name: d.type_code for d in cur.description or []}

    async def _notifies(self, timeout: float) -> list[str]:
        return [n.payload async for n in self.raw.notifies(timeout=timeout, stop_after=1)]

    def _close_raw(self) -> None:
        await_only(self.raw.close())


class StatementDeadlines:
    """Cuts overdue database calls short, for every connection of one driver.

    One thread, started on demand (and ended after a few idle seconds), watches every
    call under :meth:`Driver.deadline`: a timer thread per call would cost a thread start
    on every claim and completion. The thread sleeps until the earliest deadline; a new
    call only wakes it when its deadline comes sooner. A call is cut (``abort``) while the
    lock is held and its entry is still there, so once :meth:`release` returned, that
    connection is never cut for it (its descriptor may be reused by then).
    """

    #: How long the thread stays without any call to watch before it ends.
    IDLE_SECONDS = 5.0

    def __init__(self, abort: Callable[..., None]) -> None:
        self._abort = abort
        self._cond = threading.Condition(threading.Lock())
        self._watched: dict[int, tuple[float, DbConnection]] = {}
        self._next_key = 0
        self._wakes_at = math.inf
        self._thread: threading.Thread | None = None

    def watch(self, conn: DbConnection, seconds: float) -> int:
        due = time.monotonic() + seconds
        with self._cond:
            key = self._next_key
            self._next_key += 1
            self._watched[key] = (due, conn)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sqla_queue-deadlines", daemon=True)
                self._thread.start()
            elif due < self._wakes_at:
                self._cond.notify()
        return key

    def release(self, key: int) -> None:
        with self._cond:
            self._watched.pop(key, None)

    def _run(self) -> None:
        cut: list[DbConnection] = []
        while True:
            for conn in cut:
                log.warning("%s: a database call overran its deadline; connection dropped", conn.purpose)
            cut = []
            with self._cond:
                now = time.monotonic()
                for key, (due, conn) in list(self._watched.items()):
                    if due <= now:
                        del self._watched[key]
                        self._abort(conn, quiet=True, cancel=True)
                        cut.append(conn)
                if cut:
                    continue
                if self._watched:
                    self._wakes_at = min(due for due, _ in self._watched.values())
                    self._cond.wait(self._wakes_at - now)
                    continue
                self._wakes_at = math.inf
                self._cond.wait(self.IDLE_SECONDS)
                if not self._watched:
                    self._thread = None
                    return


class Driver:
    """psycopg 3 on PostgreSQL, for one engine, on threads."""

    #: How its services run: threads here, greenlets on an event loop for :class:`AsyncDriver`.
    runtime: Runtime
    _connection_class: type[DbConnection] = DbConnection

    def __init__(self, engine: Engine, *, keepalive: float = 5.0) -> None:
        self._check(engine)
        self.engine = engine
        self.dialect = engine.dialect
        self.schema_translate_map = _schema_map(engine)
        self.keepalive = keepalive
        self.runtime = ThreadRuntime()
        self._deadlines = StatementDeadlines(self.abort)

    @staticmethod
    def _check(engine: Engine) -> None:
        if engine.dialect.name != "postgresql":
            raise WorkerStartError(
                f"the worker needs PostgreSQL, got the {engine.dialect.name!r} dialect"
            )
        if engine.dialect.is_async:
            raise WorkerStartError(
                "the thread Worker needs a synchronous engine (postgresql+psycopg://), got an "
                "asyncio one: use create_engine(), not create_async_engine()"
            )
        if engine.dialect.driver != "psycopg":
            raise WorkerStartError(
                f"the worker needs the psycopg 3 driver (postgresql+psycopg://), got "
                f"{engine.dialect.driver!r}"
            )

    # -- statements --------------------------------------------------------------------

    #: The engine's ``schema_translate_map``: every statement and name follows it.
    schema_translate_map: Mapping[str | None, str | None] | None

    def compile(self, stmt: ClauseElement) -> Statement:
        return compile_statement(stmt, self.dialect, self.schema_translate_map)

    def channel(self, table: Table) -> str:
        """The NOTIFY channel of ``table`` in the schema the engine's map puts it in."""
        return notify_channel(table, self.schema_translate_map)

    def table_name(self, table: Table) -> str:
        """``table``'s schema-qualified name under the engine's map (for messages)."""
        schema = translated_schema(table, self.schema_translate_map)
        return f"{schema}.{table.name}" if schema else table.name

    # -- connections -------------------------------------------------------------------

    def connect(self, purpose: str, *, listen: str | None = None) -> DbConnection:
        """A connection made by the engine (its URL, ``connect_args`` and events) but kept
        out of its pool, so a busy pool can never starve the runtime.

        No session setting is changed (a pooler in transaction mode would leak it to other
        clients): calls that must not wait for long run under :meth:`deadline` instead.
        """
        sa = self.engine.connect()
        try:
            sa.detach()
            conn = self._connection_class(sa, purpose)
            self._keepalive(conn)
            if listen is not None:
                self.listen(conn, listen)
        except BaseException:
            with suppress(Exception):
                sa.invalidate()
            with suppress(Exception):
                sa.close()
            raise
        return conn

    def _keepalive(self, conn: DbConnection) -> None:
        """TCP keepalives and a user timeout: a dead peer is noticed in seconds."""
        sock = socket.socket(fileno=os.dup(conn.fileno()))
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                return
            idle = max(int(self.keepalive), 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for option, value in (
                ("TCP_KEEPIDLE", idle),
                ("TCP_KEEPINTVL", idle),
                ("TCP_KEEPCNT", 3),
                ("TCP_USER_TIMEOUT", idle * 4 * 1000),
            ):
                if hasattr(socket, option):
                    sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
        finally:
            sock.close()  # closes the duplicate descriptor only

    @staticmethod
    def listen(conn: DbConnection, channel: str) -> None:
        """LISTEN on ``channel``. Again on a connection that already does, it changes
        nothing but the connection's last statement in ``pg_stat_activity``: the
        listener ends each use of its connection with it, so that a listening worker can
        be told from there (:func:`sqla_queue.sql.listening_workers`)."""
        conn.query(pgsql.SQL("LISTEN {}").format(pgsql.Identifier(channel)))

    @staticmethod
    def notify(conn: DbConnection, channel: str, payloads: Sequence[str]) -> None:
        """Wake the listeners of ``channel``, one notification per payload."""
        pairs = [(channel, payload) for payload in payloads]
        if pairs:
            conn.query(notify_sql(pairs))

    def notifies(self, conn: DbConnection, timeout: float) -> list[str]:
        """Payloads of the notifications that arrive within ``timeout`` seconds."""
        return conn.notifies(timeout)

    @contextmanager
    def deadline(self, conn: DbConnection, seconds: float) -> Iterator[None]:
        """Cut a call on ``conn`` short after ``seconds``: the socket is shut down, so a
        call blocked on a hung server or network (a proxy or NAT box that still
        acknowledges packets, so TCP keepalive never fires) raises instead of waiting
        forever. Once the block is left, the connection is no longer cut."""
        key = self._deadlines.watch(conn, seconds)
        try:
            yield
        finally:
            self._deadlines.release(key)

    @staticmethod
    def abort(conn: DbConnection, *, quiet: bool = False, cancel: bool = False) -> None:
        """Shut the connection's socket down: a call blocked on it raises at once.

        With ``cancel`` (a deadline passed), the server is also asked to cancel the
        statement: a backend whose client is gone runs on until it next writes to it, so
        a statement waiting for a lock would keep the row locks it already took, and the
        call made again on a new connection would queue behind them."""
        conn.aborted = True
        if cancel:
            _cancel_in_background(conn)
        with suppress(OSError, psycopg.Error):
            fd = conn.fileno()
            sock = socket.socket(fileno=os.dup(fd))
            try:
                sock.shutdown(socket.SHUT_RDWR)
            finally:
                sock.close()
        if not quiet:
            log.warning("%s: a database call overran its deadline; connection dropped", conn.purpose)

    # -- sessions ----------------------------------------------------------------------

    def session_on(self, factory: Callable[[], Any], sa: Connection) -> tuple[Session, Any]:
        """A session from ``factory`` joined to the transaction ``sa`` is in, in
        ``create_savepoint`` mode: its commits and rollbacks act on savepoints, and only
        the caller commits. Returns the synchronous session and the one to hand over."""
        session = factory()
        if not isinstance(session, Session):
            raise TypeError(f"session_factory must make a sqlalchemy Session, got {session!r}")
        return _joined(session, sa, self.engine), session

    # -- errors ------------------------------------------------------------------------

    @staticmethod
    def is_connection_error(exc: BaseException) -> bool:
        """A lost connection or server, as opposed to an error of the statement: for the
        worker's own statements (a handler's exception is judged by its connection's state).

        A read-only transaction (SQLSTATE 25006) counts as one: the worker's statements
        all write, so the connection reached a standby (a pooler or a virtual address
        that still points at the old primary, now a standby, or a server being demoted).
        The statement must be made again on a new connection, which a multi-host URL with
        ``target_session_attrs=read-write`` sends to the primary. A server that refuses
        connections while it starts or recovers (57P03) raises an ``OperationalError``,
        one already."""
        if isinstance(exc, sa_exc.DBAPIError):
            if exc.connection_invalidated:
                return True
            exc = exc.orig if exc.orig is not None else exc
        if isinstance(exc, psycopg.OperationalError):
            return not isinstance(exc, psycopg.errors.QueryCanceled | psycopg.errors.LockNotAvailable)
        if isinstance(exc, psycopg.errors.ReadOnlySqlTransaction):
            return True
        return isinstance(exc, ConnectionError)

    # -- start-up ----------------------------------------------------------------------

    def check_table(self, table: Table) -> dict[str, int]:
        """Fail fast: the server answers and the table exists with the queue columns
        (in the schema the engine's ``schema_translate_map`` puts it in).

        Returns the type code (OID) the server reports for each of ``table``'s columns it
        has, as ``cursor.description`` will for the claim's rows: result processors
        depend on it (PostgreSQL numbers, for one)."""
        schema, name = translated_schema(table, self.schema_translate_map), table.name
        qualified = pgsql.Identifier(*([schema, name] if schema else [name]))
        try:
            conn = self.connect("start-up check")
        except Exception as exc:
            raise WorkerStartError(
                f"cannot connect to {self.engine.url.render_as_string(hide_password=True)}: "
                f"{_first_line(exc)}"
            ) from exc
        try:
            with self.deadline(conn, 30):
                rows = conn.query(
                    "SELECT a.attname FROM pg_attribute a "
                    "WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped",
                    (qualified.as_string(None),),
                )
                present = {r[0] for r in rows}
                wanted = [c.name for c in table.c if c.name in present]
                types = conn.describe(
                    pgsql.SQL("SELECT {} FROM {} WHERE false").format(
                        pgsql.SQL(", ").join(map(pgsql.Identifier, wanted)), qualified
                    )
                ) if wanted and set(REQUIRED_COLUMNS) <= present else {}
                index = conn.query(
                    INDEX_SQL, (qualified.as_string(None), constraint_name(table.name, "unique_idx"))
                ) if present and unique_jobs(table) is not None else None
                controls = declared_queues_table(table)
                # The queues table's columns (none: it does not exist), each checked below.
                controls_columns = {r[0] for r in conn.query(
                    "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attnum > 0 "
                    "AND NOT attisdropped",
                    (pgsql.Identifier(*([schema, controls.name] if schema else [controls.name])).as_string(None),),
                )} if controls is not None else set()
                registry = declared_workers_table(table)
                registry_found = bool(conn.query(
                    "SELECT to_regclass(%s) IS NOT NULL",
                    (pgsql.Identifier(*([schema, registry.name] if schema else [registry.name])).as_string(None),),
                )[0][0]) if registry is not None else True
                activity = declared_activity_table(table)
                activity_found = bool(conn.query(
                    "SELECT to_regclass(%s) IS NOT NULL",
                    (pgsql.Identifier(*([schema, activity.name] if schema else [activity.name])).as_string(None),),
                )[0][0]) if activity is not None else True
            name = f"{schema}.{name}" if schema else name
        finally:
            conn.close()
        problem = table_problem(name, [r[0] for r in rows])
        if problem is None and index is not None:
            # A unique index the model no longer describes would skip or refuse keyed jobs.
            problem = unique_index_problem(table, index[0] if index else None, name)
        if problem is None and controls is not None and not controls_columns:
            problem = (
                f"table {name!r} has a queues table declared (sqla_queue.queues_table), but "
                f"{constraint_name(table.name, 'queues')!r} does not exist in that database: create it, or migrate"
            )
        elif problem is None and controls is not None and (lacking := set(controls.c.keys()) - controls_columns):
            problem = (
                f"the queues table {constraint_name(table.name, 'queues')!r} of {name!r} lacks the column(s) "
                f"{', '.join(sorted(lacking))}, which this version of sqla_queue reads: migrate it (Alembic "
                f"autogenerate adds them)"
            )
        if problem is None and not registry_found:
            problem = (
                f"table {name!r} has a workers table declared (sqla_queue.workers_table), but "
                f"{constraint_name(table.name, 'workers')!r} does not exist in that database: create it, or migrate"
            )
        if problem is None and not activity_found:
            problem = (
                f"table {name!r} has an activity table declared (sqla_queue.activity_table), but "
                f"{constraint_name(table.name, 'activity')!r} does not exist in that database: create it, or migrate"
            )
        if problem is not None:
            raise WorkerStartError(problem)
        return types


class AsyncDriver(Driver):
    """psycopg 3's asyncio connections of an ``AsyncEngine``, for the runtime's greenlets.

    The services call the same methods as on :class:`Driver`; underneath, each database
    call is awaited on the loop the service runs on.
    """

    _connection_class = AsyncDbConnection

    def __init__(self, engine: AsyncEngine, *, keepalive: float = 5.0, threads: int = 4) -> None:
        if not isinstance(engine, AsyncEngine):
            raise WorkerStartError(
                "the AsyncWorker needs an asyncio engine (create_async_engine("
                "'postgresql+psycopg://...')), got " + type(engine).__name__
            )
        sync_engine = engine.sync_engine
        if sync_engine.dialect.name != "postgresql":
            raise WorkerStartError(
                f"the worker needs PostgreSQL, got the {sync_engine.dialect.name!r} dialect"
            )
        if sync_engine.dialect.driver != "psycopg":
            raise WorkerStartError(
                f"the AsyncWorker needs the psycopg 3 driver (postgresql+psycopg://), got "
                f"{sync_engine.dialect.driver!r}"
            )
        self.async_engine = engine
        self.engine = sync_engine
        self.dialect = sync_engine.dialect
        self.schema_translate_map = _schema_map(sync_engine)
        self.keepalive = keepalive
        self.runtime = AsyncRuntime(threads)
        self._deadlines = StatementDeadlines(self.abort)

    def session_on(self, factory: Callable[[], Any], sa: Connection) -> tuple[Session, Any]:
        """As :meth:`Driver.session_on`, for an ``AsyncSession`` factory (a ``Session``
        one works too): the async session is handed over, its sync session joined."""
        session = factory()
        if isinstance(session, AsyncSession):
            return _joined(session.sync_session, sa, self.engine), session
        if isinstance(session, Session):
            return _joined(session, sa, self.engine), session
        raise TypeError(f"session_factory must make an AsyncSession, got {session!r}")


#: Cancel requests still in flight: each has a thread, so a server that stopped
#: answering cannot make the watchdog start them without bound.
_cancelling = threading.BoundedSemaphore(8)
#: How long a cancel request may take (it is a connection of its own to the server).
CANCEL_SECONDS = 10.0


def _cancel_in_background(conn: DbConnection) -> None:
    """Send a cancel request for ``conn``'s running statement, from a thread of its own.

    A cancel request is a new connection to the server, which may be the one that hangs:
    the watchdog must not wait for it. libpq's non-blocking cancel connection (libpq 17
    and later) is polled with ``select``, which lets the other threads run: the blocking
    ``PQcancel`` holds the GIL in psycopg's C implementation, so a server that accepts
    the cancel's connection and never answers would freeze the whole process. With an
    older libpq, no cancel is sent (the socket is cut all the same). The request is made
    before the socket is shut, while psycopg still holds the connection's key."""
    try:
        request = conn.raw.pgconn.cancel_conn()
    except psycopg.Error:
        return  # closed already, or a libpq before 17 (NotSupportedError)
    if not _cancelling.acquire(blocking=False):
        request.finish()
        return

    def send() -> None:
        try:
            _poll_cancel(request, time.monotonic() + CANCEL_SECONDS)
        except (OSError, psycopg.Error) as exc:
            log.debug("%s: the cancel request failed: %s", conn.purpose, exc)
        finally:
            request.finish()
            _cancelling.release()

    threading.Thread(target=send, name="sqla_queue-cancel", daemon=True).start()


def _poll_cancel(request: PGcancelConn, deadline: float) -> None:
    """Start ``request`` and drive it to its end by ``deadline``, waiting in ``select``."""
    request.start()
    while True:
        status = request.poll()
        if status == psycopg.pq.PollingStatus.OK:
            return
        if status == psycopg.pq.PollingStatus.FAILED:
            raise psycopg.OperationalError(request.get_error_message())
        left = deadline - time.monotonic()
        if left <= 0:
            raise psycopg.OperationalError("the cancel request timed out")
        fd = request.socket
        if status == psycopg.pq.PollingStatus.READING:
            select.select([fd], [], [], left)
        else:
            select.select([], [fd], [], left)


def _schema_map(engine: Engine) -> Mapping[str | None, str | None] | None:
    found: Mapping[str | None, str | None] | None = engine.get_execution_options().get("schema_translate_map")
    return dict(found) if found else None


def _joined(session: Session, sa: Connection, engine: Engine) -> Session:
    session.join_transaction_mode = "create_savepoint"
    resolve = session.get_bind

    def get_bind(*args: Any, **kwargs: Any) -> Any:
        found = resolve(*args, **kwargs)
        return sa if found is engine else found

    session.get_bind = get_bind  # type: ignore[method-assign]
    return session


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# -- a waiter's notifications, on a connection of the engine's own ------------------------
# For sqla_queue.results: the psycopg connection under a SQLAlchemy one. None from each
# when the engine's driver is not psycopg: the waiter polls.


def notify_payloads(sa: Connection, timeout: float) -> list[str] | None:
    """The payloads of the notifications ``sa``'s psycopg connection has received, or
    receives within ``timeout`` seconds (those that arrived during its queries first)."""
    raw = sa.connection.driver_connection
    if not isinstance(raw, psycopg.Connection):
        return None
    return [n.payload for n in raw.notifies(timeout=max(timeout, 0.0), stop_after=1)]


async def notify_payloads_async(raw: Any, timeout: float) -> list[str] | None:
    """:func:`notify_payloads` for the psycopg ``AsyncConnection`` ``raw``."""
    if not isinstance(raw, psycopg.AsyncConnection):
        return None
    return [n.payload async for n in raw.notifies(timeout=max(timeout, 0.0), stop_after=1)]
