"""The queue mixins: columns, a CHECK and partial indexes added to a model the user owns.

``JobMixin`` turns any declarative model into a queue table; the user keeps their own
columns, foreign keys and ``__table_args__``. The schema objects that must exist on every
queue table (the status CHECK and the partial indexes of the hot paths) are attached from
a propagating mapper event rather than a ``__table_args__`` on the mixin, because a model
that declares its own ``__table_args__`` would silently drop the mixin's.
"""

from __future__ import annotations

import enum
import hashlib
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar, Final, NamedTuple

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Double,
    Identity,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    Uuid,
    event,
    false,
    func,
    inspect,
    literal_column,
    or_,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import Mapped, Mapper, mapped_column
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.naming import conv

from .cache import plans
from .errors import EnqueueError, NotAQueueModel
from .rules import FlowRule, InOrder, RateLimit, check_rules

__all__ = [
    "ClaimToken",
    "FINISHED_STATUSES",
    "HistoryMixin",
    "archive_table",
    "IdempotencyKeyMixin",
    "JobMixin",
    "JobStatus",
    "QueueTable",
    "ResultMixin",
    "TaskMixin",
    "UNIQUE_ACTIVE",
    "UNIQUE_EVER",
    "UniqueJobs",
    "WorkflowMixin",
    "queue_table",
    "unique_jobs",
]

#: PostgreSQL truncates (and Alembic rejects) identifiers longer than this many bytes.
MAX_IDENTIFIER_BYTES: Final = 63
DEFAULT_QUEUE: Final = "default"
DEFAULT_MAX_ATTEMPTS: Final = 20
_INFO_KEY: Final = "sqla_queue"
_UNIQUE_INFO_KEY: Final = "sqla_queue.unique"
_WAKE_INFO_KEY: Final = "sqla_queue.wake"
_FLOW_INFO_KEY: Final = "sqla_queue.flow"
_RESULT_INFO_KEY: Final = "sqla_queue.result"
_PROGRESS_INFO_KEY: Final = "sqla_queue.progress"
_HISTORY_INFO_KEY: Final = "sqla_queue.history"
_WORKFLOW_INFO_KEY: Final = "sqla_queue.workflow"
#: The most attempts a job's history keeps: the latest ones.
HISTORY_KEEP: Final = 20
#: ``__queue_wake__``'s values: the wake-up NOTIFY in the enqueuing transaction's commit
#: (the default), or sent after it, coalesced (see :mod:`sqla_queue.enqueue.waker`).
WAKE_WITH_COMMIT: Final = "with_commit"
WAKE_AFTER_COMMIT: Final = "after_commit"
#: No wake-up at all: the workers find the jobs at their next poll.
WAKE_NONE: Final = "none"
WAKE_MODES: Final = (WAKE_WITH_COMMIT, WAKE_AFTER_COMMIT, WAKE_NONE)


