"""Administrative operations over a queue table, shared by both command lines.

Each runs the statement builders in short transactions until the work is done, so a
large backlog never holds locks for long.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import BigInteger, Connection, Engine, Row, SmallInteger, func, select, text

from . import sql as q
from .cancel import cancel as _cancel
from .driver import WorkerStartError
from .flow import declared_queues_table
from .model import JobStatus, flow_rules, queue_table, table_problem, translated_schema
from .pause import pause as _pause
from .pause import resume as _resume
from .pause import set_queue_limits as _set_queue_limits
from .periodic import Schedule, schedules_table
from .rules import Concurrency, FlowRule, RateLimit

__all__ = [
    "JobFilters",
    "JobPage",
    "LeaseOwner",
    "QueueCount",
    "QueueDepth",
    "QueueSummary",
    "RuleView",
    "cancel",
    "cancel_jobs",
    "check_table",
    "delete_jobs",
    "format_job",
    "format_jobs",
    "format_schedules",
    "describe_rule",
    "flow_view",
    "format_stats",
    "get_job",
    "key_holders",
    "lease_owners",
    "list_jobs",
    "pause_queues",
    "paused_queues",
    "parse_job_id",
    "queue_depth",
    "queue_overview",
    "prune",
    "requeue",
    "resume_queues",
    "schedule_rows",
    "stats_json",
    "sweep",
]

_COLUMNS = text(
    "SELECT a.attname FROM pg_attribute a "
    "WHERE a.attrelid = to_regclass(:name) AND a.attnum > 0 AND NOT a.attisdropped"
)


def check_table(engine: Engine, model: Any) -> None:
    """Raise :class:`~sqla_queue.WorkerStartError`, in the worker's words, when ``model``'s
    table is missing from the database or lacks the queue columns.

    Run before a command, it turns the database's "relation ... does not exist" into what
    to do about it: create the table, or migrate it.
    """
    table = queue_table(model).table
    with engine.connect() as conn:
        schema = table.schema
        translate = conn.get_execution_options().get("schema_translate_map")
        if translate and schema in translate:
            schema = translate[schema]
        quote = conn.dialect.identifier_preparer.quote
        name = f"{quote(schema)}.{quote(table.name)}" if schema else quote(table.name)
        columns = list(conn.scalars(_COLUMNS, {"name": name}))
    problem = table_problem(f"{schema}.{table.name}" if schema else table.name, columns)
    if problem is not None:
        raise WorkerStartError(problem)


def sweep(engine: Engine, model: Any, *, limit: int = 1000) -> tuple[int, int]:
    """Sweep every expired lease; returns (back to pending, dead-lettered)."""
    back = dead = 0
    while True:
        with engine.begin() as conn:
            rows: list[Any] = list(conn.execute(q.sweep_expired(model, limit=limit), q.wake_values(model, conn)).all())
        dead += sum(1 for row in rows if row[1] == "failed")
        back += sum(1 for row in rows if row[1] != "failed")
        if len(rows) < limit:
            return back, dead


@dataclass(frozen=True)
class JobFilters:
    """The inspection filters, as both command lines and the dashboard take them: each
    empty tuple (or ``None``) leaves its filter out, several values match any of them."""

    queues: tuple[str, ...] = ()
    statuses: tuple[str, ...] = ()
    tasks: tuple[str, ...] = ()
    error_contains: str | None = None
    ids: tuple[Any, ...] = ()

    def builder_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`sqla_queue.sql.job_filter` and its users."""
        return {
            "ids": list(self.ids) or None,
            "queues": list(self.queues) or None,
            "statuses": list(self.statuses) or None,
            "tasks": list(self.tasks) or None,
            "error_contains": self.error_contains or None,
        }

    @property
    def empty(self) -> bool:
        return not (self.queues or self.statuses or self.tasks or self.error_contains or self.ids)


@dataclass(frozen=True)
class JobPage:
    """One page of :func:`list_jobs`: its rows (every column, newest first) and the key
    to pass as ``before`` for the next page (None on the last)."""

    rows: list[Row[Any]]
    next_before: Any = None
    columns: list[str] = field(default_factory=list)


