"""Workers' sessions: the advisory lock a listening worker holds for as long as its
connection lives, and the sweep's test of it.

A SIGKILLed worker's heartbeat stops, but its leases run on until they expire (the
lease, 60 s by default); its connections, though, end at once, since the kernel closes
them. So a worker holds a session-level advisory lock on its listener's connection,
and the sweep also returns a job whose worker's lock no session holds, once its lease
has missed 1.5 heartbeats (see :func:`lease_over`). Only owners whose name ends with
:data:`SESSION_MARK` are tested: every other owner (a worker with ``listen=False``, an
older version, a claimer of your own) is swept by its lease alone.
"""

from __future__ import annotations

import hashlib
from typing import Any, Final

from sqlalchemy import Integer, Select, String, and_, cast, func, literal, or_, select
from sqlalchemy.dialects.postgresql import OID
from sqlalchemy.sql import column as _sql_column
from sqlalchemy.sql import table as _sql_table
from sqlalchemy.sql.elements import ColumnElement

from ..model import QueueTable
from ._base import OWNER_PARAM, _clock, _param, seconds_interval

__all__ = ["SESSION_MARK", "WORKER_LOCK_SPACE", "hold_worker_lock", "lease_over", "worker_lock_owner"]

#: Ends the name of a worker that holds its session lock (``host:pid:1a2b3c4d~``; its
#: executors claim as ``host:pid:1a2b3c4d~/0.0``, ``…~/1.0``, …).
SESSION_MARK: Final = "~"

#: The first key of every worker's session lock (a 32-bit number from a fixed text, the
#: same in every process); the second is ``hashtext`` of the worker's name. A two-key
#: lock, so no 64-bit advisory lock of the library's (flow, pruning) can be it.
WORKER_LOCK_SPACE: Final = int.from_bytes(hashlib.sha1(b"sqla_queue.worker").digest()[:4], "big", signed=True)

#: How many heartbeats a job's lease must have missed before a sweep returns it for an
#: ended session: the heartbeat of a worker whose listener is reconnecting goes on.
MISSED_BEATS: Final = 1.5

_LOCKS = _sql_table(
    "pg_locks", *(_sql_column(n) for n in ("locktype", "database", "classid", "objid", "objsubid", "granted"))
)
_DATABASES = _sql_table("pg_database", _sql_column("oid"), _sql_column("datname"))


def hold_worker_lock() -> Select[Any]:
    """``SELECT pg_try_advisory_lock(<space>, hashtext(:owner))``: take the session lock
    of the worker named ``OWNER_PARAM`` (its name, ending with :data:`SESSION_MARK`) on
    the connection it keeps for its life. True once held; False while another session
    holds it (the worker's previous connection, not yet ended on the server): try again.
    """
    owner = _param(OWNER_PARAM, String())
    return select(func.pg_try_advisory_lock(literal(WORKER_LOCK_SPACE, Integer()), func.hashtext(owner)))


def worker_lock_owner(lease_owner: ColumnElement[Any]) -> ColumnElement[Any]:
    """The name of the worker whose executor claimed under ``lease_owner``, when that
    worker holds a session lock (its name ends with :data:`SESSION_MARK`); else NULL."""
    pattern = "^(.*" + SESSION_MARK + r")/[0-9]+\.[0-9]+$"
    return func.substring(lease_owner, literal(pattern, String()), type_=String())


def lease_over(qt: QueueTable, *, lease: float | None = None, heartbeat: float | None = None) -> ColumnElement[bool]:
    """A running job the sweep returns: its lease expired, or (given ``lease`` and
    ``heartbeat``, the workers' settings) its worker's session ended.

    A session ended: the job's owner holds a session lock (:func:`worker_lock_owner`),
    no session of this database holds that lock now, and the lease was last extended
    more than :data:`MISSED_BEATS` heartbeats ago (``lease_expires_at`` is earlier than
    ``lease`` less those from now): a live worker whose listener is reconnecting still
    beats. And only once the sweeping session itself has been connected for ``lease``:
    a server restart or a failover ends every worker's session at once, and within that
    time each worker takes its lock again as it reconnects, and its heartbeat resumes.

    One range of the running jobs' lease index either way.
    """
    c = qt.c
    expired: ColumnElement[bool] = c.lease_expires_at < _clock()
    if lease is None or heartbeat is None:
        return expired
    margin = lease - MISSED_BEATS * heartbeat
    if margin <= 0:  # the lease runs out first
        return expired
    worker = worker_lock_owner(c.lease_owner)
    locks = _LOCKS.c
    here = select(_DATABASES.c.oid).where(_DATABASES.c.datname == func.current_database()).scalar_subquery()
    held = select(locks.objid).where(
        locks.locktype == literal("advisory", String()),
        locks.database == here,
        locks.classid == cast(literal(WORKER_LOCK_SPACE, Integer()), OID()),
        locks.objsubid == literal(2, Integer()),
        locks.granted,
    )
    mine = func.pg_stat_get_activity(func.pg_backend_pid()).table_valued("backend_start")
    settled = select(mine.c.backend_start).scalar_subquery() < _clock() - seconds_interval(lease)
    ended = and_(worker.is_not(None), cast(func.hashtext(worker), OID()).not_in(held), settled)
    return and_(c.lease_expires_at < _clock() + seconds_interval(margin), or_(expired, ended))