class JobStatus(enum.StrEnum):
    """The life of a job. ``failed`` is the dead letter: no attempts left, kept for review."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def __str__(self) -> str:
        return self.value


class ClaimToken(NamedTuple):
    """What a claim hands out and every later transition must present: id and attempt."""

    job_id: Any
    attempt: int


#: States a job never leaves on its own; only these are pruned or archived.
FINISHED_STATUSES: Final = (JobStatus.DONE, JobStatus.FAILED, JobStatus.CANCELLED)


def status_literal(status: JobStatus) -> ColumnElement[str]:
    """A status as an inline SQL literal, never a bound parameter.

    A partial index ``WHERE status = 'pending'`` can only serve a query whose predicate
    the planner can prove implies it; a bound ``status = $1`` under a generic prepared
    plan (psycopg prepares repeated statements) does not, and the claim would fall back
    to a scan of the whole table.
    """
    return literal_column(f"'{JobStatus(status).value}'", String)


def constraint_name(table_name: str, suffix: str) -> str:
    """``{prefix}_{table}_{suffix}``-style names that always fit in 63 bytes.

    Long table names are cut and given a short hash, so two long names sharing a prefix
    still get distinct index names.
    """
    name = f"{table_name}_{suffix}"
    if len(name.encode()) <= MAX_IDENTIFIER_BYTES:
        return name
    digest = hashlib.sha1(table_name.encode()).hexdigest()[:8]
    room = MAX_IDENTIFIER_BYTES - len(suffix.encode()) - len(digest) - 2
    head = table_name.encode()[:room].decode(errors="ignore")
    return f"{head}_{digest}_{suffix}"


#: Where a unique key is held by default: while its job waits or runs (a finished job
#: frees it, so the same work can be asked for again).
UNIQUE_ACTIVE: Final = (JobStatus.PENDING, JobStatus.RUNNING)
#: "Ever": a job that completed keeps its key too, so the work is done once at most.
UNIQUE_EVER: Final = (JobStatus.PENDING, JobStatus.RUNNING, JobStatus.DONE)
#: The column the mixin adds for the keys, and its length (a B-tree entry must stay small).
UNIQUE_KEY_COLUMN: Final = "unique_key"
UNIQUE_KEY_LENGTH: Final = 255


@dataclass(frozen=True)
class UniqueJobs:
    """How a queue model's unique jobs work, declared on the model::

        class InvoiceJob(Base, JobMixin):
            __tablename__ = "invoice_jobs"
            __queue_unique__ = UniqueJobs(statuses=UNIQUE_EVER)

    ``column``: the column holding the key, ``unique_key`` (the mixin's) or a column of
    the user's own (``"order_id"``: one job per order, no key to make up). ``statuses``:
    where a job holds its key, ``pending`` among them (a new job is pending): by default
    pending and running (:data:`UNIQUE_ACTIVE`); :data:`UNIQUE_EVER` adds ``done``. One
    partial unique index (``{table}_unique_idx``) enforces it; jobs without a key (NULL)
    are never in it. Models that declare nothing get ``UniqueJobs()``.
    """

    column: str = UNIQUE_KEY_COLUMN
    statuses: tuple[JobStatus, ...] = UNIQUE_ACTIVE

    def __post_init__(self) -> None:
        if not isinstance(self.column, str) or not self.column:
            raise TypeError(f"UniqueJobs column must be a column name, got {self.column!r}")
        try:
            given = {JobStatus(s) for s in self.statuses}
        except (ValueError, TypeError):
            raise ValueError(
                f"UniqueJobs statuses must be job statuses ({', '.join(s.value for s in JobStatus)}), "
                f"got {self.statuses!r}"
            ) from None
        if JobStatus.PENDING not in given:
            raise ValueError("UniqueJobs statuses must include pending: a new job is pending")
        # In the enum's order: the index and the ON CONFLICT predicate must read alike.
        object.__setattr__(self, "statuses", tuple(s for s in JobStatus if s in given))


def unique_predicate(table: Table, unique: UniqueJobs) -> ColumnElement[bool]:
    """The partial unique index's predicate: a key, in one of the statuses (literals,
    never bound values: ``ON CONFLICT`` infers the index from the same expression)."""
    column = table.c[unique.column]
    statuses = [table.c.status == status_literal(s) for s in unique.statuses]
    return column.isnot(None) & (or_(*statuses) if len(statuses) > 1 else statuses[0])


def unique_jobs(table: Table) -> UniqueJobs | None:
    """The unique jobs declaration of a queue model's table (None: no key column, or a
    table not made by the mixin, which has no unique index to skip duplicates against)."""
    found = table.info.get(_UNIQUE_INFO_KEY)
    return found if isinstance(found, UniqueJobs) else None


def _empty_payload() -> dict[str, Any]:
    return {}


class JobMixin:
    """Queue columns for a declarative model the user owns.

    Mix into any declarative class (``DeclarativeBase``, ``declarative_base()``,
    Flask-SQLAlchemy ``db.Model``)::

        class EmailJob(Base, JobMixin):
            __tablename__ = "email_jobs"
            order_id: Mapped[int] = mapped_column(ForeignKey("orders.id"))

    The model may declare its own primary key (one column) instead of the BIGINT
    identity ``id``; the claim orders ties by it. Two class attributes tune it:
    ``__queue_unique__`` (a :class:`UniqueJobs`: unique jobs) and ``__queue_wake__``
    (``"with_commit"``, the default: the wake-up NOTIFY in the enqueuing COMMIT;
    ``"after_commit"``: sent after it, coalesced, for tables with many concurrent
    writers; ``"none"``: the workers' poll finds the jobs).
    """

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    queue: Mapped[str] = mapped_column(
        String(128), default=DEFAULT_QUEUE, server_default=DEFAULT_QUEUE
    )
    status: Mapped[str] = mapped_column(
        String(16), default=JobStatus.PENDING.value, server_default=JobStatus.PENDING.value
    )
    #: Higher runs first.
    priority: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    #: Not claimed before this time (delays, scheduled jobs, retry backoff).
    run_after: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now()
    )
    #: Attempts started so far; the claim increments it, so it is also the fencing token.
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    max_attempts: Mapped[int] = mapped_column(
        Integer, default=DEFAULT_MAX_ATTEMPTS, server_default=text(str(DEFAULT_MAX_ATTEMPTS))
    )
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_error: Mapped[str | None] = mapped_column(Text)
    #: Set by the sweeper when an attempt ended with its lease expiring (its worker most
    #: likely died). Such jobs are claimed one at a time and run alone, so a job that
    #: crashes its worker burns only its own attempts, not those of its batch neighbours.
    isolated: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now()
    )
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    #: The OpenTelemetry context of the code that enqueued the job (``traceparent``...),
    #: when a span was recording; the job's span links to it. NULL otherwise.
    trace_context: Mapped[dict[str, str] | None] = mapped_column(
        JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql"), nullable=True
    )
    #: At most one job per key in the statuses of the model's :class:`UniqueJobs`
    #: (``enqueue(..., unique_key=...)``); NULL: no key.
    unique_key: Mapped[str | None] = mapped_column(String(UNIQUE_KEY_LENGTH))
    #: Seconds one attempt may run, set at enqueue (``timeout=``); None: the task's, or
    #: the worker's. The most specific wins.
    timeout: Mapped[float | None] = mapped_column(Double)
    #: When the current attempt was claimed, and when it must be over: set by the claim,
    #: so the deadline survives the worker (the sweeper enforces it after a crash).
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    deadline_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class TaskMixin(JobMixin):
    """A generic task table: a registered task name and a JSON payload (JSONB on PostgreSQL).

    For applications that want one table for many kinds of work rather than typed columns.
    The worker dispatches on ``task`` through a :class:`~sqla_queue.Tasks` registry and
    never imports or evaluates the name.
    """

    task: Mapped[str] = mapped_column(String(200))
    payload: Mapped[dict[str, Any]] = mapped_column(
        JSON().with_variant(JSONB(), "postgresql"),
        default=_empty_payload,
        server_default=text("'{}'"),
    )


class IdempotencyKeyMixin:
    """An ``idempotency_key`` column: a random UUID each job gets when it is enqueued,
    for the external systems a handler calls (payment, mail and other APIs that drop a
    request whose key they have seen).

    Hand this key to them, not the job's ``id``: ids come from a sequence, and after a
    failover to an asynchronous standby that had not received the last jobs, the new
    primary hands those ids again to different jobs, which a provider would then drop as
    duplicates. A random key is never handed out twice (122 random bits, from
    ``uuid.uuid4``). Opt-in: mix it in beside :class:`JobMixin` or :class:`TaskMixin`::

        class EmailJob(Base, JobMixin, IdempotencyKeyMixin):
            __tablename__ = "email_jobs"

    The key is set in Python on every enqueue path (the ORM's flush, so ``job.
    idempotency_key`` is there once the job is flushed; ``enqueue_many``'s COPY and
    INSERT; ``enqueue_values``), and by the server (``gen_random_uuid()``) for a row
    another program inserts, or for the rows already there when a migration adds the
    column. No index comes with it: add a unique one if you look jobs up by key.
    """

    idempotency_key: Mapped[uuid.UUID] = mapped_column(
        Uuid, default=uuid.uuid4, server_default=func.gen_random_uuid(), nullable=False
    )


class ResultMixin:
    """What a job reports: a ``result`` column that keeps what the handler returned, and a
    ``progress`` column for what it said along the way. Opt-in, beside :class:`JobMixin`
    or :class:`TaskMixin`::

        class ReportJob(Base, TaskMixin, ResultMixin):
            __tablename__ = "report_jobs"

    The worker stores the return value as JSON (JSONB on PostgreSQL) in the same fenced
    statement that marks the job ``done``, so a result is there exactly when the job is
    done; :func:`sqla_queue.result` reads it and :func:`sqla_queue.wait_for_result` waits
    for it. ``current_job().progress(value)`` records a small JSON value, written with
    the heartbeat and with the attempt's outcome, and kept across retries. A model may
    keep results in a column of its own and type instead: name it in
    ``__queue_result__`` (``__queue_result__ = "total_cents"`` for an ``Integer``
    column); the worker then checks each return value against the column's Python type.
    ``__queue_progress__`` names the progress column (a JSON one). Opt-in because a
    table's own ``result`` column is the user's to write.
    """

    __queue_result__: ClassVar[str] = "result"
    __queue_progress__: ClassVar[str] = "progress"
    result: Mapped[Any | None] = mapped_column(
        JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql"), nullable=True
    )
    progress: Mapped[Any | None] = mapped_column(
        JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql"), nullable=True
    )


def result_column(table: Table) -> Column[Any] | None:
    """The column a queue table keeps its jobs' results in (its model's
    ``__queue_result__``), or None: the table keeps none."""
    name = table.info.get(_RESULT_INFO_KEY)
    return table.c[name] if isinstance(name, str) and name in table.c else None


class HistoryMixin:
    """A ``history`` column that keeps how each attempt of a job ended: opt-in, beside
    :class:`JobMixin` or :class:`TaskMixin`::

        class EmailJob(Base, JobMixin, HistoryMixin):
            __tablename__ = "email_jobs"

    The statement that ends an attempt (completion, retry, dead letter, snooze, hand-back,
    the sweeper's expiry, a cancel of a running job) appends one entry to this JSON array:
    ``attempt``, ``worker`` (the lease owner), ``started_at``, ``ended_at``, ``seconds``,
    ``outcome`` (``done``, ``retried``, ``failed``, ``timed out``, ``snoozed``,
    ``released``, ``cancelled`` or ``lost``) and ``error`` (the head of the error and its
    traceback). The last :data:`HISTORY_KEEP` attempts are kept; the rest of the job's
    life is in its row, and retention deletes both together.
    """

    __queue_history__: ClassVar[str] = "history"
    history: Mapped[list[dict[str, Any]] | None] = mapped_column(
        JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql"), nullable=True
    )


#: What a job does when one of its parents ends ``failed`` or ``cancelled`` (its
#: workflow's choice): cancel it and every job below it, hold it (it waits until an
#: operator requeues the parent and it ends ``done``), or run it anyway.
ON_PARENT_FAILURE: Final = ("cancel", "hold", "run")


class WorkflowMixin:
    """Dependencies between jobs of one table: opt-in, beside :class:`JobMixin` or
    :class:`TaskMixin`, on a model whose key is an integer (the default ``id``)::

        class Step(Base, TaskMixin, ResultMixin, WorkflowMixin):
            __tablename__ = "steps"

    A :class:`~sqla_queue.Workflow` enqueues jobs that wait for others. A waiting job is
    ``pending`` with ``run_after`` at :data:`~sqla_queue.enqueue.workflow.WAITING_RUN_AFTER`
    (never claimable) and ``waiting_on`` counting its parents still to end; the statement
    that ends a parent counts it down in the same transaction, and the one that takes it
    to zero makes it due. ``parent_ids``
    and ``child_ids`` are the edges (a parent's ``child_ids`` is cleared once counted, so
    no parent counts twice); ``workflow_id`` groups a workflow's jobs, and
    ``on_parent_failure`` is its policy (:data:`ON_PARENT_FAILURE`).
    """

    __queue_workflow__: ClassVar[bool] = True
    workflow_id: Mapped[uuid.UUID | None] = mapped_column(Uuid)
    parent_ids: Mapped[list[int] | None] = mapped_column(ARRAY(BigInteger))
    child_ids: Mapped[list[int] | None] = mapped_column(ARRAY(BigInteger))
    waiting_on: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    on_parent_failure: Mapped[str] = mapped_column(String(6), default="cancel", server_default="cancel")


#: The columns of :class:`WorkflowMixin`.
WORKFLOW_COLUMNS: Final = ("workflow_id", "parent_ids", "child_ids", "waiting_on", "on_parent_failure")


def has_workflows(table: Table) -> bool:
    """Whether a queue table's jobs may wait for others (its model mixes in
    :class:`WorkflowMixin`)."""
    return bool(table.info.get(_WORKFLOW_INFO_KEY))


def history_column(table: Table) -> Column[Any] | None:
    """The JSONB column a queue table keeps its attempts' history in (its model's
    ``__queue_history__``), or None: the table keeps none."""
    name = table.info.get(_HISTORY_INFO_KEY)
    return table.c[name] if isinstance(name, str) and name in table.c else None


def progress_column(table: Table) -> Column[Any] | None:
    """The JSON column a queue table keeps its jobs' progress in (its model's
    ``__queue_progress__``), or None: the table keeps none."""
    name = table.info.get(_PROGRESS_INFO_KEY)
    return table.c[name] if isinstance(name, str) and name in table.c else None


def results_channel(table: Table) -> str:
    """The channel on which the statements that finish jobs of a table that keeps results
    NOTIFY the finished ids (see :func:`sqla_queue.wait_for_result`). Named after the
    table as declared, whatever ``schema_translate_map`` says: tenants' tables of one
    model share it, and a waiter woken by another tenant's job reads its own row again."""
    fullname = f"{table.schema}.{table.name}" if table.schema else table.name
    return constraint_name(f"sqla_queue.{fullname}", "results")