def listed_columns(model: Any) -> list[str]:
    """The columns :func:`format_jobs` shows: a listing reads those only, never a
    payload (which may be megabytes per job, and is shown by ``show``)."""
    qt = queue_table(model)
    task = ["task"] if "task" in qt.c else []
    return [qt.pk.name, "queue", "status", *task, "attempts", "max_attempts", "run_after", "last_error"]


def list_jobs(
    engine: Engine, model: Any, filters: JobFilters = JobFilters(), *, before: Any = None, limit: int = 50,
    columns: Sequence[str] | None = None,
) -> JobPage:
    """A page of jobs matching ``filters``, after the key ``before`` (keyset pagination):
    every column, or ``columns`` only (the key among them)."""
    stmt = q.list_jobs(model, **filters.builder_kwargs(), before=before, limit=limit + 1)
    if columns is not None:
        qt = queue_table(model)
        stmt = stmt.with_only_columns(*(qt.c[name] for name in dict.fromkeys([qt.pk.name, *columns])))
    with engine.connect() as conn:
        result = conn.execute(stmt)
        columns = list(result.keys())
        rows = list(result.all())
    pk = queue_table(model).pk.name
    if len(rows) > limit:
        rows = rows[:limit]
        return JobPage(rows, rows[-1]._mapping[pk], columns)
    return JobPage(rows, None, columns)


def get_job(engine: Engine, model: Any, job_id: Any) -> Row[Any] | None:
    """One job's row, every column, or None."""
    with engine.connect() as conn:
        return conn.execute(q.get_job(model, job_id)).first()


def parse_job_id(model: Any, value: str) -> Any:
    """A job key typed on a command line or in a URL, as the primary key's Python type
    (an int, a UUID, a string); ValueError when it cannot be one."""
    column = queue_table(model).pk
    try:
        kind = column.type.python_type
    except NotImplementedError:
        return value
    if kind is int:
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"not a job id (a whole number): {value!r}") from None
        # Beyond the column's integer type the server answers with a DataError (and
        # aborts the transaction) instead of finding no job: refuse it here.
        bits = 64 if isinstance(column.type, BigInteger) else 16 if isinstance(column.type, SmallInteger) else 32
        if not -(2 ** (bits - 1)) <= number < 2 ** (bits - 1):
            raise ValueError(f"not a job id (out of range of the {bits}-bit key): {value!r}")
        return number
    if kind is uuid.UUID:
        try:
            return uuid.UUID(value)
        except ValueError:
            raise ValueError(f"not a job id (a UUID): {value!r}") from None
    return value


def requeue(
    engine: Engine,
    model: Any,
    *,
    ids: Sequence[Any] | None = None,
    queues: Sequence[str] | None = None,
    tasks: Sequence[str] | None = None,
    error_contains: str | None = None,
    statuses: Sequence[str] = ("failed",),
) -> int:
    """Give dead-lettered (and, with ``statuses``, cancelled) jobs fresh attempts;
    returns how many.

    ``ids=None`` means every such job (of ``queues``, ``tasks``, with ``error_contains``
    in ``last_error``), an empty ``ids`` none at all. ``statuses``: ``failed`` (the
    default) and/or ``cancelled``.
    """
    stmt = q.requeue_failed(
        model, ids=ids, queues=queues or None, tasks=tasks or None, error_contains=error_contains or None,
        statuses=statuses,
    )
    with engine.begin() as conn:
        return len(conn.scalars(stmt).all())


def cancel(
    engine: Engine, model: Any, *, ids: Sequence[Any] | None = None, queues: Sequence[str] | None = None,
    workflow: uuid.UUID | None = None,
) -> list[Any]:
    """Cancel pending and running jobs (:func:`sqla_queue.cancel`; ``workflow``: every
    unfinished job of one) in a transaction of its own; returns the keys cancelled."""
    with engine.begin() as conn:
        return _cancel(conn, model, ids=ids, queues=queues or None, workflow=workflow)


def cancel_jobs(engine: Engine, model: Any, *, ids: Sequence[Any]) -> int:
    """Cancel the jobs ``ids``, pending or running (:func:`sqla_queue.cancel`); returns
    how many.

    The one place the command lines and the dashboard cancel through.
    """
    return len(cancel(engine, model, ids=ids))


