"""Inspection, reads only: the job filters, pages of jobs, counts per queue and status,
throughput per minute, lease owners, the listening workers, whether an isolated job waits.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from sqlalchemy import (
    DateTime,
    Float,
    Select,
    String,
    Text,
    and_,
    any_,
    bindparam,
    cast,
    func,
    literal,
    null,
    select,
    true,
    union_all,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql.base import PGDialect, PGIdentifierPreparer
from sqlalchemy.sql import column as _sql_column
from sqlalchemy.sql import table as _sql_table
from sqlalchemy.sql.elements import ColumnElement

from ..model import FINISHED_STATUSES, JobStatus, QueueTable, notify_channel, queue_table, status_literal
from ._base import (
    PENDING,
    RUNNING,
    QueueModel,
    _kind_filter,
    _pk_in,
    _queue_filter,
    _queue_names,
    _status,
    seconds_interval,
)
from ._flow import unpaused

_PG_PREPARER: Final = PGIdentifierPreparer(PGDialect())  # type: ignore[no-untyped-call]


def isolated_waiting(model: QueueModel, *, queues: Sequence[str] | None = None) -> Select[Any]:
    """``SELECT EXISTS`` a runnable isolated job: cheap, served by a tiny partial index."""
    qt = queue_table(model)
    c = qt.c
    found = (
        select(qt.pk)
        .where(
            _status(qt, PENDING), c.isolated, c.run_after <= func.now(), *_queue_filter(qt, queues),
            *unpaused(qt, _queue_names(queues)), *_kind_filter(qt),
        )
        .limit(1)
    )
    return select(found.exists())


def _statuses(statuses: Sequence[JobStatus | str] | None) -> list[JobStatus] | None:
    if statuses is None:
        return None
    if isinstance(statuses, str):
        raise TypeError("statuses must be a sequence of statuses, not a single string")
    try:
        wanted = list(dict.fromkeys(JobStatus(s) for s in statuses))
    except ValueError:
        raise ValueError(
            f"unknown status in {list(statuses)!r} (one of {', '.join(s.value for s in JobStatus)})"
        ) from None
    if not wanted:
        raise ValueError("statuses must name at least one status (or be None for all)")
    return wanted


def job_filter(
    model: QueueModel,
    *,
    ids: Iterable[Any] | None = None,
    queues: Sequence[str] | None = None,
    statuses: Sequence[JobStatus | str] | None = None,
    tasks: Sequence[str] | None = None,
    error_contains: str | None = None,
) -> list[ColumnElement[bool]]:
    """The WHERE conditions of the inspection filters, to compose into a statement of
    your own: ``select(Model).where(*job_filter(Model, statuses=["failed"]))``.

    ``None`` leaves a filter out; a list keeps jobs matching any of its values;
    ``error_contains`` matches ``last_error`` case-insensitively, ``%`` and ``_`` taken
    literally. ``tasks`` needs a task table (:class:`~sqla_queue.TaskMixin`). Statuses
    are inline literals, so the partial indexes of ``pending`` and ``running`` jobs serve.
    """
    return _job_filter(
        queue_table(model), ids=ids, queues=queues, statuses=statuses, tasks=tasks, error_contains=error_contains
    )


def _job_filter(
    qt: QueueTable,
    *,
    ids: Iterable[Any] | None = None,
    queues: Sequence[str] | None = None,
    statuses: Sequence[JobStatus | str] | None = None,
    tasks: Sequence[str] | None = None,
    error_contains: str | None = None,
) -> list[ColumnElement[bool]]:
    c = qt.c
    conditions: list[ColumnElement[bool]] = []
    if ids is not None:
        conditions.append(_pk_in(qt, ids))
    conditions.extend(_queue_filter(qt, queues))
    wanted = _statuses(statuses)
    if wanted is not None:
        column: ColumnElement[str] = c.status
        literals = [status_literal(s) for s in wanted]
        conditions.append(column == literals[0] if len(literals) == 1 else column.in_(literals))
    if tasks is not None:
        if "task" not in c:
            raise ValueError(f"table {qt.table.fullname!r} has no task column: filter by task on a task table")
        if isinstance(tasks, str):
            raise TypeError("tasks must be a sequence of task names, not a single string")
        names = list(dict.fromkeys(tasks))
        if not names:
            raise ValueError("tasks must name at least one task (or be None for all)")
        task: ColumnElement[str] = c.task
        conditions.append(
            task == names[0] if len(names) == 1
            else task == any_(bindparam("tasks", names, type_=ARRAY(c.task.type), unique=True))
        )
    if error_contains is not None:
        if not error_contains:
            raise ValueError("error_contains must not be empty (or be None for any error)")
        error: ColumnElement[str] = c.last_error
        conditions.append(error.icontains(error_contains, autoescape=True))
    conditions.extend(_kind_filter(qt))
    return conditions


def list_jobs(
    model: QueueModel,
    *,
    ids: Iterable[Any] | None = None,
    queues: Sequence[str] | None = None,
    statuses: Sequence[JobStatus | str] | None = None,
    tasks: Sequence[str] | None = None,
    error_contains: str | None = None,
    before: Any = None,
    limit: int = 50,
) -> Select[Any]:
    """A page of jobs, every column, newest key first: the filters of :func:`job_filter`.

    Keyset pagination: pass the key of the last row of a page as ``before`` to get the
    next. The primary key's index is read backwards from there and stops after ``limit``
    matching rows, so a page costs the same on the millionth row as on the first (no
    ``OFFSET``); only a filter that few rows match reads far.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be an integer of at least 1, got {limit!r}")
    qt = queue_table(model)
    conditions = _job_filter(
        qt, ids=ids, queues=queues, statuses=statuses, tasks=tasks, error_contains=error_contains
    )
    if before is not None:
        conditions.append(qt.pk < bindparam("before", before, type_=qt.pk.type))
    return select(qt.table).where(*conditions).order_by(qt.pk.desc()).limit(limit)