#: Columns every queue table must have; checked once per table.
REQUIRED_COLUMNS: Final = (
    "queue",
    "status",
    "priority",
    "run_after",
    "attempts",
    "max_attempts",
    "lease_owner",
    "lease_expires_at",
    "last_error",
    "isolated",
    "created_at",
    "finished_at",
)

#: Columns of cancellation and timeouts: the worker uses them when the model has them
#: (every JobMixin model), and runs without timeouts on a table mapped without them.
TIMEOUT_COLUMNS: Final = ("timeout", "started_at", "deadline_at")


def table_problem(name: str, columns: Collection[str]) -> str | None:
    """What keeps the database table ``name``, which has ``columns`` (none: it does not
    exist), from serving as a queue; None if nothing. One wording for the worker's start
    check and the admin commands."""
    if not columns:
        return (
            f"table {name!r} does not exist in that database: create it (metadata.create_all "
            f"or a migration) before starting the worker"
        )
    missing = sorted(set(REQUIRED_COLUMNS) - set(columns))
    if missing:
        return (
            f"table {name!r} lacks the queue columns {', '.join(missing)}: migrate it "
            f"(the model uses JobMixin, the table does not yet)"
        )
    return None


@dataclass(frozen=True)
class QueueTable:
    """A resolved queue table: the Table, its single primary-key column and its names."""

    table: Table
    pk: Column[Any]
    channel: str
    mapped_class: type[Any] | None = None

    @property
    def c(self) -> Any:
        return self.table.c

    @property
    def is_task_table(self) -> bool:
        return "task" in self.table.c and "payload" in self.table.c


