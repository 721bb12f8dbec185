"""The outbox: the wake-up (NOTIFY) of the enqueue side, sent when the caller commits.

A job enqueued in a transaction must wake its workers only if that transaction commits.
``pg_notify`` issued inside the transaction does exactly that: PostgreSQL delivers it on
commit, never on rollback, and identical notifications of one transaction once. This
module records the queues a session's transaction wrote to (``enqueue()``, a plain
``session.add()`` of a queue object, ``enqueue_many()``, :func:`notify_on_commit`) and
sends their NOTIFY from the session's ``before_commit`` hook; on psycopg in the COMMIT's
own round trip (:func:`notify_with_commit`). ``enqueue_values()`` needs none of it: its
INSERT carries its NOTIFY. A model declaring ``__queue_wake__ = "after_commit"`` has its
wake-ups handed to the waker once the COMMIT returned instead (:mod:`sqla_queue.waker`),
one declaring ``"none"`` sends none.
Nothing here knows the worker.
"""

from __future__ import annotations

import weakref
from contextlib import suppress
from typing import Any, Final

import psycopg
from psycopg import sql as pgsql
from sqlalchemy import Connection, Engine, Select, String, bindparam, event, select
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session
from sqlalchemy.orm import attributes as orm_attributes

from ..cache import plans
from ..errors import EnqueueError
from ..model import WAKE_AFTER_COMMIT, WAKE_NONE, notify_channel, queue_table, wake_mode
from ..sql._notify import notify_sql, pg_notify
from .binds import sync_session
from .rows import default_queue, queue_table_of
from .waker import wake_after_commit

__all__ = [
    "awaited",
    "expect_await",
    "hook_session_class",
    "install_hooks",
    "notify_on_commit",
    "notify_with_commit",
    "wake_after",
]

_NOTIFY_KEY: Final = "sqla_queue.notify"
_HOOKED_KEY: Final = "sqla_queue.hooked"
_UNAWAITED_KEY: Final = "sqla_queue.unawaited"
#: Keys of the outbox's statements in the shared cache.
_NOTIFY_SELECT: Final = "sqla_queue.outbox.select"
_NOTIFY_AND_COMMIT: Final = "sqla_queue.outbox.commit"


def notify_on_commit(session: Any, model: Any, queue: str) -> None:
    """Wake ``queue``'s workers when ``session`` commits.

    ``enqueue()`` and ``session.add()`` of queue objects do this by themselves; call it
    after inserting jobs some other way (Core ``insert()``, raw SQL) in the session.
    """
    sync = sync_session(session)
    qt = queue_table(model)
    install_hooks(sync)
    _pending(sync).add((qt.table, qt.channel, queue))


#: Session classes whose every session has the hooks (:func:`hook_session_class`).
_hooked_classes: tuple[type[Session], ...] = ()


def hook_session_class(cls: type[Session]) -> None:
    """Give every session of ``cls`` the outbox's hooks (``QueueSession`` has them)."""
    global _hooked_classes
    if not issubclass(cls, _hooked_classes):
        _listen(cls)
        _hooked_classes = (*_hooked_classes, cls)


def install_hooks(session: Session) -> None:
    """Make ``session`` send NOTIFY on commit for the queue objects it inserts."""
    if isinstance(session, _hooked_classes) or session.info.get(_HOOKED_KEY):
        return
    _listen(session)
    session.info[_HOOKED_KEY] = True


def _listen(target: Any) -> None:
    event.listen(target, "before_flush", _before_flush)
    event.listen(target, "before_commit", _before_commit)
    event.listen(target, "after_transaction_end", _after_transaction_end)


def _pending(session: Session) -> set[tuple[Any, str, str]]:
    pending: set[tuple[Any, str, str]] = session.info.setdefault(_NOTIFY_KEY, set())
    return pending


def _record_new_jobs(session: Session) -> None:
    for obj in session.new:
        qt = queue_table_of(obj)
        if qt is not None:
            values = orm_attributes.instance_state(obj).dict
            if values.get("waiting_on"):
                continue  # a workflow's job that waits: the statement that releases it wakes its queue
            queue = values.get("queue")
            if queue is None:
                queue = default_queue(qt.table)
            _pending(session).add((qt.table, qt.channel, queue))


def _before_flush(session: Session, flush_context: Any, instances: Any) -> None:
    _record_new_jobs(session)