def delete_jobs(
    engine: Engine, model: Any, filters: JobFilters, *, limit: int = 10_000, free_keys: bool = False
) -> int:
    """Delete the jobs matching ``filters`` (never running ones), ``limit`` per
    transaction; returns how many. Empty filters are refused: that would be every job.

    Finished jobs still holding a unique key (``done`` under ``UNIQUE_EVER``) are kept
    unless ``free_keys=True`` (see :func:`key_holders`): deleting one lets the same work
    be enqueued, and run, again."""
    if filters.empty:
        raise ValueError("name the jobs to delete: ids, or at least one filter")
    total = 0
    while True:
        stmt = q.delete_jobs(model, **filters.builder_kwargs(), limit=limit, free_keys=free_keys)
        with engine.begin() as conn:
            deleted = len(conn.scalars(stmt).all())
        total += deleted
        if deleted < limit:
            return total


def key_holders(engine: Engine, model: Any, filters: JobFilters) -> int:
    """How many jobs matching ``filters`` finished but still hold their unique key: what
    :func:`delete_jobs` keeps unless told ``free_keys=True`` (0 when the model's
    :class:`~sqla_queue.UniqueJobs` keeps no key past running)."""
    kept = q.keeps_unique_key(model)
    if kept is None:
        return 0
    qt = queue_table(model)
    stmt = select(func.count()).select_from(qt.table).where(*q.job_filter(model, **filters.builder_kwargs()), kept)
    with engine.connect() as conn:
        return int(conn.scalar(stmt) or 0)


def prune(
    engine: Engine,
    model: Any,
    *,
    older_than: timedelta,
    statuses: Sequence[str] = ("done", "cancelled"),
    limit: int = 10_000,
) -> int:
    """Delete finished jobs older than ``older_than``, ``limit`` per transaction (never
    one still holding a unique key: :func:`sqla_queue.sql.keeps_unique_key`)."""
    total = 0
    while True:
        stmt = q.prune_finished(model, older_than=older_than, statuses=statuses, limit=limit)
        with engine.begin() as conn:
            deleted = int(conn.execute(stmt).rowcount)
        total += deleted
        if deleted < limit:
            return total


def pause_queues(engine: Engine, model: Any, queues: Sequence[str]) -> list[tuple[str, bool]]:
    """Pause ``queues`` (:func:`sqla_queue.pause`) in one transaction of its own: each
    queue with whether this call paused it (False: it was paused already)."""
    with engine.begin() as conn:
        return [(queue, _pause(conn, model, queue)) for queue in dict.fromkeys(queues)]


def resume_queues(engine: Engine, model: Any, queues: Sequence[str]) -> list[tuple[str, bool]]:
    """Resume ``queues`` (:func:`sqla_queue.resume`), as :func:`pause_queues` pauses them."""
    with engine.begin() as conn:
        return [(queue, _resume(conn, model, queue)) for queue in dict.fromkeys(queues)]


def paused_queues(engine: Engine, model: Any) -> dict[str, datetime]:
    """Each paused queue of ``model``'s table and since when; empty when the table has no
    queues table declared (nothing can be paused)."""
    if declared_queues_table(queue_table(model).table) is None:
        return {}
    with engine.connect() as conn:
        return {row.queue: row.paused_at for row in conn.execute(q.paused_queues(model))}


def set_queue_limits(
    engine: Engine, model: Any, queues: Sequence[str], *, concurrency: int | None, rate: int | None
) -> None:
    """Set the limits of ``queues`` (:func:`sqla_queue.set_queue_limits`) in one
    transaction of its own."""
    with engine.begin() as conn:
        for queue in dict.fromkeys(queues):
            _set_queue_limits(conn, model, queue, concurrency=concurrency, rate=rate)


def queue_limits(engine: Engine, model: Any) -> dict[str, tuple[int | None, int | None]]:
    """``{queue: (concurrency, rate)}`` of each queue with limits of its own set at run
    time; empty when the table has no queues table declared."""
    if declared_queues_table(queue_table(model).table) is None:
        return {}
    with engine.connect() as conn:
        return {row.queue: (row.concurrency, row.rate) for row in conn.execute(q.queue_limits(model))}