def get_job(model: QueueModel, job_id: Any) -> Select[Any]:
    """One job, every column (the user's own too), by key."""
    qt = queue_table(model)
    return select(qt.table).where(qt.pk == bindparam("job_id", job_id, type_=qt.pk.type))


def finished_per_minute(model: QueueModel, *, minutes: int = 60) -> Select[Any]:
    """``(queue, minute, status, jobs)``: jobs that finished (``done``, ``failed``,
    ``cancelled``) in each of the last ``minutes`` minutes, by queue; the throughput and
    failure chart of the dashboard. Minutes without a finished job have no row."""
    if isinstance(minutes, bool) or not isinstance(minutes, int) or minutes < 1:
        raise ValueError(f"minutes must be an integer of at least 1, got {minutes!r}")
    qt = queue_table(model)
    c = qt.c
    minute = func.date_trunc("minute", c.finished_at, type_=DateTime(timezone=True)).label("minute")
    return (
        select(c.queue, minute, c.status, func.count().label("jobs"))
        .where(
            c.status.in_([status_literal(s) for s in FINISHED_STATUSES]),
            c.finished_at >= func.date_trunc("minute", func.now()) - seconds_interval((minutes - 1) * 60.0),
            *_kind_filter(qt),
        )
        .group_by(c.queue, minute, c.status)
        .order_by(c.queue, minute, c.status)
    )


def lease_owners(model: QueueModel) -> Select[Any]:
    """``(lease_owner, jobs, oldest_lease, latest_lease)``: each worker name holding
    running jobs, how many, and the earliest and latest ``lease_expires_at`` among them.
    Every heartbeat pushes the leases it holds forward, so the latest expiry minus the
    worker's lease is its last heartbeat; an oldest lease in the past is a worker that
    stopped heartbeating (the sweeper will return its jobs). Served by the partial index
    of running jobs' leases."""
    qt = queue_table(model)
    c = qt.c
    return (
        select(
            c.lease_owner,
            func.count().label("jobs"),
            func.min(c.lease_expires_at).label("oldest_lease"),
            func.max(c.lease_expires_at).label("latest_lease"),
        )
        .where(_status(qt, RUNNING), *_kind_filter(qt))
        .group_by(c.lease_owner)
        .order_by(c.lease_owner)
    )