def expect_await(session: Session, call: Any, what: str) -> None:
    """Record ``call``, a coroutine of writes ``session``'s transaction must not commit
    without: until :func:`awaited` says it ran, a commit raises
    :class:`~sqla_queue.EnqueueError` naming ``what``."""
    install_hooks(session)
    session.info.setdefault(_UNAWAITED_KEY, {})[call] = what


def awaited(session: Session, call: Any) -> None:
    """``call`` (of :func:`expect_await`) runs, or was closed on purpose."""
    waiting = session.info.get(_UNAWAITED_KEY)
    if waiting:
        waiting.pop(call, None)


def _refuse_unawaited(session: Session) -> None:
    waiting = session.info.get(_UNAWAITED_KEY)
    if waiting:
        calls = "; ".join(list(waiting.values())[:3]) + ("; …" if len(waiting) > 3 else "")
        raise EnqueueError(
            f"{len(waiting)} enqueue(..., unique_key=...) call(s) of this AsyncSession were never awaited, so "
            f"their jobs were never inserted ({calls}): await them before the commit, or roll back"
        )


def _before_commit(session: Session) -> None:
    # A keyed enqueue of an AsyncSession that was never awaited wrote nothing: committing
    # the rest would lose its job silently.
    _refuse_unawaited(session)
    # before_commit runs before commit's final flush: record the jobs about to flush.
    _record_new_jobs(session)
    # It also runs when a SAVEPOINT commits (begin_nested()), and a NOTIFY sent there is
    # lost if that savepoint then fails: only the outermost commit may consume the set.
    # The hook cannot tell which transaction is committing (a root commit with a
    # savepoint still open also runs it inside the savepoint), so a nested one sends too
    # but keeps the set for the outermost, which sends again; PostgreSQL delivers the
    # identical notifications of one transaction once.
    nested = session.in_nested_transaction()
    pending = session.info.get(_NOTIFY_KEY) if nested else session.info.pop(_NOTIFY_KEY, None)
    if not pending:
        return
    by_bind: dict[Any, tuple[Any, set[tuple[Any, str]]]] = {}
    for table, _channel, queue in pending:
        bind = session.get_bind(clause=table)
        if bind.dialect.name == "postgresql":
            by_bind.setdefault(bind, (table, set()))[1].add((table, queue))
    for table, jobs in by_bind.values():
        conn = session.connection(bind_arguments={"clause": table})
        # The channel of the schema the connection's schema_translate_map puts each
        # table in: the one its workers listen on.
        translate = conn.get_execution_options().get("schema_translate_map")
        pairs: set[tuple[str, str]] = set()
        after: set[tuple[str, str]] = set()
        for t, queue in jobs:
            mode = wake_mode(t)
            if mode != WAKE_NONE:
                (after if mode == WAKE_AFTER_COMMIT else pairs).add((notify_channel(t, translate), queue))
        if not pairs and not after:
            continue
        if notify_with_commit(conn, pairs, after=after):
            continue  # sent in the COMMIT's own round trip, or handed to the waker after it
        pairs |= after  # another driver: in the transaction, as for every table
        # One statement per database, whatever the number of jobs; on the connection,
        # not session.execute(), which would autoflush from inside before_commit.
        params: dict[str, str] = {}
        for n, (channel, queue) in enumerate(sorted(pairs)):
            params[f"sqla_queue_channel_{n}"] = channel
            params[f"sqla_queue_queue_{n}"] = queue
        conn.execute(_notify_statement(len(pairs)), params)


def _notify_statement(count: int) -> Select[Any]:
    """``SELECT pg_notify(:channel_0, :queue_0), …`` for ``count`` pairs, built once.

    Reusing the statement object (and its cache key) saves more Python time per
    one-job transaction than the NOTIFY's round trip takes on a nearby server.
    """
    key = (_NOTIFY_SELECT, count)
    statement: Select[Any] | None = plans.get(key)
    if statement is None:
        statement = plans.put(
            key,
            select(
                *(
                    pg_notify(
                        bindparam(f"sqla_queue_channel_{n}", type_=String()),
                        bindparam(f"sqla_queue_queue_{n}", type_=String()),
                    )
                    for n in range(count)
                )
            ),
        )
    return statement


def _after_transaction_end(session: Session, transaction: Any) -> None:
    if transaction.parent is None:
        session.info.pop(_NOTIFY_KEY, None)
        session.info.pop(_UNAWAITED_KEY, None)  # rolled back: nothing of it is kept anyway


