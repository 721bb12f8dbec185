"""Alembic autogenerate on a SQLModel project, run as a user runs it (``sqla-queue alembic
init``, ``alembic revision --autogenerate``, ``alembic upgrade``): the tables, the queue's
partial indexes and CHECK come out as for the same tables written with ``JobMixin``."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from .test_alembic import NewDatabase, Project, new_database, run, schema, sqla_queue_init

__all__ = ["new_database"]  # the fixture, used here

pytestmark = pytest.mark.system

SQLMODEL_MODELS = """
    from sqlalchemy import CheckConstraint, Index
    from sqlmodel import Field, SQLModel

    from sqla_queue.sqlmodel import JobModel, TaskModel


    class Order(SQLModel, table=True):
        __tablename__ = "orders"
        id: int | None = Field(default=None, primary_key=True)
        customer: str = Field(max_length=100)


    class EmailJob(JobModel, table=True):
        __tablename__ = "email_jobs"
        __table_args__ = (
            Index("ix_email_jobs_order", "order_id"),
            CheckConstraint("length(recipient) > 0", name="ck_email_jobs_recipient"),
        )
        order_id: int | None = Field(default=None, foreign_key="orders.id")
        recipient: str = Field(max_length=200)


    class Task(TaskModel, table=True):
        __tablename__ = "tasks"
"""

#: The same tables with the declarative mixins: what the SQLModel project must migrate to.
MIXIN_MODELS = """
    from sqlalchemy import CheckConstraint, ForeignKey, Index, String
    from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

    from sqla_queue import JobMixin, TaskMixin


    class Base(DeclarativeBase):
        pass


    class Order(Base):
        __tablename__ = "orders"
        id: Mapped[int] = mapped_column(primary_key=True)
        customer: Mapped[str] = mapped_column(String(100))


    class EmailJob(Base, JobMixin):
        __tablename__ = "email_jobs"
        __table_args__ = (
            Index("ix_email_jobs_order", "order_id"),
            CheckConstraint("length(recipient) > 0", name="ck_email_jobs_recipient"),
        )
        order_id: Mapped[int | None] = mapped_column(ForeignKey("orders.id"))
        recipient: Mapped[str] = mapped_column(String(200))


    class Task(Base, TaskMixin):
        __tablename__ = "tasks"
"""


#: What the SQLModel guide tells users to put in ``env.py`` for ``target_metadata = None``.
ENV_TARGET = """\
import models  # noqa: F401  (defines the tables)
from sqlmodel import SQLModel
target_metadata = SQLModel.metadata
"""
#: And in ``script.py.mako`` after ``import sqlalchemy as sa``.
MAKO_IMPORTS = """\
import sqlalchemy as sa
import sqlmodel
"""


def sqlmodel_project(root: Path, url: object) -> Project:
    """``sqla-queue alembic init``, then the two edits the SQLModel guide tells users to make."""
    project = sqla_queue_init(root, url)  # type: ignore[arg-type]
    env = root / "migrations" / "env.py"
    source = env.read_text()
    assert "\nfrom models import Base\ntarget_metadata = Base.metadata\n" in source
    env.write_text(
        source.replace(
            "\nfrom models import Base\ntarget_metadata = Base.metadata\n",
            "\n" + ENV_TARGET,
        )
    )
    # SQLModel's str fields are sqlmodel.sql.sqltypes.AutoString: migrations import sqlmodel.
    mako = root / "migrations" / "script.py.mako"
    template = mako.read_text()
    assert "\nimport sqlalchemy as sa\n" in template
    mako.write_text(template.replace("\nimport sqlalchemy as sa\n", "\n" + MAKO_IMPORTS))
    project.models(SQLMODEL_MODELS)
    return project


def test_autogenerate_of_sqlmodel_tables_is_the_mixins_schema(tmp_path: Path, new_database: NewDatabase) -> None:
    root = tmp_path / "app"
    root.mkdir()
    project = sqlmodel_project(root, new_database())
    migration = project.autogenerate("queue tables")
    upgrade = project.upgrade_body(migration)
    for table in ("orders", "email_jobs", "tasks"):
        assert f"op.create_table('{table}'" in upgrade
    assert "name=op.f('email_jobs_status_check')" in upgrade
    assert "name=op.f('tasks_status_check')" in upgrade
    assert upgrade.count("postgresql_where=") == 12  # 6 partial indexes x 2 queue tables
    assert "op.create_index(op.f('email_jobs_claim_idx'), 'email_jobs'" in upgrade
    assert "sa.Identity(" in upgrade and "info=" not in upgrade
    assert "sqlmodel.sql.sqltypes.AutoString(length=200)" in upgrade  # the user's own str field

    project.alembic("upgrade", "head")
    migrated = schema(project.url)
    assert set(migrated) == {"orders", "email_jobs", "tasks", "pg_indexes"}
    assert (
        "WHERE ((status)::text = 'pending'::text)" in migrated["pg_indexes"]["email_jobs_claim_idx"][0]
    )

    # The same tables written with JobMixin/TaskMixin, created by metadata.create_all.
    reference = new_database()
    mixin_root = tmp_path / "mixin"
    mixin_root.mkdir()
    (mixin_root / "models.py").write_text(textwrap.dedent(MIXIN_MODELS))
    code = "import sys, models, sqlalchemy; models.Base.metadata.create_all(sqlalchemy.create_engine(sys.argv[1]))"
    run([sys.executable, "-c", code, reference.render_as_string(hide_password=False)], mixin_root)
    assert migrated == schema(reference)

    second = project.upgrade_body(project.autogenerate("nothing"))
    code_lines = [line.strip() for line in second.splitlines()[2:]]
    assert [line for line in code_lines if line and not line.startswith("#")] == ["pass"]
    project.alembic("upgrade", "head")
    project.alembic("check")

    # An index added to the existing queue table is built concurrently, as on a mixin's.
    project.models(
        SQLMODEL_MODELS.replace(
            'Index("ix_email_jobs_order", "order_id"),',
            'Index("ix_email_jobs_order", "order_id"), Index("ix_email_jobs_recipient", "recipient"),',
        )
    )
    upgrade = project.upgrade_body(project.autogenerate("an index"))
    assert "sq_ops.create_index_concurrently('ix_email_jobs_recipient', 'email_jobs', ['recipient']" in upgrade
    project.alembic("upgrade", "head")
    assert schema(project.url)["pg_indexes"]["ix_email_jobs_recipient"] == (
        "CREATE INDEX ix_email_jobs_recipient ON public.email_jobs USING btree (recipient)",
        True,
    )

    project.alembic("downgrade", "base")
    assert set(schema(project.url)) == {"pg_indexes"} and schema(project.url)["pg_indexes"] == {}