def translated_schema(table: Table, schema_translate_map: Mapping[str | None, str | None] | None) -> str | None:
    """The schema ``table`` is in under ``schema_translate_map`` (an execution option)."""
    if schema_translate_map and table.schema in schema_translate_map:
        return schema_translate_map[table.schema]
    return table.schema


def notify_channel(table: Table, schema_translate_map: Mapping[str | None, str | None] | None = None) -> str:
    """The LISTEN/NOTIFY channel of a queue table (schema-qualified, under 64 bytes).

    Named after the schema the table is in under ``schema_translate_map``: the tables of
    two tenants' schemas, one model, get channels of their own. Enqueuers and workers
    compute it from the same engine options, so they agree.
    """
    schema = translated_schema(table, schema_translate_map)
    fullname = f"{schema}.{table.name}" if schema else table.name
    return constraint_name(f"sqla_queue.{fullname}", "jobs")


def _attach_schema_objects(table: Table) -> None:
    """The CHECK and partial indexes every queue table carries, named after the table.

    Names are wrapped in ``conv()`` so a user's ``MetaData(naming_convention=...)`` does
    not prefix them a second time.
    """
    c = table.c
    name = table.name
    pending = c.status == status_literal(JobStatus.PENDING)
    running = c.status == status_literal(JobStatus.RUNNING)
    table.append_constraint(
        CheckConstraint(
            c.status.in_([s.value for s in JobStatus]),
            name=conv(constraint_name(name, "status_check")),
        )
    )
    pk = list(table.primary_key.columns)
    order = [c.priority.desc(), c.run_after, *pk]
    # The claim across all queues: ORDER BY priority DESC, run_after, pk LIMIT n reads
    # the first n entries, whatever the number of finished or delayed rows.
    Index(conv(constraint_name(name, "claim_idx")), *order, postgresql_where=pending)
    # The claim restricted to one queue.
    Index(
        conv(constraint_name(name, "claim_queue_idx")),
        c.queue,
        *order,
        postgresql_where=pending,
    )
    # Isolated jobs (their last attempt's lease expired) are few: a tiny index lets
    # workers ask "is one waiting?" on every poll for free.
    Index(
        conv(constraint_name(name, "isolated_idx")),
        *order,
        postgresql_where=pending & c.isolated,
    )
    # The sweeper's lookup of expired leases.
    Index(conv(constraint_name(name, "lease_idx")), c.lease_expires_at, postgresql_where=running)
    # Finished jobs by when they finished: the dashboard's charts and the activity table
    # read a time range of them (the last minutes), never the whole table. One entry per
    # finished job, written by the statement that finishes it; no claim reads it.
    Index(conv(constraint_name(name, "finished_idx")), c.finished_at, postgresql_where=c.finished_at.is_not(None))
    for rule in flow_rules(table):
        if isinstance(rule, InOrder):
            # A candidate's earlier jobs of its key that hold it back, found by this.
            holding = [JobStatus.PENDING, JobStatus.RUNNING]
            if rule.on_dead_letter == "block":
                holding.append(JobStatus.FAILED)
            Index(
                conv(constraint_name(name, f"order_{rule.key}_idx")),
                c[rule.key], c.created_at, *pk,
                postgresql_where=or_(*(c.status == status_literal(s) for s in holding)),
            )
        elif isinstance(rule, RateLimit):
            # A rate limit's claims count the jobs started within its period (per key):
            # a range of started_at, the window, read once per claim.
            keyed = [c[rule.key]] if rule.key is not None else []
            suffix = f"starts_{rule.key}_idx" if rule.key is not None else "starts_idx"
            Index(conv(constraint_name(name, suffix)), c.started_at, *keyed)
        elif rule.key is not None:
            # A rule's claims count the running jobs of each candidate's key with it
            # (a rule without a key counts every running job: lease_idx).
            Index(conv(constraint_name(name, f"running_{rule.key}_idx")), c[rule.key], postgresql_where=running)
            if rule.fair:
                # A fair claim walks the keys with pending jobs, then each key's jobs in order.
                Index(conv(constraint_name(name, f"fair_{rule.key}_idx")), c[rule.key], *order,
                      postgresql_where=pending)
    if has_workflows(table):
        # A workflow's jobs, for its page and its cancel (most rows have none).
        Index(
            conv(constraint_name(name, "workflow_idx")),
            c.workflow_id,
            postgresql_where=c.workflow_id.is_not(None),
        )
        # Parents that ended while another transaction held one of their children, and
        # left it to count down (see ``sql.settle_edges``): none most of the time.
        Index(
            conv(constraint_name(name, "edges_idx")),
            *pk,
            postgresql_where=c.child_ids.is_not(None) & c.finished_at.is_not(None),
        )
    unique = table.info.get(_UNIQUE_INFO_KEY)
    if isinstance(unique, UniqueJobs):
        # Unique jobs: a duplicate is skipped by INSERT … ON CONFLICT DO NOTHING against it.
        Index(
            conv(constraint_name(name, "unique_idx")),
            c[unique.column],
            unique=True,
            postgresql_where=unique_predicate(table, unique),
        )