def listening_workers(
    model: QueueModel, schema_translate_map: Mapping[str | None, str | None] | None = None
) -> Select[Any]:
    """``(pid, application_name, client, connected_at, last_active)``: the connections
    of this database that wait for ``model``'s jobs, one per live worker listening to
    its channel (under the engine's ``schema_translate_map``), oldest first.

    A worker's listener runs ``LISTEN`` and waits, so its last statement in
    ``pg_stat_activity`` is that ``LISTEN`` for as long as the worker lives, idle or
    busy: the live workers without a table of their own. Not seen: workers started
    with ``listen=False`` (behind a transaction pooler), and every worker when the
    reading role may not see other roles' statements (grant it ``pg_read_all_stats``).
    """
    channel = notify_channel(queue_table(model).table, schema_translate_map)
    activity = _sql_table(
        "pg_stat_activity", *(_sql_column(name) for name in (
            "pid", "datname", "application_name", "client_addr", "client_port", "backend_start", "state_change",
            "query",
        ))
    )
    a = activity.c
    client = func.coalesce(func.host(a.client_addr) + ":" + cast(a.client_port, String), "local socket")
    return (
        select(
            a.pid,
            a.application_name,
            client.label("client"),
            a.backend_start.label("connected_at"),
            a.state_change.label("last_active"),
        )
        .where(
            a.datname == func.current_database(),
            a.pid != func.pg_backend_pid(),
            a.query == literal('LISTEN "' + channel.replace('"', '""') + '"', String),
        )
        .order_by(a.backend_start, a.pid)
    )


def queue_stats(model: QueueModel) -> Select[Any]:
    """Jobs per queue and status, with the age of the oldest runnable pending job."""
    qt = queue_table(model)
    c = qt.c
    runnable = and_(_status(qt, PENDING), c.run_after <= func.now())
    return (
        select(
            c.queue,
            c.status,
            func.count().label("jobs"),
            (func.now() - func.min(c.run_after).filter(runnable)).label("oldest_runnable_age"),
        )
        .group_by(c.queue, c.status)
        .order_by(c.queue, c.status)
    )


#: The statuses :func:`queue_depth` counts unless told: each has a partial index, so the
#: count reads only their rows, however many finished jobs the table keeps.
DEPTH_STATUSES: Final = (PENDING, RUNNING)

_PG_STAT_USER_TABLES = _sql_table("pg_stat_user_tables", _sql_column("relid"), _sql_column("n_dead_tup"))


def queue_depth(
    model: QueueModel,
    *,
    statuses: Sequence[JobStatus | str] = DEPTH_STATUSES,
    regclass: str | None = None,
) -> Select[Any]:
    """Jobs per queue and status among ``statuses``, the oldest runnable job's age per
    queue (``oldest_runnable_seconds``, on the ``pending`` rows), and the table's dead
    tuples (``pg_stat_user_tables.n_dead_tup``, the same on every row): what the
    Prometheus gauges and the dashboard's overview show, in one cheap statement.

    Rows ``(queue, status, jobs, oldest_runnable_seconds, dead_tuples)``, ordered by
    queue and status; an empty table gives one row whose queue and status are NULL (its
    dead tuples still told). Each status is counted on its own, so ``pending`` and
    ``running`` read only their partial indexes' rows; ``done`` or ``failed`` read the
    whole table unless you give them an index of their own. ``regclass``: the table's
    name as PostgreSQL should look it up (default: the model's, quoted; pass the
    translated one under a ``schema_translate_map``).
    """
    qt = queue_table(model)
    c = qt.c
    if not statuses:
        raise ValueError("queue_depth needs at least one status")
    parts: list[Select[Any]] = []
    for status in dict.fromkeys(JobStatus(s) for s in statuses):
        if status is PENDING:
            oldest: ColumnElement[Any] = func.extract(
                "epoch", func.now() - func.min(c.run_after).filter(c.run_after <= func.now())
            )
        else:
            oldest = cast(null(), Float)
        parts.append(
            select(
                c.queue.label("queue"),
                status_literal(status).label("status"),
                func.count().label("jobs"),
                cast(oldest, Float).label("oldest_runnable_seconds"),
            )
            .where(_status(qt, status))
            .group_by(c.queue)
        )
    groups = (parts[0] if len(parts) == 1 else union_all(*parts)).subquery("depth")
    if regclass is None:
        preparer = _PG_PREPARER
        table = qt.table
        regclass = (f"{preparer.quote(table.schema)}.{preparer.quote(table.name)}" if table.schema
                    else preparer.quote(table.name))
    stat = _PG_STAT_USER_TABLES.c
    dead_tuples = select(stat.n_dead_tup).where(stat.relid == func.to_regclass(literal(regclass, Text)))
    dead = select(func.coalesce(dead_tuples.scalar_subquery(), 0).label("dead_tuples")).subquery("dead")
    return (
        select(groups.c.queue, groups.c.status, groups.c.jobs, groups.c.oldest_runnable_seconds, dead.c.dead_tuples)
        .select_from(dead.outerjoin(groups, true()))
        .order_by(groups.c.queue, groups.c.status)
    )