# -- NOTIFY in the COMMIT's round trip ----------------------------------------------------

_ON_COMMIT_KEY: Final = "sqla_queue.notify_with_commit"


def notify_with_commit(
    conn: Connection, pairs: set[tuple[str, str]], *, after: set[tuple[str, str]] | None = None
) -> bool:
    """Send ``pg_notify(channel, payload)`` for ``pairs`` together with the COMMIT of the
    transaction ``conn`` is in, in one round trip (one simple-protocol query, on psycopg
    and its asyncio flavour alike), and hand ``after`` to the waker once that COMMIT
    returned (:mod:`sqla_queue.waker`); False when the driver cannot (then send them
    yourself). PostgreSQL delivers them only if it commits.
    """
    if conn.dialect.driver != "psycopg":
        return False
    root = conn.get_transaction()  # the outermost transaction, inside a savepoint too
    if root is None:
        return False
    info = conn.info
    waiting: tuple[Any, set[tuple[str, str]], set[tuple[str, str]]] | None = info.get(_ON_COMMIT_KEY)
    if waiting is None or waiting[0] is not root:
        waiting = info[_ON_COMMIT_KEY] = (root, set(), set())
    waiting[1].update(pairs)
    if after:
        waiting[2].update(after)
    _listen_for_commits(conn.engine)
    return True


def wake_after(conn: Connection, pairs: set[tuple[str, str]]) -> None:
    """Wake ``pairs`` once the transaction ``conn`` is in commits (psycopg): at once when
    its connection autocommits, so what was written is committed already."""
    pooled: Any = conn.connection.dbapi_connection
    raw = pooled.driver_connection if conn.dialect.is_async else pooled
    if raw.autocommit:
        wake_after_commit(raw, pairs)
    else:
        notify_with_commit(conn, set(), after=pairs)


def _on_commit(conn: Connection) -> None:
    waiting = conn.info.pop(_ON_COMMIT_KEY, None)
    if waiting is None or waiting[0] is not conn.get_transaction():
        return
    raw: Any = conn.connection.dbapi_connection
    try:
        if waiting[1]:
            # One simple-protocol query: the notifications and the COMMIT in one round trip.
            query = _notify_and_commit(tuple(sorted(waiting[1])))
            if conn.dialect.is_async:  # SQLAlchemy's adapter: run it on the asyncio connection
                raw.run_async(lambda driver_conn: driver_conn.execute(query))
            else:
                raw.execute(query)
        elif conn.dialect.is_async:  # wake-ups for after the commit only: commit it here
            raw.run_async(lambda driver_conn: driver_conn.commit())
        else:
            raw.commit()
    except psycopg.Error as exc:
        raise sa_exc.DBAPIError.instance(
            "COMMIT", None, exc, psycopg.Error, dialect=conn.dialect
        ) from exc
    # The connection is committed: SQLAlchemy's own commit() that follows is a no-op.
    if waiting[2]:
        wake_after_commit(raw.driver_connection if conn.dialect.is_async else raw, waiting[2])


def _notify_and_commit(pairs: tuple[tuple[str, str], ...]) -> bytes:
    """``SELECT pg_notify('c', 'q'); …; COMMIT`` with quoted literals, built once per set."""
    key = (_NOTIFY_AND_COMMIT, pairs)
    query: bytes | None = plans.get(key)
    if query is None:
        query = plans.put(key, _build_notify_and_commit(pairs))
    return query


def _build_notify_and_commit(pairs: tuple[tuple[str, str], ...]) -> bytes:
    return pgsql.SQL("{}; COMMIT").format(notify_sql(pairs)).as_bytes(None)


def _on_rollback(conn: Connection) -> None:
    with suppress(Exception):  # an invalidated connection has no info left to clear
        conn.info.pop(_ON_COMMIT_KEY, None)


#: Engines with the commit hooks. Weak, not ``id()``: a new engine may sit at the
#: address of a dropped one, and would then never send its wake-ups.
_listening: weakref.WeakSet[Engine] = weakref.WeakSet()


def _listen_for_commits(engine: Engine) -> None:
    if engine in _listening:
        return
    if not event.contains(engine, "commit", _on_commit):
        event.listen(engine, "commit", _on_commit)
        event.listen(engine, "rollback", _on_rollback)
    _listening.add(engine)
