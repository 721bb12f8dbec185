"""The mixin's schema on real PostgreSQL: columns, CHECK, partial indexes, user additions."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import (
    Column,
    Engine,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    inspect,
    text,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, declarative_base, mapped_column

from sqla_queue import JobMixin, NotAQueueModel, TaskMixin, queue_table
from sqla_queue.model import constraint_name

from .helpers import Server, table_of
from .models import EmailJob, ReportJob, Task


def _indexes(engine: Engine, table: str) -> dict[str, str]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = :t"), {"t": table}
        )
        return dict(rows.all())


def test_mixin_schema_survives_user_table_args(engine: Engine) -> None:
    indexes = _indexes(engine, "email_jobs")
    assert "ix_email_jobs_order" in indexes  # the user's own index
    claim = indexes["email_jobs_claim_idx"]
    assert "(priority DESC, run_after, id)" in claim
    assert "WHERE ((status)::text = 'pending'::text)" in claim
    assert "(queue, priority DESC, run_after, id)" in indexes["email_jobs_claim_queue_idx"]
    assert "isolated" in indexes["email_jobs_isolated_idx"]
    lease = indexes["email_jobs_lease_idx"]
    assert "(lease_expires_at)" in lease and "'running'::text" in lease
    assert "(finished_at) WHERE (finished_at IS NOT NULL)" in indexes["email_jobs_finished_idx"]

    checks = {c["name"] for c in inspect(engine).get_check_constraints("email_jobs")}
    assert {"email_jobs_status_check", "ck_email_jobs_recipient"} <= checks
    fks = inspect(engine).get_foreign_keys("email_jobs")
    assert [fk["referred_table"] for fk in fks] == ["orders"]


def test_status_check_rejects_unknown_status(engine: Engine) -> None:
    with pytest.raises(IntegrityError, match="email_jobs_status_check"), engine.begin() as conn:
        conn.execute(table_of(EmailJob).insert().values(status="exploded", recipient="a@b"))


def test_each_queue_table_gets_its_own_columns_and_indexes() -> None:
    assert table_of(EmailJob).c.status is not table_of(ReportJob).c.status
    email = {i.name for i in table_of(EmailJob).indexes}
    report = {i.name for i in table_of(ReportJob).indexes}
    assert "report_jobs_claim_idx" in report and "report_jobs_claim_idx" not in email
    assert queue_table(EmailJob).channel != queue_table(ReportJob).channel


def test_task_mixin_adds_task_and_jsonb_payload(engine: Engine) -> None:
    columns = {c["name"]: c for c in inspect(engine).get_columns("tasks")}
    assert str(columns["payload"]["type"]) == "JSONB"
    assert columns["task"]["nullable"] is False
    assert queue_table(Task).is_task_table and not queue_table(EmailJob).is_task_table


def test_long_table_names_get_short_unique_index_names(server: Server) -> None:
    class Base(DeclarativeBase):
        pass

    long_a = "a_long_queue_table_name_for_the_accounting_department_one"
    assert len(long_a) <= 63 < len(long_a + "_claim_queue_idx")
    long_b = long_a[:-3] + "two"
    models = [
        type(f"Long{i}", (Base, JobMixin), {"__tablename__": name})
        for i, name in enumerate([long_a, long_b])
    ]
    names = [i.name for m in models for i in table_of(m).indexes]
    assert all(len(str(n).encode()) <= 63 for n in names)
    assert len(set(names)) == len(names) == 12
    engine = create_engine(server.url)
    try:
        Base.metadata.create_all(engine)  # IdentifierError if a name were too long
        assert len(_indexes(engine, long_a)) == 7  # 5 queue indexes, the unique jobs one, primary key
    finally:
        Base.metadata.drop_all(engine)
        engine.dispose()


def test_constraint_name_is_stable_and_bounded() -> None:
    assert constraint_name("jobs", "claim_idx") == "jobs_claim_idx"
    long = constraint_name("x" * 100, "claim_queue_idx")
    assert len(long) == 63 and long == constraint_name("x" * 100, "claim_queue_idx")


@pytest.fixture
def scratch_engine(server: Server) -> Iterator[Engine]:
    engine = create_engine(server.url)
    yield engine
    engine.dispose()


def test_legacy_declarative_base_with_naming_convention(scratch_engine: Engine) -> None:
    convention = {"ix": "ix_%(column_0_label)s", "ck": "ck_%(table_name)s_%(constraint_name)s"}
    Legacy = declarative_base(metadata=MetaData(naming_convention=convention))

    class LegacyJob(Legacy, JobMixin):  # type: ignore[misc, valid-type]
        __tablename__ = "legacy_jobs"
        __table_args__ = {"comment": "the user's own table args, as a dict"}  # noqa: RUF012 - declarative

    Legacy.metadata.create_all(scratch_engine)
    try:
        indexes = _indexes(scratch_engine, "legacy_jobs")
        # conv() names are not re-prefixed by the user's naming convention
        assert "legacy_jobs_claim_idx" in indexes
        checks = {c["name"] for c in inspect(scratch_engine).get_check_constraints("legacy_jobs")}
        assert checks == {"legacy_jobs_status_check"}
    finally:
        Legacy.metadata.drop_all(scratch_engine)


def test_flask_sqlalchemy_model(scratch_engine: Engine) -> None:
    flask = pytest.importorskip("flask")
    from flask_sqlalchemy import SQLAlchemy

    app = flask.Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = scratch_engine.url.render_as_string(hide_password=False)
    db = SQLAlchemy(app)

    class Shipment(db.Model):  # type: ignore[name-defined, misc]
        id: Mapped[int] = mapped_column(primary_key=True)

    class ShipmentJob(db.Model, JobMixin):  # type: ignore[name-defined, misc]
        shipment_id: Mapped[int] = mapped_column(ForeignKey(Shipment.id))

    with app.app_context():
        db.create_all()
        try:
            assert ShipmentJob.__tablename__ == "shipment_job"
            assert "shipment_job_claim_idx" in _indexes(db.engine, "shipment_job")
        finally:
            db.drop_all()
            db.engine.dispose()


def test_single_table_inheritance_does_not_duplicate_indexes() -> None:
    class Base(DeclarativeBase):
        pass

    class Job(Base, JobMixin):
        __tablename__ = "sti_jobs"
        kind: Mapped[str] = mapped_column(String(20))
        __mapper_args__ = {"polymorphic_on": "kind", "polymorphic_identity": "job"}  # noqa: RUF012 - declarative

    class SpecialJob(Job):
        __mapper_args__ = {"polymorphic_identity": "special"}  # noqa: RUF012 - declarative

    assert len(table_of(Job).indexes) == 6
    assert queue_table(SpecialJob).table is table_of(Job)


def test_queue_table_rejects_non_queue_models() -> None:
    class Base(DeclarativeBase):
        pass

    class Plain(Base):
        __tablename__ = "plain"
        id: Mapped[int] = mapped_column(primary_key=True)

    with pytest.raises(NotAQueueModel, match="missing columns"):
        queue_table(Plain)
    with pytest.raises(NotAQueueModel, match="not a mapped class"):
        queue_table(object)
    with pytest.raises(NotAQueueModel, match="missing columns"):
        queue_table(Table("t", MetaData(), Column("id", Integer, primary_key=True)))


def test_several_task_tables_share_the_mixin() -> None:
    class Base(DeclarativeBase):
        pass

    class A(Base, TaskMixin):
        __tablename__ = "tasks_a"

    class B(Base, TaskMixin):
        __tablename__ = "tasks_b"
        __table_args__ = (Index("ix_tasks_b_task", "task"),)

    assert {i.name for i in table_of(B).indexes} >= {"tasks_b_claim_idx", "ix_tasks_b_task"}
    assert table_of(A).c.payload is not table_of(B).c.payload
