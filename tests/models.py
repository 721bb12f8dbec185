"""Models shared by the test suite and by the worker processes it starts."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import CheckConstraint, DateTime, ForeignKey, Index, String, Text, TypeDecorator, Uuid, func
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, reconstructor

from sqla_queue import (
    UNIQUE_EVER,
    Concurrency,
    HistoryMixin,
    IdempotencyKeyMixin,
    InOrder,
    JobMixin,
    RateLimit,
    ResultMixin,
    TaskMixin,
    UniqueJobs,
    WorkflowMixin,
    activity_table,
    queues_table,
    schedules_table,
    workers_table,
)


class Base(DeclarativeBase):
    pass


class Order(Base):
    """A business table: the outbox tests write one beside each job."""

    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str] = mapped_column(String(100))
    confirmed: Mapped[bool] = mapped_column(default=False)


class EmailJob(Base, JobMixin):
    """A typed queue table with the user's own FK, column, index and CHECK."""

    __tablename__ = "email_jobs"
    __table_args__ = (
        Index("ix_email_jobs_order", "order_id"),
        CheckConstraint("length(recipient) > 0", name="ck_email_jobs_recipient"),
    )

    order_id: Mapped[int | None] = mapped_column(ForeignKey("orders.id"))
    recipient: Mapped[str] = mapped_column(String(200), default="someone@example.com")


class ReportJob(Base, JobMixin):
    """A second queue table: queues of different tables never meet."""

    __tablename__ = "report_jobs"

    report: Mapped[str] = mapped_column(String(50), default="daily")


class WakeAfterJob(Base, JobMixin):
    """A queue table whose wake-ups go after the enqueuing commit (``__queue_wake__``)."""

    __tablename__ = "wake_after_jobs"
    __queue_wake__ = "after_commit"

    order_id: Mapped[int | None] = mapped_column(ForeignKey("orders.id"))


class Task(Base, TaskMixin):
    """A generic task table."""

    __tablename__ = "tasks"


class ResultTask(Base, TaskMixin, ResultMixin, HistoryMixin):
    """A task table that keeps its jobs' results, progress and attempts' history (JSONB)."""

    __tablename__ = "result_tasks"


class StepTask(Base, TaskMixin, ResultMixin, HistoryMixin, WorkflowMixin):
    """A task table whose jobs may wait for others (workflows), keeping results and history."""

    __tablename__ = "step_tasks"


class StepJob(Base, JobMixin, WorkflowMixin):
    """A job table whose jobs may wait for others, and keeps no results."""

    __tablename__ = "step_jobs"


class TotalJob(Base, JobMixin):
    """A table that keeps its results in a typed column of its own."""

    __tablename__ = "total_jobs"
    __queue_result__ = "total"

    amount: Mapped[int] = mapped_column(default=1)
    total: Mapped[int | None] = mapped_column()


#: ResultTask's workers record themselves (the other tables' do not).
RESULT_WORKERS = workers_table(ResultTask)


class ChartJob(Base, JobMixin):
    """A queue table whose workers record its activity, which the dashboard's charts read."""

    __tablename__ = "chart_jobs"


#: ChartJob's activity (the other tables' charts read the queue table itself).
CHART_ACTIVITY = activity_table(ChartJob)

#: The watermark tables of the periodic jobs of the tables that have schedules.
TASK_SCHEDULES = schedules_table(Task)
REPORT_SCHEDULES = schedules_table(ReportJob)
#: The task table's queues can be paused: its claims read this table (the others' do not).
TASK_QUEUES = queues_table(Task)


class AccountJob(Base, JobMixin):
    """Flow rules: one running job per account (jobs without an account are not limited)."""

    __tablename__ = "account_jobs"
    __queue_flow__ = Concurrency(1, key="account")

    account: Mapped[str | None] = mapped_column(String(50))
    #: What the flow app's handler does: work this long; SIGKILL its process on attempt 1.
    work_seconds: Mapped[float] = mapped_column(default=0.0, server_default="0")
    kill: Mapped[bool] = mapped_column(default=False, server_default="false")


class ShardJob(Base, JobMixin):
    """Flow rules: three running jobs per account, four per queue, six in the table."""

    __tablename__ = "shard_jobs"
    __queue_flow__ = (Concurrency(3, key="account"), Concurrency(4, key="queue"), Concurrency(6))

    account: Mapped[str | None] = mapped_column(String(50))
    work_seconds: Mapped[float] = mapped_column(default=0.0, server_default="0")
    kill: Mapped[bool] = mapped_column(default=False, server_default="false")


