"""``enqueue_many()``: load many jobs at once, inside the caller's transaction.

On psycopg 3 the rows are streamed with ``COPY … FROM STDIN`` on the session's own
connection, so they commit or roll back with the caller's other writes exactly like the
jobs of ``enqueue()``. Other drivers, and loads below :data:`COPY_MIN_ROWS` rows (where
COPY's extra round trip does not pay for itself), use SQLAlchemy's executemany of
``insert(table)``, one call per batch: psycopg pipelines it, drivers using
"insertmanyvalues" turn it into multi-row ``INSERT … VALUES``.

The rows are read ``batch_size`` at a time (an iterator of a million rows is never held in
memory) and each batch is validated in full before any of it is written, so a bad row
never leaves a COPY half-sent. Every load is written inside a SAVEPOINT: when a row of
a later batch is bad, or the database refuses a row (a foreign key), the rows already
written are rolled back to it, and the caller's transaction is as it was before the
call, still usable. Otherwise they would sit in the transaction waiting for a careless
``commit()``, or a database error would abort the whole transaction (psycopg's
``commit()`` of an aborted transaction silently rolls back everything the caller
wrote). One load behaves like another whatever its number of batches; the savepoint
costs two short round trips per call.

With an ``AsyncSession`` the same load runs inside ``run_sync``'s greenlet, as
SQLAlchemy runs the session's own flush there: one implementation of the rules, the
batches, the SAVEPOINT and the NOTIFY for both. Only the I/O that SQLAlchemy does not
already bridge is awaited by hand: COPY on the psycopg ``AsyncConnection`` and rows
from an async iterable, a batch (or a run of same-shaped rows) per switch to the event
loop, so the bridge costs nothing per row.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterable, AsyncIterator, Coroutine, Iterable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from itertools import groupby, islice
from operator import itemgetter
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Literal, overload

import psycopg
from psycopg import sql as pgsql
from sqlalchemy import Connection, Table, bindparam, insert, literal_column, select
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Session
from sqlalchemy.util import await_only
from typing_extensions import Unpack

from ..cache import plans
from ..dbapi import SchemaMapKey, compile_statement, reraise_as_sqlalchemy, schema_map_key
from ..errors import EnqueueError
from ..sql import delay_from_insert, insert_unique
from ..unique_index import check_unique_index
from .binds import resolve_session
from .options import EnqueueKwargs, enqueue_options
from .outbox import notify_on_commit
from .rows import RowWriter, TablePlan, table_plan
from .unique import EnqueuedMany

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession, async_scoped_session
    from sqlalchemy.orm import scoped_session

__all__ = ["COPY_MIN_ROWS", "DEFAULT_BATCH_SIZE", "enqueue_many"]

#: Loads smaller than this use an INSERT even where COPY is possible.
#:
#: Measured with ``benchmarks/bulk_crossover.py`` (2 cores, PostgreSQL 15 on localhost TCP,
#: psycopg 3.3, SQLAlchemy 2.1; median ms of a whole ``enqueue_many`` call, several runs
#: agreeing within noise):
#:
#: ==========  ===========  ===========  ===========  ===========
#: rows        jobs COPY    jobs INSERT  tasks COPY   tasks INSERT
#: ==========  ===========  ===========  ===========  ===========
#: 1           0.27         0.31         0.27         0.32
#: 2           0.28         0.39         0.28         0.42
#: 10          0.36         0.68         0.35         0.75
#: 50          0.76         1.72         0.76         1.90
#: 100         1.24         3.12         1.30         3.38
#: 1000        10.65        29.33        11.30        33.06
#: 5000        42.1         170.4        45.7         157.4
#: ==========  ===========  ===========  ===========  ===========
#:
#: COPY is never slower here: from 2 rows on it wins in every run, and at 1 row the two
#: are within noise (one run in six had INSERT ahead). What COPY costs is one more round
#: trip (the server must answer the COPY before data may flow), so 1-row loads, which
#: are ``enqueue()``'s job anyway, use INSERT. The crossover grows with the latency to the
#: server: through a proxy adding 0.3 ms of round trip it was still under 2 rows, with
#: ~3 ms of round trip INSERT won up to 10-50 rows. Callers far from their database that
#: make many tiny loads can pass ``method="insert"``.
COPY_MIN_ROWS: Final = 2

#: Rows read, validated and held at a time: bounds the memory of a call whatever the
#: number of rows, and is the unit of SQLAlchemy's executemany on the INSERT path.
DEFAULT_BATCH_SIZE: Final = 1000

Method = Literal["auto", "copy", "insert"]
_METHODS: Final = ("auto", "copy", "insert")


@overload
def enqueue_many(
    session: AsyncSession | async_scoped_session[Any],
    model: Any,
    rows: Iterable[Any] | AsyncIterable[Any],
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    method: Method = "auto",
    **options: Unpack[EnqueueKwargs],
) -> Coroutine[Any, Any, EnqueuedMany]: ...


@overload
def enqueue_many(
    session: Session | scoped_session[Any],
    model: Any,
    rows: Iterable[Any],
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    method: Method = "auto",
    **options: Unpack[EnqueueKwargs],
) -> EnqueuedMany: ...


def enqueue_many(
    session: Any,
    model: Any,
    rows: Iterable[Any] | AsyncIterable[Any],
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    method: Method = "auto",
    **options: Unpack[EnqueueKwargs],
) -> EnqueuedMany | Coroutine[Any, Any, EnqueuedMany]:
    """Insert many jobs into ``model``'s queue table in ``session``'s transaction.

    ``rows`` is any iterable (a generator is fine: it is read ``batch_size`` rows at a
    time) of dicts of column values (keys are the table's column keys) and/or new
    instances of the queue model. Instances are read, **not** added to the session:
    the rows bypass the identity map, so the objects stay transient, their ``id`` is
    never set, relationships on them are refused (set the foreign key column) and mapper
    events such as ``before_insert`` do not run. As in the ORM's INSERT, an instance's
    attribute set to None is left to the column's default (a JSON column stores it); of
    a SQLModel instance, only the fields the caller set are read.

    Options (``queue``, ``priority``, ``delay`` in seconds or a timedelta measured by the
    database clock at the call, ``run_at``, ``max_attempts``) apply to every row **that does not set
    the column itself**: a row's own value wins (unlike ``enqueue()``, where the option
    overrides the job, because here the options are the defaults of a batch of rows).
    Columns neither the row nor an option sets get the column's Python default (as an ORM
    insert would) or else the server default, so a row matches what ``enqueue()`` writes;
    with a subclass of a single-table inheritance model, the discriminator column gets the
    subclass's polymorphic identity (a row naming another model's identity is refused).

    Every row is checked before its batch is written: unknown columns, columns the queue
    manages (status, attempts, leases, finished_at), JSON columns that JSON cannot store,
    a task table's missing task name, NULL in a NOT NULL column, bad queue/priority/
    max_attempts/run_after values, text longer than its column or holding NUL or a lone
    surrogate (JSON too), JSON larger than jsonb stores (2**28 - 1 bytes), a row of text
    and JSON past about 1 GiB. These are the rules ``enqueue()`` applies. A bad row
    raises :class:`~sqla_queue.BulkRowError` with its 0-based ``index``, and none of the
    call's rows remain: either nothing was written yet, or (loads of more than
    ``batch_size`` rows) the earlier batches are rolled back to a SAVEPOINT taken before
    them. A value the database rejects (a
    foreign key, a CHECK) raises SQLAlchemy's usual ``DBAPIError`` subclass, and the
    call's rows are rolled back to the same SAVEPOINT. Either way the caller's
    transaction stays usable: roll it back, or commit its other work. Bad options raise
    :class:`~sqla_queue.EnqueueError` before any row is read.

    ``method``: ``"auto"`` uses COPY on psycopg 3 (sync or async) with PostgreSQL for
    loads of at least :data:`COPY_MIN_ROWS` rows (judged from the first batch), and
    batched INSERTs otherwise; ``"copy"`` insists on COPY (``EnqueueError`` where it is
    impossible: other drivers, a column whose Python default is a SQL expression, a
    sequence or a context-sensitive function, which only an INSERT can evaluate, or a
    column whose type has a ``bind_expression``, such as ``pgp_sym_encrypt()``, which
    only an INSERT applies; ``"auto"`` uses INSERTs for those tables);
    ``"insert"`` never uses it. ``delay`` costs one ``SELECT clock_timestamp() + …``.

    Pending ORM objects in the session are flushed first when autoflush is on, so rows
    may reference them by foreign key. Workers are woken by one NOTIFY per queue written,
    sent when the transaction commits. Returns the number of rows written, as an
    :class:`~sqla_queue.EnqueuedMany` (an ``int``) that also says how many were skipped.

    Unique jobs: a row that sets the model's key column (``unique_key``, or the column its
    :class:`~sqla_queue.UniqueJobs` names) is written by ``INSERT … ON CONFLICT DO
    NOTHING`` (an executemany per batch), so a duplicate of a job already holding the key,
    or of an earlier row of the same call, is skipped, counted in ``.skipped``, and never
    an error. Rows without a key take the usual path (COPY). Keyed rows are inserted in
    key order within each batch, so two loads of the same keys at once do not deadlock
    (loads of more than ``batch_size`` keyed rows still can, across batches).

    With an ``AsyncSession`` (or an ``async_scoped_session``) this returns a coroutine:
    ``n = await enqueue_many(async_session, Model, rows)``, where ``rows`` may also be an
    async iterable (read ``batch_size`` rows at a time too). It is this same load, run
    the way ``AsyncSession`` runs its own flush (in ``run_sync``'s greenlet), so every
    rule, batch, SAVEPOINT and NOTIFY above holds as it is; only the COPY data and the
    async rows are awaited, one batch per switch, on the session's psycopg
    ``AsyncConnection``. Nothing happens until it is awaited; errors raise from the
    ``await``. ``await session.run_sync(enqueue_many, Model, rows)`` works as well.
    """
    session = resolve_session(session)
    if hasattr(session, "sync_session"):  # an AsyncSession: I/O only when awaited
        return _enqueue_many_async(session, model, rows, batch_size, method, options)
    if not isinstance(session, Session):
        raise TypeError(f"expected a SQLAlchemy Session, got {type(session).__qualname__}")
    if isinstance(rows, AsyncIterable) and not isinstance(rows, Iterable):
        raise TypeError(
            "rows is an async iterable, which only an AsyncSession can read: "
            "`await enqueue_many(async_session, Model, rows)`"
        )
    return _enqueue_many(session, model, rows, batch_size, method, options)


async def _enqueue_many_async(
    session: AsyncSession,
    model: Any,
    rows: Iterable[Any] | AsyncIterable[Any],
    batch_size: int,
    method: Method,
    options: EnqueueKwargs,
) -> EnqueuedMany:
    if isinstance(rows, AsyncIterable) and not isinstance(rows, Iterable):
        rows = _awaited_rows(rows, batch_size)
    return await session.run_sync(_enqueue_many, model, rows, batch_size, method, options)


def _enqueue_many(
    sync: Session, model: Any, rows: Iterable[Any], batch_size: int, method: Method, options: EnqueueKwargs
) -> EnqueuedMany:
    """The one load of :func:`enqueue_many`, sync or (inside ``run_sync``) async."""
    plan = table_plan(model)
    checked = enqueue_options(options)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise EnqueueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if method not in _METHODS:
        raise EnqueueError(
            f"method must be one of {', '.join(map(repr, _METHODS))}, got {method!r}"
        )
    values = dict(checked.values)
    plan.check_options(values)
    if isinstance(rows, (Mapping, str, bytes)) or not isinstance(rows, Iterable):
        raise TypeError(
            f"rows must be an iterable of rows, got {type(rows).__qualname__}"
            " (wrap a single row in a list)"
        )
    bind_arguments = plan.bind_arguments
    dialect_plan = plan.dialect(sync.get_bind(**bind_arguments).dialect)
    no_copy = dialect_plan.copy_impossible
    if method == "copy" and no_copy is not None:
        raise EnqueueError(f"method='copy' is impossible here: {no_copy}")

    rows_iter = iter(rows)
    first = list(islice(rows_iter, batch_size))
    if not first:
        return EnqueuedMany(0)
    more = len(first) == batch_size  # maybe more batches to come
    use_copy = no_copy is None and (
        method == "copy" or (method == "auto" and (more or len(first) >= COPY_MIN_ROWS))
    )
    if checked.delay_seconds is not None:
        # Measured by the database clock at this moment, in seconds, as enqueue() measures
        # from its INSERT (COPY cannot evaluate an expression per row, so one value for all).
        values["run_after"] = (
            sync.connection(bind_arguments=bind_arguments)
            .execute(select(delay_from_insert(checked.delay_seconds)))
            .scalar_one()
        )

    writer = RowWriter(dialect_plan, values, for_copy=use_copy)
    # Rows with a unique key go by INSERT … ON CONFLICT DO NOTHING (COPY cannot skip a
    # duplicate), the others by COPY or INSERT as usual: each row to its writer.
    # On psycopg (sync) they go by the driver's pipelined executemany, their values
    # converted as for COPY: SQLAlchemy's execution of many rows costs more than the rows.
    direct = use_copy and not dialect_plan.dialect.is_async
    # There the columns whose server default repeats their Python default are left to the
    # server (the statement says DEFAULT): a keyed row sends what a hand-written INSERT would.
    keyed_writer = (
        RowWriter(dialect_plan, values, for_copy=direct, server_fills=direct)
        if plan.unique_column is not None
        else None
    )
    batches = _split(writer, keyed_writer, plan, first, rows_iter, batch_size)
    del first  # the generator owns the first batch now: keep memory bounded
    first_batch = next(batches)  # a bad row here raises before anything is written

    if sync.autoflush:
        sync.flush()  # rows may reference pending business rows by foreign key
    conn = sync.connection(bind_arguments=bind_arguments)
    # Every load that writes runs in a SAVEPOINT (see the module doc): a bad row of a
    # later batch, or an error of the database itself, leaves none of the call's rows and
    # the caller's transaction usable, whatever the number of batches.
    savepoint = conn.begin_nested()
    keyed: list[list[tuple[tuple[str, ...], Any]]] = []

    def plain(split: Iterator[tuple[list[Any], list[Any]]]) -> Iterator[list[tuple[tuple[str, ...], Any]]]:
        """The rows without a key, up to the first batch with keyed rows (kept in
        ``keyed``): a COPY must end before another statement runs."""
        for rows_plain, rows_keyed in split:
            if rows_plain:
                yield rows_plain
            if rows_keyed:
                keyed.append(rows_keyed)
                return

    written = skipped = 0
    try:
        rest = _prepend(first_batch, batches)
        del first_batch
        write = _copy_rows if use_copy else _insert_rows
        while True:
            part = plain(rest)
            head = next(part, None)
            if head is not None:
                written += write(conn, plan.table, _prepend(head, part))
                del head
            if not keyed:
                break
            inserted, total = (_insert_keyed_direct if direct else _insert_keyed)(conn, plan, keyed.pop())
            written += inserted
            skipped += total - inserted
    except BaseException:
        savepoint.rollback()
        raise
    savepoint.commit()
    qt = plan.qt
    target = qt.mapped_class if qt.mapped_class is not None else qt.table
    queues = writer.queues | keyed_writer.queues if keyed_writer is not None else writer.queues
    for name in sorted(queues):
        notify_on_commit(sync, target, name)
    return EnqueuedMany(written, skipped)


def _split(
    writer: RowWriter, keyed_writer: RowWriter | None, plan: TablePlan, first: list[Any], rows: Iterator[Any],
    size: int,
) -> Iterator[tuple[list[tuple[tuple[str, ...], Any]], list[tuple[tuple[str, ...], Any]]]]:
    """Validated batches as (rows without a key, rows with one); raw rows dropped as we go."""
    if keyed_writer is None:
        for batch in writer.batches(first, rows, size):
            yield batch, []
        return
    column, attr = plan.unique_column, plan.unique_attr
    index = 0
    chunk = first
    del first
    while chunk:
        without: list[tuple[tuple[str, ...], Any]] = []
        with_key: list[tuple[tuple[str, ...], Any]] = []
        for n, raw in enumerate(chunk):
            if type(raw) is dict or isinstance(raw, Mapping):
                key = raw.get(column)
            else:
                state = getattr(raw, "_sa_instance_state", None)
                key = state.dict.get(attr) if state is not None and attr is not None else None
            if key is None:
                without.append(writer.row(index + n, raw))
            else:
                with_key.append(keyed_writer.row(index + n, raw))
        index += len(chunk)
        chunk = []
        yield without, with_key
        del without, with_key
        chunk = list(islice(rows, size))


def _insert_keyed_direct(
    conn: Connection, plan: TablePlan, batch: list[tuple[tuple[str, ...], Any]]
) -> tuple[int, int]:
    """:func:`_insert_keyed` on the psycopg cursor: ``batch`` holds values converted for
    the driver (COPY's), sent by psycopg's pipelined executemany, one statement per run
    of rows setting the same columns; psycopg counts the rows it inserted."""
    column = plan.unique_column
    assert column is not None
    translate = schema_map_key(conn.get_execution_options().get("schema_translate_map"))
    raw: Any = conn.connection.driver_connection
    inserted = 0
    for shape, group in groupby(batch, key=itemgetter(0)):
        at = shape.index(column)
        rows = sorted((values for _, values in group), key=itemgetter(at))  # key order: see _insert_keyed
        sql = _keyed_sql(plan, conn.dialect, shape, translate)
        try:
            with raw.cursor() as cursor:
                cursor.executemany(sql, rows)
                inserted += max(cursor.rowcount, 0)
        except BaseException as exc:
            reraise_as_sqlalchemy(conn, exc, sql, None)
            raise
    return inserted, len(batch)


def _keyed_sql(plan: TablePlan, dialect: Dialect, shape: tuple[str, ...], translate: SchemaMapKey) -> str:
    """The (cached) ``INSERT … ON CONFLICT DO NOTHING`` of rows of ``shape``, for the
    psycopg cursor: positional parameters in ``shape``'s order (rows are tuples, as COPY's
    are), ``DEFAULT`` for the columns the row leaves to the server, no RETURNING."""
    cache_key = ("keyed", plan.table, dialect, translate, shape)
    found: str | None = plans.get(cache_key)
    if found is not None:
        return found
    # Bind names of our own (a column key may need escaping in a bind name), in order.
    names = tuple(f"sqla_queue_{n}" for n in range(len(shape)))
    values: dict[str, Any] = {
        key: bindparam(name, type_=plan.columns[key].type) for key, name in zip(shape, names, strict=True)
    }
    for key in plan.server_same:
        values.setdefault(key, literal_column("DEFAULT"))
    # inline(): no implicit RETURNING of the primary key, and no default evaluated apart.
    statement = insert_unique(plan.table).values(values).inline()
    compiled = compile_statement(statement, dialect, dict(translate) if translate else None)
    return plans.put(cache_key, _positional(compiled.sql, names))


def _positional(sql: str, expected: tuple[str, ...]) -> str:
    """``sql`` with its named parameters (``%(name)s``, psycopg's pyformat) made
    positional (``%s``); they must be ``expected``, once each, in that order."""
    names: list[str] = []

    def one(match: re.Match[str]) -> str:
        if match.group(1) is None:
            return match.group(0)  # %%: a literal percent sign stays escaped
        names.append(match.group(1))
        return "%s"

    text = re.sub(r"%%|%\(([^)]*)\)s", one, sql)
    if tuple(names) != expected:
        raise AssertionError(f"parameters {names} of the keyed INSERT are not {list(expected)}")
    return text


def _insert_keyed(conn: Connection, plan: TablePlan, batch: list[tuple[tuple[str, ...], Any]]) -> tuple[int, int]:
    """``INSERT … ON CONFLICT DO NOTHING`` of keyed rows, an executemany per run of rows
    setting the same columns: (rows inserted, rows given). A duplicate of a job already
    there, or of an earlier row of the batch, is skipped."""
    # RETURNING counts the rows that went in (an executemany's rowcount does not, on every
    # driver), and makes SQLAlchemy send the rows as multi-row VALUES ("insertmanyvalues").
    check_unique_index(conn, plan.table)
    statement = insert_unique(plan.table).returning(plan.qt.pk)
    # In key order: two loads of the same keys then wait for each other in one order, never
    # in a cycle (a deadlock would abort one caller's transaction), within a batch.
    column = plan.unique_column
    batch.sort(key=lambda item: item[1][column])
    inserted = 0
    for _shape, group in groupby(batch, key=itemgetter(0)):
        inserted += len(conn.execute(statement, [values for _, values in group]).all())
    return inserted, len(batch)


# -- validation ---------------------------------------------------------------------------


def _awaited_rows(rows: AsyncIterable[Any], size: Any) -> Iterator[Any]:
    """The rows of an async iterable, for the load running in ``run_sync``'s greenlet.

    ``size`` rows are awaited per switch to the event loop (the load reads one batch at
    a time, so memory stays bounded the same way).
    """
    iterator = aiter(rows)
    step = size if isinstance(size, int) and not isinstance(size, bool) and size >= 1 else 1
    while True:
        chunk = await_only(_take(iterator, step))
        if not chunk:
            return
        yield from chunk
        del chunk  # before awaiting the next chunk: one batch of raw rows at a time


async def _take(iterator: AsyncIterator[Any], size: int) -> list[Any]:
    chunk: list[Any] = []
    async for row in iterator:
        chunk.append(row)
        if len(chunk) >= size:
            break
    return chunk


# -- writing ------------------------------------------------------------------------------


def _prepend(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    del first
    yield from rest


def _copy_rows(
    conn: Connection, table: Table, batches: Iterator[list[tuple[tuple[str, ...], Any]]]
) -> int:
    """Stream the rows with COPY, one COPY per run of rows setting the same columns."""
    driver = conn.connection.driver_connection
    stream: _CopyStream
    if isinstance(driver, psycopg.Connection):
        stream = _SyncCopyStream(driver)
    elif isinstance(driver, psycopg.AsyncConnection):
        stream = _AwaitedCopyStream(driver)
    else:
        raise TypeError(f"COPY needs a psycopg connection, got {type(driver).__qualname__}")
    schema = table.schema
    translate = conn.get_execution_options().get("schema_translate_map")
    if translate and schema in translate:
        schema = translate[schema]
    name = pgsql.Identifier(schema, table.name) if schema else pgsql.Identifier(table.name)
    columns = {c.key: c.name for c in table.c}
    statement: pgsql.Composed | None = None
    written = 0
    try:
        with stream:
            current: tuple[str, ...] | None = None
            for batch in batches:
                for shape, run in groupby(batch, key=itemgetter(0)):
                    if shape != current:
                        statement = pgsql.SQL("COPY {} ({}) FROM STDIN").format(
                            name, pgsql.SQL(", ").join(pgsql.Identifier(columns[k]) for k in shape)
                        )
                        stream.start(statement)  # ends the previous COPY; raises its errors
                        current = shape
                    stream.write([values for _, values in run])
                written += len(batch)
    except BaseException as exc:
        text = statement.as_string(driver) if statement is not None else "COPY"
        reraise_as_sqlalchemy(conn, exc, text, None)
        raise
    return written


class _CopyStream:
    """``COPY … FROM STDIN`` statements one after another on one psycopg cursor.

    As a context manager: leaving it ends the open COPY, or on an exception aborts it
    (psycopg sends CopyFail and the server discards that COPY's rows).
    """

    def start(self, statement: pgsql.Composed) -> None:
        """End the open COPY (raising its errors) and begin ``statement``."""
        raise NotImplementedError

    def write(self, rows: list[Any]) -> None:
        raise NotImplementedError

    def end(self, exc: BaseException | None) -> None:
        """End the open COPY, if any: aborted when ``exc`` is given."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> _CopyStream:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.end(exc)
        finally:
            self.close()


def _exc_info(exc: BaseException | None) -> tuple[Any, Any, Any]:
    return (type(exc), exc, exc.__traceback__) if exc is not None else (None, None, None)


class _SyncCopyStream(_CopyStream):
    def __init__(self, driver: psycopg.Connection[Any]) -> None:
        self.cursor = driver.cursor()
        self.context: AbstractContextManager[psycopg.Copy] | None = None
        self.copy: psycopg.Copy | None = None

    def start(self, statement: pgsql.Composed) -> None:
        self.end(None)
        context = self.cursor.copy(statement)
        self.copy = context.__enter__()
        self.context = context

    def write(self, rows: list[Any]) -> None:
        assert self.copy is not None
        write_row = self.copy.write_row
        for row in rows:
            write_row(row)

    def end(self, exc: BaseException | None) -> None:
        context, self.context, self.copy = self.context, None, None
        if context is not None:
            context.__exit__(*_exc_info(exc))

    def close(self) -> None:
        self.cursor.close()


class _AwaitedCopyStream(_CopyStream):
    """The same on a psycopg ``AsyncConnection``, from the greenlet of ``run_sync``.

    The load runs as sync code there (as ``AsyncSession`` runs its own flush); each step
    awaits psycopg's async COPY, a whole run of rows per switch to the event loop.
    """

    def __init__(self, driver: psycopg.AsyncConnection[Any]) -> None:
        self.cursor = driver.cursor()
        self.context: AbstractAsyncContextManager[psycopg.AsyncCopy] | None = None
        self.copy: psycopg.AsyncCopy | None = None

    def start(self, statement: pgsql.Composed) -> None:
        self.end(None)
        context = self.cursor.copy(statement)
        self.copy = await_only(context.__aenter__())
        self.context = context

    def write(self, rows: list[Any]) -> None:
        assert self.copy is not None
        await_only(_write_rows(self.copy, rows))

    def end(self, exc: BaseException | None) -> None:
        context, self.context, self.copy = self.context, None, None
        if context is not None:
            await_only(context.__aexit__(*_exc_info(exc)))

    def close(self) -> None:
        await_only(self.cursor.close())


async def _write_rows(copy: psycopg.AsyncCopy, rows: list[Any]) -> None:
    write_row = copy.write_row
    for row in rows:
        await write_row(row)


def _insert_rows(
    conn: Connection, table: Table, batches: Iterator[list[tuple[tuple[str, ...], Any]]]
) -> int:
    """Core executemany of ``insert(table)``, per run of rows setting the same columns."""
    statement = insert(table)
    written = 0
    for batch in batches:
        for _shape, group in groupby(batch, key=itemgetter(0)):
            conn.execute(statement, [values for _, values in group])
        written += len(batch)
    return written