@event.listens_for(JobMixin, "instrument_class", propagate=True)
def _on_instrument(mapper: Mapper[Any], cls: type[Any]) -> None:
    table = mapper.local_table
    if not isinstance(table, Table) or table.info.get(_INFO_KEY):
        return  # single-table inheritance: the parent's table already has them
    missing = [col for col in REQUIRED_COLUMNS if col not in table.c]
    if missing:
        return  # an abstract base or a mapping that is not a queue table after all
    table.info[_INFO_KEY] = True
    unique = getattr(cls, "__queue_unique__", None)
    if unique is None and UNIQUE_KEY_COLUMN in table.c:
        unique = UniqueJobs()
    if unique is not None:
        if not isinstance(unique, UniqueJobs):
            raise TypeError(
                f"{cls.__qualname__}.__queue_unique__ must be a sqla_queue.UniqueJobs, got {type(unique).__qualname__}"
            )
        if unique.column not in table.c:
            raise NotAQueueModel(
                f"{cls.__qualname__}.__queue_unique__ names column {unique.column!r}, which "
                f"table {table.name!r} does not have"
            )
        table.info[_UNIQUE_INFO_KEY] = unique
    wake = getattr(cls, "__queue_wake__", WAKE_WITH_COMMIT)
    if wake not in WAKE_MODES:
        raise ValueError(
            f"{cls.__qualname__}.__queue_wake__ must be one of {', '.join(map(repr, WAKE_MODES))}, got {wake!r}"
        )
    table.info[_WAKE_INFO_KEY] = wake
    result = getattr(cls, "__queue_result__", None)
    if result is not None:
        if not isinstance(result, str) or result not in table.c:
            raise NotAQueueModel(
                f"{cls.__qualname__}.__queue_result__ must name a column of table {table.name!r}, got {result!r}"
            )
        if result in REQUIRED_COLUMNS or result in TIMEOUT_COLUMNS or table.c[result].primary_key:
            raise NotAQueueModel(
                f"{cls.__qualname__}.__queue_result__ names {result!r}, a column the queue itself uses"
            )
        table.info[_RESULT_INFO_KEY] = result
    progress = getattr(cls, "__queue_progress__", None)
    if progress is not None:
        if not isinstance(progress, str) or progress not in table.c or progress == result:
            raise NotAQueueModel(
                f"{cls.__qualname__}.__queue_progress__ must name a column of table {table.name!r} "
                f"other than the result's, got {progress!r}"
            )
        if not isinstance(table.c[progress].type, JSON):
            raise NotAQueueModel(
                f"{cls.__qualname__}.__queue_progress__ names {progress!r}, which is not a JSON column"
            )
        if progress in REQUIRED_COLUMNS or progress in TIMEOUT_COLUMNS:
            raise NotAQueueModel(f"{cls.__qualname__}.__queue_progress__ names {progress!r}, a column the queue uses")
        table.info[_PROGRESS_INFO_KEY] = progress
    history = getattr(cls, "__queue_history__", None)
    if history is not None:
        if not isinstance(history, str) or history not in table.c or not isinstance(table.c[history].type, JSON):
            raise NotAQueueModel(
                f"{cls.__qualname__}.__queue_history__ must name a JSON column of table {table.name!r}, got {history!r}"
            )
        table.info[_HISTORY_INFO_KEY] = history
    if getattr(cls, "__queue_workflow__", False):
        missing_edges = [col for col in WORKFLOW_COLUMNS if col not in table.c]
        if missing_edges:
            raise NotAQueueModel(f"{cls.__qualname__} has __queue_workflow__ but lacks columns {missing_edges}")
        keys = list(table.primary_key.columns)
        if len(keys) != 1 or keys[0].type.python_type is not int:
            raise NotAQueueModel(
                f"{cls.__qualname__} mixes in WorkflowMixin, whose edges are integer arrays: its key must be "
                f"one integer column, not {', '.join(repr(str(k.type)) for k in keys) or 'none'}"
            )
        table.info[_WORKFLOW_INFO_KEY] = True
    flow = getattr(cls, "__queue_flow__", ())
    table.info[_FLOW_INFO_KEY] = check_rules(cls.__qualname__, flow, table.c.keys())
    _attach_schema_objects(table)