def describe_queue_limits(concurrency: int | None, rate: int | None, rules: Sequence[FlowRule]) -> str:
    """A queue's own limits in words: ``at most 2 running, at most 50 starts in 1 s``; a
    limit whose rule the model no longer declares is said to be unused (claims ignore it)."""
    words = []
    if concurrency is not None:
        declared = any(isinstance(r, Concurrency) and r.key == "queue" for r in rules)
        words.append(f"at most {concurrency} running" + ("" if declared else " (unused: no Concurrency on the queue)"))
    if rate is not None:
        per = next((r.seconds for r in rules if isinstance(r, RateLimit) and r.key == "queue"), None)
        words.append(f"at most {rate} starts in {per:g} s" if per is not None
                     else f"{rate} starts (unused: no RateLimit on the queue)")
    return ", ".join(words)


@dataclass(frozen=True)
class RuleView:
    """One flow rule of a queue table, in words, and the keys nearest its limit now."""

    rule: str
    busiest: list[tuple[Any, int]]


def flow_view(engine: Engine, model: Any) -> list[RuleView]:
    """The table's flow rules, each in words with its busiest keys (what the rule counts,
    per key; for a rule without a key, the table's count)."""
    rules = flow_rules(queue_table(model).table)
    if not rules:
        return []
    views = []
    with engine.connect() as conn:
        for rule in rules:
            busiest = [(key, int(n)) for key, n in conn.execute(q.rule_counts(model, rule))]
            views.append(RuleView(describe_rule(rule), busiest))
    return views


def describe_rule(rule: FlowRule) -> str:
    """A flow rule in words: ``at most 3 running per account``."""
    scope = f"per {rule.key}" if rule.key is not None else "in the table"
    if isinstance(rule, Concurrency):
        return f"at most {rule.limit} running {scope}"
    if isinstance(rule, RateLimit):
        return f"at most {rule.limit} starts in {rule.seconds:g} s {scope}{' (strict)' if rule.strict else ''}"
    blocks = "a dead letter blocks its key" if rule.on_dead_letter == "block" else "a dead letter is skipped"
    return f"one at a time in enqueue order {scope} ({blocks}; pending shown)"


def format_stats(engine: Engine, model: Any) -> str:
    """Jobs per queue and status, and the oldest runnable job's age, as a text table;
    then the paused queues, if any."""
    with engine.connect() as conn:
        rows = conn.execute(q.queue_stats(model)).all()
    paused = paused_queues(engine, model)
    note = "".join(f"\npaused: {queue} (since {_moment(at)})" for queue, at in paused.items())
    for view in flow_view(engine, model):
        busiest = ", ".join(f"{n}" if key is None else f"{key} {n}" for key, n in view.busiest) or "none running"
        note += f"\nrule: {view.rule} (busiest now: {busiest})"
    rules = flow_rules(queue_table(model).table)
    for queue, (concurrency, rate) in queue_limits(engine, model).items():
        note += f"\nlimits of queue {queue}: {describe_queue_limits(concurrency, rate, rules)}"
    if not rows:
        return "(no jobs)" + note
    header = ("queue", "status", "jobs", "oldest runnable")
    table = [header] + [(r.queue, r.status, str(r.jobs), _age(r.oldest_runnable_age)) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in table]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines) + note


