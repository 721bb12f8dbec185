"""SQLModel models of the SQLModel tests: SQLModel keeps every table model in one
``SQLModel.metadata``, so they are defined once, here, with table names of their own."""

from __future__ import annotations

import os

from sqlalchemy import CheckConstraint, Index, create_engine
from sqlalchemy.orm import sessionmaker
from sqlmodel import Field, SQLModel

from sqla_queue import Worker
from sqla_queue.sqlmodel import IdempotencyKeyModel, JobModel, QueueSession, TaskModel


class Shipment(SQLModel, table=True):
    """A business table: the outbox tests write one beside each job."""

    __tablename__ = "sqlmodel_shipments"

    id: int | None = Field(default=None, primary_key=True)
    address: str = Field(max_length=200)


class ShipJob(JobModel, table=True):
    """A typed queue table with the user's own foreign key, column, index and CHECK."""

    __tablename__ = "sqlmodel_ship_jobs"
    __table_args__ = (
        Index("ix_sqlmodel_ship_jobs_shipment", "shipment_id"),
        CheckConstraint("length(carrier) > 0", name="ck_sqlmodel_ship_jobs_carrier"),
    )

    shipment_id: int | None = Field(default=None, foreign_key="sqlmodel_shipments.id")
    carrier: str = Field(default="post", max_length=50)


class BareJob(JobModel, table=True):
    """Nothing but the queue columns."""

    __tablename__ = "sqlmodel_bare_jobs"


class SqlTask(TaskModel, table=True):
    """A generic task table."""

    __tablename__ = "sqlmodel_tasks"


class KeyedJob(JobModel, IdempotencyKeyModel, table=True):
    """A queue table with the opt-in idempotency key."""

    __tablename__ = "sqlmodel_keyed_jobs"

    note: str = Field(default="", max_length=50)


class Handled(SQLModel, table=True):
    """Written by transactional handlers, in the job's transaction."""

    __tablename__ = "sqlmodel_handled"

    id: int | None = Field(default=None, primary_key=True)
    job_id: int
    note: str = Field(max_length=200)


TABLES = [SQLModel.metadata.tables[m.__tablename__] for m in (Shipment, ShipJob, BareJob, SqlTask, KeyedJob, Handled)]


def make_worker() -> Worker:
    """The CLI's worker target: a thread Worker whose SQLModel handler records each job."""
    engine = create_engine(os.environ["SQLA_QUEUE_TEST_URL"])
    sessions = sessionmaker(engine, class_=QueueSession)

    def ship(job: ShipJob, session: QueueSession) -> None:
        session.add(Handled(job_id=job.id or 0, note=f"cli {job.carrier}"))

    return Worker(engine, ShipJob, ship, session_factory=sessions)