def flow_rules(table: Table) -> tuple[FlowRule, ...]:
    """The flow rules of a queue model's table (its ``__queue_flow__``; empty: none)."""
    found: tuple[FlowRule, ...] = table.info.get(_FLOW_INFO_KEY, ())
    return found


def wake_mode(table: Table) -> str:
    """How ``table``'s enqueuers wake its workers (its model's ``__queue_wake__``):
    ``"with_commit"`` (NOTIFY in the COMMIT), ``"after_commit"`` (sent after it,
    coalesced) or ``"none"`` (the workers' poll finds the jobs)."""
    mode: str = table.info.get(_WAKE_INFO_KEY, WAKE_WITH_COMMIT)
    return mode


#: Key of the resolved queue tables in the shared cache.
_QUEUE_TABLE: Final = "sqla_queue.model.queue_table"


def queue_table(model: Any) -> QueueTable:
    """Resolve a queue model class, an instance of one, or its ``Table``.

    Raises :class:`~sqla_queue.NotAQueueModel` for anything else, naming what is missing.
    """
    mapped_class: type[Any] | None = None
    if isinstance(model, Table):
        table = model
    else:
        cls = model if isinstance(model, type) else type(model)
        mapper: Any = inspect(cls, raiseerr=False)
        if mapper is None or not isinstance(mapper, Mapper):
            raise NotAQueueModel(f"{cls.__qualname__} is not a mapped class or a Table")
        if not isinstance(mapper.local_table, Table):
            raise NotAQueueModel(f"{cls.__qualname__} is not mapped to a single Table")
        table = mapper.local_table
        mapped_class = cls
    cached: QueueTable | None = plans.get((_QUEUE_TABLE, table))
    if cached is not None and (mapped_class is None or cached.mapped_class is mapped_class):
        return cached
    missing = [col for col in REQUIRED_COLUMNS if col not in table.c]
    if missing:
        raise NotAQueueModel(
            f"table {table.fullname!r} is not a queue table (missing columns: "
            f"{', '.join(missing)}); mix sqla_queue.JobMixin into its model"
        )
    pk = list(table.primary_key.columns)
    if len(pk) != 1:
        raise NotAQueueModel(
            f"queue table {table.fullname!r} needs a single-column primary key, has {len(pk)}"
        )
    resolved = QueueTable(
        table=table, pk=pk[0], channel=notify_channel(table), mapped_class=mapped_class
    )
    return plans.put((_QUEUE_TABLE, table), resolved)