def format_schedules(
    engine: Engine,
    model: Any,
    schedules: Sequence[Schedule],
    *,
    now: datetime | None = None,
    code_known: bool = True,
) -> str:
    """Each schedule of the code (``schedules``) and of the table's watermark rows, with
    its last tick enqueued and its next tick, as a text table. A row whose schedule is no
    longer in the code shows ``(not in code)``: it is harmless, and ticks no more.

    ``code_known=False`` when the code's schedules could not be read (a queue model was
    given, not its worker): the rows then show their last tick only, and a closing line
    says how to see the rest, rather than calling live schedules ``(not in code)``."""
    now = now or datetime.now(UTC)
    rows = schedule_rows(engine, model) or {}
    if not schedules and not rows:
        return "(no schedules)"
    header = ("schedule", "when", "timezone", "last tick", "next tick")
    lines: list[tuple[str, ...]] = [header]
    for schedule in sorted(schedules, key=lambda s: s.name):
        row = rows.get(schedule.name)
        paused = row is not None and row.paused_at is not None
        lines.append((
            schedule.name, schedule.expression, schedule.timezone,
            _moment(row.last_tick) if row is not None else "-",
            "(paused)" if paused else _moment(schedule.next_tick(now)),
        ))
    known = {s.name for s in schedules}
    for name, row in rows.items():
        if name not in known:
            lines.append((name, "(not in code)" if code_known else "?", "-", _moment(row.last_tick), "-"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text_lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    text_lines.insert(1, "  ".join("-" * w for w in widths))
    if not code_known:
        text_lines.append("(the schedules in code are unknown: give the worker, not the model, to see them)")
    return "\n".join(text_lines)


def schedule_rows(engine: Engine, model: Any) -> dict[str, Row[Any]] | None:
    """The watermark row of each schedule of ``model``'s table, by name
    (:func:`~sqla_queue.sql.schedule_states`); None when the table does not exist."""
    table = schedules_table(model)
    with engine.connect() as conn:
        exists = conn.scalar(text("SELECT to_regclass(:name) IS NOT NULL"), {"name": _regclass(conn, table)})
        return {r.name: r for r in conn.execute(q.schedule_states(model))} if exists else None


def _regclass(conn: Any, table: Any) -> str:
    schema = table.schema
    translate = conn.get_execution_options().get("schema_translate_map")
    if translate and schema in translate:
        schema = translate[schema]
    quote = conn.dialect.identifier_preparer.quote
    return f"{quote(schema)}.{quote(table.name)}" if schema else str(quote(table.name))


def _moment(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _age(age: timedelta | None) -> str:
    if age is None:
        return "-"
    seconds = max(age.total_seconds(), 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.1f}s"


@dataclass(frozen=True)
class QueueCount:
    """Jobs of one queue in one status; ``oldest_runnable_seconds``: the age of the
    oldest job that could run now (pending rows only, None when none can)."""

    queue: str
    status: str
    jobs: int
    oldest_runnable_seconds: float | None


@dataclass(frozen=True)
class QueueDepth:
    """What :func:`queue_depth` read: the counts, and the table's dead tuples."""

    table: str
    counts: tuple[QueueCount, ...]
    dead_tuples: int

    def as_dict(self) -> dict[str, Any]:
        """Plain values, for JSON."""
        return {
            "table": self.table,
            "dead_tuples": self.dead_tuples,
            "queues": [
                {"queue": c.queue, "status": c.status, "jobs": c.jobs,
                 "oldest_runnable_seconds": c.oldest_runnable_seconds}
                for c in self.counts
            ],
        }


def queue_depth(
    bind: Engine | Connection, model: Any, *, statuses: Sequence[JobStatus | str] = q.DEPTH_STATUSES
) -> QueueDepth:
    """Run :func:`sqla_queue.sql.queue_depth` (one statement) on ``bind``: the counts per
    queue and status, the oldest runnable age and the dead tuples of ``model``'s table,
    under the connection's ``schema_translate_map``."""
    if isinstance(bind, Engine):
        with bind.connect() as conn:
            return queue_depth(conn, model, statuses=statuses)
    table = queue_table(model).table
    schema = translated_schema(table, bind.get_execution_options().get("schema_translate_map"))
    quote = bind.dialect.identifier_preparer.quote
    name = f"{schema}.{table.name}" if schema else table.name
    regclass = f"{quote(schema)}.{quote(table.name)}" if schema else quote(table.name)
    rows = bind.execute(q.queue_depth(model, statuses=statuses, regclass=regclass)).all()
    counts = tuple(
        QueueCount(r.queue, r.status, int(r.jobs), None if r.oldest_runnable_seconds is None
                   else max(float(r.oldest_runnable_seconds), 0.0))
        for r in rows if r.queue is not None
    )
    return QueueDepth(name, counts, int(rows[0].dead_tuples) if rows else 0)


def stats_json(engine: Engine, model: Any) -> dict[str, Any]:
    """``sqla-queue stats --json``: every status of every queue, and the dead tuples."""
    return queue_depth(engine, model, statuses=list(JobStatus)).as_dict()


@dataclass
class QueueSummary:
    """One queue of one table: jobs per status, the oldest runnable job's age, and the
    jobs done and failed in each of the last minutes (oldest first)."""

    queue: str
    counts: dict[str, int] = field(default_factory=dict)
    oldest_runnable: timedelta | None = None
    done: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)


def queue_overview(engine: Engine, model: Any, *, minutes: int = 60) -> list[QueueSummary]:
    """Every queue of ``model``'s table that holds a job, or finished one in the last
    ``minutes``: :func:`sqla_queue.sql.queue_stats` and :func:`sqla_queue.sql.finished_per_minute`
    read in one transaction (one snapshot, one clock)."""
    with engine.connect() as conn:
        now = conn.scalar(select(func.date_trunc("minute", func.now())))
        stats = conn.execute(q.queue_stats(model)).all()
        finished = conn.execute(q.finished_per_minute(model, minutes=minutes)).all()
    summaries: dict[str, QueueSummary] = {}

    def summary(queue: str) -> QueueSummary:
        if queue not in summaries:
            summaries[queue] = QueueSummary(queue, done=[0] * minutes, failed=[0] * minutes)
        return summaries[queue]

    for row in stats:
        entry = summary(row.queue)
        entry.counts[row.status] = int(row.jobs)
        if row.oldest_runnable_age is not None:
            entry.oldest_runnable = row.oldest_runnable_age
    assert now is not None
    for row in finished:
        index = minutes - 1 - int((now - row.minute).total_seconds() // 60)
        if not 0 <= index < minutes:
            continue
        entry = summary(row.queue)
        if row.status == "failed":
            entry.failed[index] += int(row.jobs)
        elif row.status == "done":
            entry.done[index] += int(row.jobs)
    return [summaries[name] for name in sorted(summaries)]


@dataclass(frozen=True)
class LeaseOwner:
    """A worker holding running jobs: its name (the lease owner of its executors, without
    their ``/N.n``), how many executors and jobs, the earliest and latest lease expiry
    among them, and (when the lease length is known) its last heartbeat."""

    owner: str | None
    executors: int
    jobs: int
    oldest_lease: datetime | None
    latest_lease: datetime | None
    last_heartbeat: datetime | None
    expired: bool


_EXECUTOR = re.compile(r"^(?P<worker>.+)/\d+(?:\.\d+)?$")  # {worker}/{executor}.{n}


def registered_workers(engine: Engine, model: Any) -> list[Row[Any]]:
    """Every worker's row of the model's workers table (:func:`~sqla_queue.workers_table`),
    the earliest started first, with ``seen_ago`` (seconds since its last heartbeat).
    ``TypeError`` for a table without one."""
    with engine.connect() as conn:
        return list(conn.execute(q.worker_rows(model)))


def format_workers(rows: Sequence[Row[Any]], lease: float) -> str:
    """The workers table as ``sqla-queue workers`` prints it: one line per worker, ``gone``
    for a worker not seen for a lease (it died without stopping, or cannot reach the
    database)."""
    if not rows:
        return "(no worker recorded)"
    header = ("worker", "state", "runtime", "concurrency", "running", "queues", "started", "last seen", "version")
    lines = [header]
    for r in rows:
        seen = float(r.seen_ago or 0.0)
        queues = ",".join(r.queues) if isinstance(r.queues, list) else "*"
        lines.append((
            r.name, "gone" if seen > lease else "live", r.runtime, str(r.concurrency), str(r.running), queues,
            r.started_at.strftime("%Y-%m-%d %H:%M:%S"), f"{seen:.1f}s ago", r.version,
        ))
    widths = [max(len(line[n]) for line in lines) for n in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines)


def lease_owners(engine: Engine, model: Any, *, lease: float | None = None) -> list[LeaseOwner]:
    """The workers of ``model``'s running jobs (:func:`sqla_queue.sql.lease_owners`, the
    executors of one worker taken together).

    A heartbeat sets every lease it extends to *now + lease*, so with the workers'
    ``lease`` (seconds) the latest expiry gives the last heartbeat; ``expired`` says a
    lease ran out (the worker stopped heartbeating; the sweeper will return its jobs).
    """
    with engine.connect() as conn:
        now = conn.scalar(select(func.now()))
        rows = conn.execute(q.lease_owners(model)).all()
    grouped: dict[str | None, list[Any]] = {}
    for row in rows:
        match = _EXECUTOR.match(row.lease_owner or "")
        grouped.setdefault(match["worker"] if match else row.lease_owner, []).append(row)
    owners = []
    for owner, group in grouped.items():
        oldest = min((r.oldest_lease for r in group if r.oldest_lease is not None), default=None)
        latest = max((r.latest_lease for r in group if r.latest_lease is not None), default=None)
        heartbeat = latest - timedelta(seconds=lease) if lease and latest is not None else None
        expired = oldest is not None and now is not None and oldest < now
        owners.append(
            LeaseOwner(owner, len(group), sum(int(r.jobs) for r in group), oldest, latest, heartbeat, expired)
        )
    return owners


@dataclass(frozen=True)
class ListeningWorker:
    """A live worker of a table, seen by its listener's connection: that connection's
    server process id, ``application_name``, client address, when it connected and
    when it last did something."""

    pid: int
    application_name: str
    client: str
    connected_at: datetime | None
    last_active: datetime | None


def listening_workers(engine: Engine, model: Any) -> list[ListeningWorker]:
    """The live workers of ``model``'s table, idle ones too
    (:func:`sqla_queue.sql.listening_workers`), under the engine's
    ``schema_translate_map``."""
    schema_map = engine.get_execution_options().get("schema_translate_map")
    with engine.connect() as conn:
        rows = conn.execute(q.listening_workers(model, schema_map)).all()
    return [ListeningWorker(int(r.pid), r.application_name or "", r.client, r.connected_at, r.last_active)
            for r in rows]


def _cell(value: Any, width: int | None = None) -> str:
    if value is None:
        text_ = "-"
    elif isinstance(value, datetime):
        text_ = value.isoformat(sep=" ", timespec="seconds")
    elif isinstance(value, Mapping | list):
        text_ = json.dumps(value, default=str, ensure_ascii=False)
    else:
        text_ = str(value)
    text_ = " ".join(text_.split())  # one line per job
    if width is not None and len(text_) > width:
        text_ = text_[: width - 1] + "…"
    return text_


def format_jobs(model: Any, page: JobPage) -> str:
    """A page of jobs as a text table (id, queue, status, task, attempts, run after,
    error's first line), with the option that shows the next page."""
    if not page.rows:
        return "(no jobs)"
    names = [name for name in listed_columns(model) if name != "max_attempts"]
    table = [tuple(names)]
    for row in page.rows:
        values = row._mapping
        cells = []
        for name in names:
            value = values[name]
            if name == "attempts":
                cells.append(f"{value}/{values['max_attempts']}")
            elif name == "last_error":
                first = (value or "").strip().splitlines()
                cells.append(_cell(first[-1] if first else None, 60))
            else:
                cells.append(_cell(value, 40))
        table.append(tuple(cells))
    widths = [max(len(row[i]) for row in table) for i in range(len(names))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in table]
    lines.insert(1, "  ".join("-" * width for width in widths))
    if page.next_before is not None:
        lines.append(f"(more: --before {page.next_before})")
    return "\n".join(lines)


def format_job(row: Row[Any]) -> str:
    """Every column of one job, one per line; ``last_error`` in full, below the rest."""
    values = dict(row._mapping)
    error = values.pop("last_error", None)
    width = max(len(name) for name in values) if values else 0
    lines = []
    for name, value in values.items():
        if isinstance(value, Mapping | list):
            shown = json.dumps(value, default=str, ensure_ascii=False, indent=2).replace("\n", "\n" + " " * (width + 2))
        elif isinstance(value, datetime):
            shown = value.isoformat(sep=" ")
        else:
            shown = "-" if value is None else str(value)
        lines.append(f"{name.ljust(width)}  {shown}")
    lines.append("last_error:" if error is not None else "last_error: -")
    if error is not None:
        lines.append(str(error))
    return "\n".join(lines)