#: Its queues can be paused and given limits of their own (Concurrency(4, key="queue")).
SHARD_QUEUES = queues_table(ShardJob)


class RatedJob(Base, JobMixin):
    """Flow rules: at most five starts per account in any half second, strictly, and
    twenty per queue in any second (the default mode)."""

    __tablename__ = "rated_jobs"
    __queue_flow__ = (RateLimit(5, per=0.5, key="account", strict=True), RateLimit(20, per=1.0, key="queue"))

    account: Mapped[str | None] = mapped_column(String(50))
    work_seconds: Mapped[float] = mapped_column(default=0.0, server_default="0")
    kill: Mapped[bool] = mapped_column(default=False, server_default="false")


#: Its queues can be given a rate of their own (RateLimit(20, per=1.0, key="queue")).
RATED_QUEUES = queues_table(RatedJob)


class TenantJob(Base, JobMixin):
    """Flow rules: two running jobs per tenant, claimed fairly (round the tenants)."""

    __tablename__ = "tenant_jobs"
    __queue_flow__ = Concurrency(2, key="tenant", fair=True)

    tenant: Mapped[str | None] = mapped_column(String(50))


class OrderedJob(Base, JobMixin):
    """Flow rules: the jobs of one account run one at a time, in enqueue order; a dead
    letter blocks its account."""

    __tablename__ = "ordered_jobs"
    __queue_flow__ = InOrder(key="account")

    account: Mapped[str | None] = mapped_column(String(50))
    work_seconds: Mapped[float] = mapped_column(default=0.0, server_default="0")
    kill: Mapped[bool] = mapped_column(default=False, server_default="false")


class SkippingOrderedJob(Base, JobMixin):
    """As ``OrderedJob``, but a dead letter lets the next job of its account run."""

    __tablename__ = "skipping_ordered_jobs"
    __queue_flow__ = InOrder(key="account", on_dead_letter="skip")

    account: Mapped[str | None] = mapped_column(String(50))


class UuidJob(Base, JobMixin):
    """A queue table whose primary key the user chose."""

    __tablename__ = "uuid_jobs"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)  # type: ignore[assignment]


class KeyedJob(Base, JobMixin, IdempotencyKeyMixin):
    """A typed queue table that opted in to the idempotency key."""

    __tablename__ = "keyed_jobs"

    recipient: Mapped[str] = mapped_column(String(200), default="someone@example.com")


class KeyedTask(Base, TaskMixin, IdempotencyKeyMixin):
    """A task table with the idempotency key."""

    __tablename__ = "keyed_tasks"


class Effect(Base):
    """Rows written by transactional handlers: one per handled job, never two."""

    __tablename__ = "effects"

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(index=True)
    worker: Mapped[str] = mapped_column(String(200))
    note: Mapped[str] = mapped_column(String(200), default="")


class FlowRun(Base):
    """One handler run of a job with flow rules, from its start to its end (NULL: its
    process was killed), timed by the server's clock: what the handlers count."""

    __tablename__ = "flow_runs"

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(index=True)
    account: Mapped[str | None] = mapped_column(String(50))
    queue: Mapped[str] = mapped_column(String(50))
    pid: Mapped[int]
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.clock_timestamp())
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class UniqueKey(Base):
    """A business row with a unique key: what get-or-create handlers create once."""

    __tablename__ = "unique_keys"

    id: Mapped[int] = mapped_column(primary_key=True)
    key: Mapped[str] = mapped_column(String(100), unique=True)
    job_id: Mapped[int] = mapped_column(default=0)


class OnceJob(Base, JobMixin):
    """Unique jobs "ever": a done job keeps holding its key."""

    __tablename__ = "once_jobs"
    __queue_unique__ = UniqueJobs(statuses=UNIQUE_EVER)

    note: Mapped[str] = mapped_column(String(50), default="")


class OrderJob(Base, JobMixin):
    """One job per order: the key is the user's own ``order_id`` column."""

    __tablename__ = "order_jobs"
    __queue_unique__ = UniqueJobs(column="order_id")

    order_id: Mapped[int | None] = mapped_column(ForeignKey("orders.id"))
    note: Mapped[str] = mapped_column(String(50), default="")