def companion_table(table: Table, suffix: str, info_key: str, *columns: Column[Any]) -> Table:
    """``<table>_<suffix>``, a table of the library's beside the queue ``table`` (in its
    schema and ``MetaData``), made once and remembered in ``table.info[info_key]``; one of
    that name already in the metadata is taken as it is."""
    found: Table | None = table.info.get(info_key)
    if found is not None:
        return found
    name = constraint_name(table.name, suffix)
    existing = table.metadata.tables.get(f"{table.schema}.{name}" if table.schema else name)
    made = existing if existing is not None else Table(name, table.metadata, *columns, schema=table.schema)
    table.info[info_key] = made
    return made


def archive_table(model: Any, name: str, metadata: MetaData | None = None) -> Table:
    """A table for :func:`sqla_queue.sql.archive_finished`: the queue table's columns.

    Same names and types, no defaults, identity or queue indexes (nothing claims from
    an archive), plus ``archived_at``. Created in the queue table's ``MetaData`` unless
    another is given, so Alembic autogenerate sees it.
    """
    qt = queue_table(model)
    columns = [
        Column(col.name, col.type, primary_key=col.primary_key, nullable=col.nullable, autoincrement=False)
        for col in qt.table.c
    ]
    columns.append(
        Column("archived_at", DateTime(timezone=True), nullable=False, server_default=func.now())
    )
    target = metadata if metadata is not None else qt.table.metadata
    return Table(name, target, *columns, schema=qt.table.schema)


# -- the limits of a job's values, known on both sides ----------------------------------
# The enqueue side checks every value against them (with the other rules, in
# sqla_queue.enqueue._rules); the worker's config, the tasks and the schedules need them
# too, and sit below the enqueue side.

_INT32: Final = 2**31
#: The longest ``delay``: 1000 years. A ``run_after`` must stay readable as a Python
#: ``datetime`` (year 9999 at most) and a delay this long is a mistake in any case.
MAX_DELAY_SECONDS: Final = 1000 * 365.25 * 86400.0
#: The longest ``timeout``: ten years (a deadline must stay a readable timestamp).
MAX_TIMEOUT_SECONDS: Final = 10 * 365 * 86400.0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: Queue names starting with this are the library's own: the workers' NOTIFY messages
#: other than a queue's wake-up (a sweep's, ``sqla_queue.swept:<queue>``) start with it.
RESERVED_QUEUE_PREFIX = "sqla_queue."


def check_queue(value: Any, name: str = "queue") -> None:
    if not isinstance(value, str) or not value:
        raise EnqueueError(f"{name} must be a non-empty string, got {value!r}")
    if value.startswith(RESERVED_QUEUE_PREFIX):
        raise EnqueueError(f"{name} {value!r} starts with {RESERVED_QUEUE_PREFIX!r}, which sqla_queue reserves")


def check_priority(value: Any, name: str = "priority") -> None:
    if not _is_int(value) or not -_INT32 <= value < _INT32:
        raise EnqueueError(f"{name} must be a 32-bit integer, got {value!r}")


def check_max_attempts(value: Any, name: str = "max_attempts") -> None:
    if not _is_int(value) or not 1 <= value < _INT32:
        raise EnqueueError(f"{name} must be an integer >= 1 (32-bit), got {value!r}")