class Picky(TypeDecorator[str]):
    """A column type whose result processing refuses the value ``"unreadable"``."""

    impl = String(50)
    cache_ok = True

    def process_result_value(self, value: str | None, dialect: Dialect) -> str | None:
        if value == "unreadable":
            raise ValueError("Picky cannot read 'unreadable'")
        return value


class FragileJob(Base, JobMixin):
    """A queue table whose rows can fail to load: a raising ``@reconstructor`` (label
    ``"broken"``) or a raising ``TypeDecorator`` (code ``"unreadable"``)."""

    __tablename__ = "fragile_jobs"

    label: Mapped[str] = mapped_column(String(50), default="fine")
    code: Mapped[str] = mapped_column(Picky(), default="ok")

    @reconstructor
    def _check_label(self) -> None:
        if self.label == "broken":
            raise RuntimeError("FragileJob refuses to load a 'broken' label")


def all_tables() -> list[Any]:
    return list(Base.metadata.sorted_tables)


class PolyJob(Base, JobMixin):
    """Single-table inheritance: one queue table, a subclass (and handler) per kind."""

    __tablename__ = "poly_jobs"
    __mapper_args__ = {"polymorphic_on": "kind", "polymorphic_identity": "base"}  # noqa: RUF012 - SQLAlchemy's own

    kind: Mapped[str] = mapped_column(String(20))
    note: Mapped[str] = mapped_column(String(50), default="")


class PolyJobA(PolyJob):
    __mapper_args__ = {"polymorphic_identity": "a"}  # noqa: RUF012 - SQLAlchemy's own


class PolyJobA1(PolyJobA):
    __mapper_args__ = {"polymorphic_identity": "a1"}  # noqa: RUF012 - SQLAlchemy's own


class PolyJobB(PolyJob):
    __mapper_args__ = {"polymorphic_identity": "b"}  # noqa: RUF012 - SQLAlchemy's own


class Encoded(TypeDecorator[str]):
    """A type whose stored value only SQL produces, as in SQLAlchemy's ``pgp_sym_encrypt``
    example (``bind_expression`` and ``column_expression``), with built-in functions: the
    INSERT stores the text base64-encoded, SELECTs of the column decode it."""

    impl = Text
    cache_ok = True

    def bind_expression(self, bindvalue: Any) -> Any:
        return func.encode(func.convert_to(bindvalue, "UTF8"), "base64")

    def column_expression(self, col: Any) -> Any:
        return func.convert_from(func.decode(col, "base64"), "UTF8")


class EncodedJob(Base, JobMixin):
    """A queue table with a column whose stored value only SQL can produce."""

    __tablename__ = "encoded_jobs"

    secret: Mapped[str | None] = mapped_column(Encoded())


def _routing(context: Any) -> str:
    """A context-sensitive default: reads the INSERT's other values and its column."""
    params = context.get_current_parameters()
    return f"{context.current_column.key}:{params.get('customer')}"


class RoutedJob(Base, JobMixin):
    """A queue table with a column default that takes SQLAlchemy's execution context."""

    __tablename__ = "routed_jobs"

    customer: Mapped[str | None] = mapped_column(String(100))
    routing: Mapped[str] = mapped_column(String(200), default=_routing)


class DocumentJob(Base, JobMixin):
    """A queue table with unbounded text columns: one row of them can outgrow PostgreSQL."""

    __tablename__ = "document_jobs"

    subject: Mapped[str | None] = mapped_column(Text)
    body: Mapped[str | None] = mapped_column(Text)
    html: Mapped[str | None] = mapped_column(Text)
    attachment: Mapped[str | None] = mapped_column(Text)


class InheritedJob(Base, JobMixin):
    """A queue model mapped with single-table inheritance: ``kind`` says which class a row
    is; the ORM writes the class's identity there."""

    __tablename__ = "inherited_jobs"
    __mapper_args__ = {"polymorphic_on": "kind", "polymorphic_identity": "base"}  # noqa: RUF012 - declarative

    kind: Mapped[str] = mapped_column(String(20))


class InheritedJobA(InheritedJob):
    __mapper_args__ = {"polymorphic_identity": "a"}  # noqa: RUF012 - declarative


class InheritedJobB(InheritedJob):
    __mapper_args__ = {"polymorphic_identity": "b"}  # noqa: RUF012 - declarative
