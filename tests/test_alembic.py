"""Alembic, run as users run it: the ``sqla-queue``, ``alembic`` and ``flask`` commands in a
project folder of their own, each test against a database of its own.

Each command runs in a process of its own; most in a forked one that starts in
milliseconds (``tests/console.py``), and ``test_sqla_queue_alembic_init`` (and Flask's
``init``) as typed, in a new interpreter."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import alembic
import pytest
from alembic.autogenerate import produce_migrations, render_python_code
from alembic.operations.ops import CreateIndexOp, UpgradeOps
from alembic.runtime.migration import MigrationContext
from sqlalchemy import (
    URL,
    Column,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    inspect,
    text,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.pool import NullPool
from sqlalchemy.schema import CreateIndex

from sqla_queue import sql as q
from sqla_queue.alembic import (
    CreateIndexConcurrentlyOp,
    CreateQueueIndexesOp,
    compose,
    queue_schema_table,
)
from sqla_queue.model import WORKFLOW_COLUMNS, constraint_name

from . import console
from .helpers import Server, table_of
from .models import EmailJob, UuidJob

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parent.parent
NewDatabase = Callable[[], URL]


@pytest.fixture
def new_database(server: Server) -> Iterator[NewDatabase]:
    """Fresh databases for one test (its own ``alembic_version``), dropped at the end."""
    admin = create_engine(server.admin_url, isolation_level="AUTOCOMMIT")
    names: list[str] = []

    def create() -> URL:
        name = f"sqla_queue_alembic_{uuid.uuid4().hex[:10]}"
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        names.append(name)
        return server.admin_url.set(database=name)

    try:
        yield create
    finally:
        with admin.connect() as conn:
            for name in names:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def run(command: list[str | Path], cwd: Path, *, ok: bool = True, fresh: bool = False, **env: str) -> str:
    """Run a console script; its stdout and stderr together. Fails the test on a bad exit.

    ``fresh``: in a new interpreter, as typed; else in a forked process that starts in
    milliseconds (``tests/console.py``), the same entry point, folder and environment."""
    # this checkout's sqla_queue, whatever the environment has installed
    environment = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1",
                   "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **env}
    result: subprocess.CompletedProcess[str] | console.Result
    if fresh:
        result = subprocess.run(
            [str(part) for part in command],
            check=False,
            cwd=cwd,
            env=environment,
            capture_output=True,
            text=True,
            timeout=90,
        )
    else:
        result = console.run(command, cwd, environment, timeout=90)
    output = result.stdout + result.stderr
    if (result.returncode == 0) != ok:
        raise AssertionError(f"{command} exited {result.returncode}:\n{output}")
    return output


class Project:
    """A user's project: ``alembic.ini``, ``migrations/`` and a ``models.py``."""

    def __init__(self, root: Path, url: URL, fresh: bool = False) -> None:
        self.root = root
        self.url = url
        self.versions = root / "migrations" / "versions"
        #: Run the commands in new interpreters, as typed (see :func:`run`).
        self.fresh = fresh

    def alembic(self, *args: str, ok: bool = True) -> str:
        return run([BIN / "alembic", "-c", "alembic.ini", *args], self.root, ok=ok, fresh=self.fresh)

    def models(self, source: str) -> None:
        (self.root / "models.py").write_text(textwrap.dedent(source))

    def autogenerate(self, message: str) -> str:
        """``alembic revision --autogenerate``; the new migration file's text."""
        before = set(self.versions.glob("*.py"))
        self.alembic("revision", "--autogenerate", "-m", message)
        (new,) = set(self.versions.glob("*.py")) - before
        return new.read_text()

    def upgrade_body(self, migration: str) -> str:
        return migration.split("def upgrade()")[1].split("def downgrade()")[0]

    def create_all(self, url: URL) -> None:
        """``metadata.create_all()`` of the current models, in a process of its own."""
        code = "import sys, models, sqlalchemy; models.Base.metadata.create_all(sqlalchemy.create_engine(sys.argv[1]))"
        run([sys.executable, "-c", code, url.render_as_string(hide_password=False)], self.root, fresh=self.fresh)


def sqla_queue_init(root: Path, url: URL, fresh: bool = False) -> Project:
    """``sqla-queue alembic init migrations``, then the two edits every user makes."""
    out = run([BIN / "sqla-queue", "alembic", "init", "migrations"], root, fresh=fresh)
    assert "set target_metadata" in out
    ini = root / "alembic.ini"
    database = url.render_as_string(hide_password=False).replace("%", "%%")
    ini.write_text(
        re.sub(
            r"(?m)^sqlalchemy\.url = .*$", lambda _: f"sqlalchemy.url = {database}", ini.read_text()
        )
    )
    env = root / "migrations" / "env.py"
    source = env.read_text()
    assert "\ntarget_metadata = None\n" in source
    env.write_text(
        source.replace(
            "\ntarget_metadata = None\n",
            "\nfrom models import Base\ntarget_metadata = Base.metadata\n",
        )
    )
    return Project(root, url, fresh=fresh)


@pytest.fixture
def project(tmp_path: Path, new_database: NewDatabase) -> Project:
    return sqla_queue_init(tmp_path, new_database())


def schema(url: URL) -> dict[str, Any]:
    """Everything the inspector reports about each table, plus PostgreSQL's index DDL."""
    engine = create_engine(url)
    try:
        insp = inspect(engine)
        tables: dict[str, Any] = {}
        for name in insp.get_table_names():
            if name == "alembic_version":
                continue
            tables[name] = {
                "columns": {
                    c["name"]: (
                        repr(c["type"]),
                        c["nullable"],
                        c["default"],
                        c.get("identity"),
                        c.get("comment"),
                    )
                    for c in insp.get_columns(name)
                },
                "pk": insp.get_pk_constraint(name),
                "fks": sorted(insp.get_foreign_keys(name), key=repr),
                "indexes": sorted(insp.get_indexes(name), key=lambda i: str(i["name"])),
                "checks": sorted(insp.get_check_constraints(name), key=lambda c: str(c["name"])),
                "uniques": sorted(insp.get_unique_constraints(name), key=repr),
                "comment": insp.get_table_comment(name)["text"],
            }
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT i.indexname, i.indexdef, x.indisvalid FROM pg_indexes i "
                    "JOIN pg_class c ON c.relname = i.indexname "
                    "JOIN pg_index x ON x.indexrelid = c.oid "
                    "WHERE i.schemaname = 'public' AND i.tablename <> 'alembic_version'"
                )
            ).all()
        tables["pg_indexes"] = {row.indexname: (row.indexdef, row.indisvalid) for row in rows}
        return tables
    finally:
        engine.dispose()


def outside_transactions(offline_sql: str) -> list[str]:
    """The statements of ``alembic upgrade --sql`` output that run outside BEGIN … COMMIT."""
    outside, in_transaction = [], False
    for chunk in offline_sql.split(";"):
        statement = " ".join(
            line.strip()
            for line in chunk.splitlines()
            if line.strip() and not line.startswith(("--", "INFO"))
        )
        if statement == "BEGIN":
            in_transaction = True
        elif statement == "COMMIT":
            in_transaction = False
        elif statement and not in_transaction:
            outside.append(statement)
    return outside


LONG_NAME = "queue_of_jobs_with_a_deliberately_long_name_so_index_names_hash"

MODELS = """
    import uuid

    from sqlalchemy import CheckConstraint, ForeignKey, Index, String, Uuid
    from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

    from sqla_queue import JobMixin, TaskMixin


    class Base(DeclarativeBase):
        pass


    class Order(Base):
        __tablename__ = "orders"
        id: Mapped[int] = mapped_column(primary_key=True)
        customer: Mapped[str] = mapped_column(String(100)#CUSTOMER_INDEX#)


    class EmailJob(Base, JobMixin):
        __tablename__ = "email_jobs"
        __table_args__ = (
            Index("ix_email_jobs_order", "order_id"),#EMAIL_INDEX#
            CheckConstraint("length(recipient) > 0", name="ck_email_jobs_recipient"),
            {"comment": "the user's own table args"},
        )
        order_id: Mapped[int | None] = mapped_column(ForeignKey("orders.id"))
        recipient: Mapped[str] = mapped_column(String(200))


    class Task(Base, TaskMixin):
        __tablename__ = "tasks"


    class LongJob(Base, JobMixin):
        __tablename__ = "#LONG_NAME#"
        id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    #MORE#
"""


def models(email_index: bool = False, customer_index: bool = False, more: str = "") -> str:
    source = MODELS.replace("#LONG_NAME#", LONG_NAME).replace(
        "#MORE#", textwrap.indent(textwrap.dedent(more), "    ")
    )
    source = source.replace(
        "#EMAIL_INDEX#", ' Index("ix_email_jobs_recipient", "recipient"),' if email_index else ""
    )
    return source.replace("#CUSTOMER_INDEX#", ", index=True" if customer_index else "")


REPORT_JOB = """
    class ReportJob(Base, JobMixin):
        __tablename__ = "report_jobs"
"""


@pytest.mark.system
def test_autogenerate_creates_what_create_all_creates(
    project: Project, new_database: NewDatabase
) -> None:
    project.models(models())
    migration = project.autogenerate("queue tables")
    upgrade = project.upgrade_body(migration)
    for table in ("email_jobs", "tasks", LONG_NAME):
        assert f"op.create_table('{table}'" in upgrade
    assert "name=op.f('email_jobs_status_check')" in upgrade
    assert upgrade.count("postgresql_where=") == 18  # 6 partial indexes x 3 queue tables
    # tables new in this revision get plain indexes, in the migration's transaction
    assert "concurrently" not in migration and "sqla_queue" not in migration
    assert "info=" not in migration  # the mixin's marker in Table.info is not rendered

    project.alembic("upgrade", "head")
    reference = new_database()
    project.create_all(reference)
    migrated, created = schema(project.url), schema(reference)
    assert set(migrated) == {"orders", "email_jobs", "tasks", LONG_NAME, "pg_indexes"}
    assert migrated == created
    assert (
        "WHERE ((status)::text = 'pending'::text)"
        in migrated["pg_indexes"]["email_jobs_claim_idx"][0]
    )

    second = project.upgrade_body(project.autogenerate("nothing"))
    code = [line.strip() for line in second.splitlines()[2:]]
    assert [line for line in code if line and not line.startswith("#")] == ["pass"]


@pytest.mark.system
def test_new_index_on_existing_queue_table_is_built_concurrently(
    project: Project, new_database: NewDatabase, tmp_path: Path
) -> None:
    project.models(models())
    project.autogenerate("initial")
    project.alembic("upgrade", "head")
    engine = create_engine(project.url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(
            text("INSERT INTO email_jobs (recipient) VALUES ('a@example.com'), ('b@example.com')")
        )
    engine.dispose()

    project.models(models(email_index=True, customer_index=True, more=REPORT_JOB))
    assert "New upgrade operations detected" in project.alembic("check", ok=False)
    migration = project.autogenerate("more indexes")
    assert "\nfrom sqla_queue import alembic_ops as sq_ops" in migration
    upgrade = project.upgrade_body(migration)
    assert (
        "sq_ops.create_index_concurrently('ix_email_jobs_recipient', 'email_jobs', ['recipient']"
        in upgrade
    )
    # queue tables only: an index on another existing table stays a plain one,
    assert "op.create_index(op.f('ix_orders_customer'), 'orders'" in upgrade
    # and so do the indexes of a queue table created in the same revision
    assert "op.create_index(op.f('report_jobs_claim_idx')" in upgrade
    assert upgrade.count("concurrently") == 1
    downgrade = migration.split("def downgrade()")[1]
    assert (
        "sq_ops.drop_index_concurrently('ix_email_jobs_recipient', table_name='email_jobs')"
        in downgrade
    )
    assert "op.drop_index(op.f('report_jobs_claim_idx')" in downgrade

    offline = project.alembic("upgrade", "--sql", "base:head")
    outside = outside_transactions(offline)
    assert outside == [
        "CREATE INDEX CONCURRENTLY ix_email_jobs_recipient ON email_jobs (recipient)"
    ]
    assert "CREATE INDEX report_jobs_claim_idx" in offline  # inside the transaction

    project.alembic("upgrade", "head")
    indexes = schema(project.url)["pg_indexes"]
    assert indexes["ix_email_jobs_recipient"] == (
        "CREATE INDEX ix_email_jobs_recipient ON public.email_jobs USING btree (recipient)",
        True,
    )
    project.alembic("check")

    project.alembic("downgrade", "-1")
    after = schema(project.url)
    assert "ix_email_jobs_recipient" not in after["pg_indexes"] and "report_jobs" not in after
    project.alembic("upgrade", "head")
    assert "ix_email_jobs_recipient" in schema(project.url)["pg_indexes"]

    # The generated file runs on its own: a fresh database, Alembic's generic env.py
    # (no sqla_queue import, no hook), one transaction for all migrations.
    generic = Path(alembic.__file__).parent / "templates" / "generic" / "env.py"
    shutil.copy(generic, project.root / "migrations" / "env.py")
    fresh = new_database()
    ini = project.root / "alembic.ini"
    ini.write_text(ini.read_text().replace(project.url.database or "?", fresh.database or "?"))
    project.alembic("upgrade", "head")
    assert schema(fresh)["pg_indexes"]["ix_email_jobs_recipient"][1] is True


@pytest.mark.system
def test_generated_migrations_pass_mypy_strict(project: Project, tmp_path: Path) -> None:
    """The concurrent and queue-index operations autogenerate writes are typed calls."""
    project.models(models())
    project.autogenerate("initial")
    project.alembic("upgrade", "head")
    project.models(models(email_index=True, customer_index=True))
    migration = project.autogenerate("more indexes")
    assert "sq_ops.create_index_concurrently(" in migration
    assert "sq_ops.drop_index_concurrently(" in migration
    hand_written = project.versions / "hand_written_typed.py"
    hand_written.write_text(
        textwrap.dedent(
            """\
            from sqla_queue import alembic_ops as sq_ops


            def upgrade() -> None:
                sq_ops.create_queue_indexes("email_jobs", concurrently=True, check=True)


            def downgrade() -> None:
                sq_ops.drop_queue_indexes("email_jobs", concurrently=True, check=True)
            """
        )
    )
    files = [*project.versions.glob("*.py")]
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", *map(str, files)],
        check=False,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    hand_written.unlink()
    # and the file still runs
    project.alembic("upgrade", "head")
    assert "ix_email_jobs_recipient" in schema(project.url)["pg_indexes"]


@pytest.mark.system
def test_adding_the_mixin_to_a_table_with_rows(project: Project, new_database: NewDatabase) -> None:
    plain = """
        from sqlalchemy import String
        from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

        from sqla_queue import JobMixin


        class Base(DeclarativeBase):
            pass


        class Notification(Base):
            __tablename__ = "notifications"
            id: Mapped[int] = mapped_column(primary_key=True)
            body: Mapped[str] = mapped_column(String(100))
    """
    project.models(plain)
    project.autogenerate("notifications")
    project.alembic("upgrade", "head")
    engine = create_engine(project.url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO notifications (body) SELECT 'n' || i FROM generate_series(1, 50) i"
                )
            )
        before = schema(project.url)

        project.models(
            plain.replace("class Notification(Base):", "class Notification(Base, JobMixin):")
        )
        migration = project.autogenerate("notifications become a queue")
        upgrade = project.upgrade_body(migration)
        assert (
            "op.add_column('notifications', sa.Column('status', sa.String(length=16), "
            "server_default='pending', nullable=False))"
            in upgrade
        )
        assert upgrade.count("sq_ops.create_index_concurrently(") == 6
        # autogenerate never adds a CHECK to an existing table: the hook does
        assert (
            "op.create_check_constraint(op.f('notifications_status_check'), 'notifications'"
            in upgrade
        )

        project.alembic("upgrade", "head")
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT body, status, queue, attempts, max_attempts, run_after FROM notifications"
                )
            ).all()
        assert len(rows) == 50
        assert {(r.status, r.queue, r.attempts, r.max_attempts) for r in rows} == {
            ("pending", "default", 0, 20)
        }
        assert all(r.run_after is not None for r in rows)
        reference = new_database()
        project.create_all(reference)
        assert schema(project.url) == schema(reference)
        project.alembic("check")

        # the old rows are jobs now: the claim takes them through the partial index
        notifications = Table("notifications", MetaData(), autoload_with=engine)
        with engine.begin() as conn:
            claimed = conn.execute(q.claim(notifications, owner="w1", limit=100)).all()
        assert len(claimed) == 50

        project.alembic("downgrade", "-1")
        assert schema(project.url) == before
        with engine.connect() as conn:
            assert conn.scalar(text("SELECT count(*) FROM notifications")) == 50
    finally:
        engine.dispose()


ONE_JOB_PER_ORDER = """
    from sqla_queue import UNIQUE_EVER, UniqueJobs


    class OrderJob(Base, JobMixin):
        __tablename__ = "order_jobs"
        __queue_unique__ = UniqueJobs(column="order_id", statuses=UNIQUE_EVER)
        order_id: Mapped[int | None] = mapped_column(ForeignKey("orders.id"))
"""


@pytest.mark.system
def test_unique_jobs_migrate_onto_existing_queue_tables(project: Project, new_database: NewDatabase) -> None:
    """A queue table made before unique jobs gains the nullable ``unique_key`` column and
    its partial unique index (built concurrently, the table being there already); a new
    model keyed by a column of its own gets its index on that column."""
    project.models(models())
    project.autogenerate("initial")
    project.alembic("upgrade", "head")
    engine = create_engine(project.url, poolclass=NullPool)
    try:
        with engine.begin() as conn:  # as the tables were before unique jobs
            conn.execute(text("ALTER TABLE email_jobs DROP COLUMN unique_key"))
            conn.execute(text("ALTER TABLE tasks DROP COLUMN unique_key"))
            conn.execute(text("INSERT INTO email_jobs (recipient) VALUES ('a@example.com')"))
    finally:
        engine.dispose()
    project.models(models(more=ONE_JOB_PER_ORDER))
    migration = project.autogenerate("unique jobs")
    upgrade = project.upgrade_body(migration)
    for table in ("email_jobs", "tasks"):
        assert (
            f"op.add_column('{table}', sa.Column('unique_key', sa.String(length=255), nullable=True))" in upgrade
        )
        concurrently = (
            f"sq_ops.create_index_concurrently(op.f('{table}_unique_idx'), '{table}', ['unique_key'], unique=True"
        )
        assert concurrently in upgrade, upgrade
    assert "op.create_index(op.f('order_jobs_unique_idx'), 'order_jobs', ['order_id'], unique=True" in upgrade
    project.alembic("upgrade", "head")
    indexes = schema(project.url)["pg_indexes"]
    created = (
        "CREATE UNIQUE INDEX email_jobs_unique_idx ON public.email_jobs USING btree (unique_key) WHERE "
        "((unique_key IS NOT NULL) AND (((status)::text = 'pending'::text) OR ((status)::text = 'running'::text)))"
    )
    assert indexes["email_jobs_unique_idx"] == (created, True)
    assert "'done'" in indexes["order_jobs_unique_idx"][0] and "(order_id)" in indexes["order_jobs_unique_idx"][0]
    reference = new_database()
    project.create_all(reference)
    assert schema(project.url) == schema(reference)
    project.alembic("check")


@pytest.mark.system
def test_queue_index_operations_in_hand_written_migrations(
    project: Project, new_database: NewDatabase
) -> None:
    project.models(models())
    project.autogenerate("initial")

    def write(rev: str, down: str, upgrade: str, downgrade: str) -> None:
        (project.versions / f"{rev}_hand_written.py").write_text(
            textwrap.dedent(
                f"""\
                from alembic import op
                import sqla_queue.alembic  # noqa: F401

                revision = {rev!r}
                down_revision = {down!r}
                branch_labels = None
                depends_on = None


                def upgrade():
                    {upgrade}


                def downgrade():
                    {downgrade}
                """
            )
        )

    (first,) = [p.name.split("_")[0] for p in project.versions.glob("*.py")]
    write(
        "b0000000drop",
        first,
        f'op.drop_queue_indexes("email_jobs", concurrently=True, check=True); op.drop_queue_indexes({LONG_NAME!r})',
        f'op.create_queue_indexes("email_jobs", check=True); op.create_queue_indexes({LONG_NAME!r})',
    )
    write(
        "c000000create",
        "b0000000drop",
        'op.create_queue_indexes("email_jobs", concurrently=True, check=True); '
        f"op.create_queue_indexes({LONG_NAME!r}, concurrently=True)",
        f'op.drop_queue_indexes("email_jobs", check=True); op.drop_queue_indexes({LONG_NAME!r})',
    )
    reference = new_database()
    project.create_all(reference)
    expected = schema(reference)

    project.alembic("upgrade", "b0000000drop")
    dropped = schema(project.url)
    # The queue index operations cover the indexes the worker needs; the unique jobs
    # index belongs to the model's own declaration (its column, its statuses) and stays.
    assert {name for name in dropped["pg_indexes"] if name.startswith("email_jobs")} == {
        "email_jobs_pkey", "email_jobs_unique_idx",
    }
    assert [c["name"] for c in dropped["email_jobs"]["checks"]] == ["ck_email_jobs_recipient"]
    assert "ix_email_jobs_order" in dropped["pg_indexes"]  # the user's own index stays
    assert [i["name"] for i in dropped[LONG_NAME]["indexes"]] == [constraint_name(LONG_NAME, "unique_idx")]

    offline = project.alembic("upgrade", "--sql", "b0000000drop:c000000create")
    assert sorted(outside_transactions(offline)) == sorted(
        str(CreateIndex(index).compile(dialect=postgresql.dialect()))  # type: ignore[no-untyped-call]
        .replace("INDEX", "INDEX CONCURRENTLY", 1)
        .strip()
        for name in ("email_jobs", LONG_NAME)
        for index in queue_schema_table(name).indexes
    )
    project.alembic("upgrade", "head")
    assert schema(project.url) == expected  # same names (hashed ones too), WHERE, CHECK

    project.alembic("downgrade", "b0000000drop")
    assert schema(project.url) == dropped
    project.alembic("downgrade", "-1")
    assert schema(project.url) == expected


def test_queue_schema_table_is_the_mixins_schema() -> None:
    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    for model in (EmailJob, UuidJob):
        table = table_of(model)
        mixin = {
            str(CreateIndex(i).compile(dialect=dialect))
            for i in table.indexes
            if i.name and i.name.startswith(table.name + "_") and not i.name.endswith("_unique_idx")
        }
        built = {
            str(CreateIndex(i).compile(dialect=dialect))
            for i in queue_schema_table(table.name).indexes
        }
        assert len(built) == 5 and built == mixin


@pytest.mark.system
def test_sqla_queue_alembic_init(tmp_path: Path, new_database: NewDatabase) -> None:
    """The console scripts as typed, each command in a new interpreter (the other tests
    run the same entry points in forked processes: ``tests/console.py``)."""
    (tmp_path / "migrations").mkdir()  # an empty folder is fine, as for `alembic init`
    project = sqla_queue_init(tmp_path, new_database(), fresh=True)
    assert {p.name for p in (tmp_path / "migrations").iterdir()} == {
        "env.py",
        "script.py.mako",
        "README",
        "versions",
    }
    env = (tmp_path / "migrations" / "env.py").read_text()
    assert "transaction_per_migration=True" in env and "import sqla_queue.alembic" in env
    project.models(
        "from sqlalchemy.orm import DeclarativeBase\n\nclass Base(DeclarativeBase):\n    pass\n"
    )
    project.alembic("revision", "-m", "first")
    project.alembic("upgrade", "head")
    assert "(head)" in project.alembic("current")

    out = run([BIN / "sqla-queue", "alembic", "init", "migrations"], tmp_path, ok=False, fresh=True)
    assert "not empty" in out


def test_hook_composes_with_user_hooks(new_database: NewDatabase) -> None:
    """``compose``: the rewrite, ``all_tables``, then the user's hooks in order."""
    url = new_database()
    engine = create_engine(url)
    metadata = MetaData()
    Table("plain", metadata, Column("id", Integer, primary_key=True), Column("name", String(20)))
    try:
        metadata.create_all(engine)
        Index("ix_plain_name", metadata.tables["plain"].c.name)
        seen: list[str] = []

        def user_hook(context: Any, revision: Any, directives: list[Any]) -> None:
            ops = directives[0].upgrade_ops.ops
            (index_op,) = [
                o for op in ops for o in getattr(op, "ops", [op]) if isinstance(o, CreateIndexOp)
            ]
            seen.append(type(index_op).__name__)

        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"target_metadata": metadata})
            for hook, expected in (
                (compose(user_hook), "CreateIndexOp"),
                (compose(user_hook, all_tables=True), "CreateIndexConcurrentlyOp"),
            ):
                script = produce_migrations(context, metadata)
                hook(context, None, [script])
                assert seen.pop() == expected
            assert script.upgrade_ops is not None
            rendered = render_python_code(script.upgrade_ops)
            assert (
                "sq_ops.create_index_concurrently('ix_plain_name', 'plain', ['name'], unique=False)"
                in rendered
            )
            assert [type(op) for op in script.upgrade_ops.ops] == [CreateIndexConcurrentlyOp]
    finally:
        engine.dispose()
    rendered = render_python_code(UpgradeOps([CreateQueueIndexesOp("jobs", concurrently=True)]))
    assert "sq_ops.create_queue_indexes('jobs', concurrently=True)" in rendered


FLASK_APP = """
    import os

    from flask import Flask
    from flask_migrate import Migrate
    from flask_sqlalchemy import SQLAlchemy
    from sqlalchemy import Index, String
    from sqlalchemy.orm import Mapped, mapped_column

    from sqla_queue import JobMixin
    from sqla_queue.alembic import compose

    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = os.environ["APP_DATABASE_URL"]
    db = SQLAlchemy(app)
    migrate = Migrate(
        app, db, transaction_per_migration=True, process_revision_directives=compose(skip_empty=True)
    )


    class Shipment(db.Model, JobMixin):
        carrier: Mapped[str] = mapped_column(String(50))
    #MORE#
"""


@pytest.mark.system
def test_flask_migrate(tmp_path: Path, new_database: NewDatabase) -> None:
    url = new_database()
    env: dict[str, Any] = {"APP_DATABASE_URL": url.render_as_string(hide_password=False)}

    def flask(*args: str, fresh: bool = False) -> str:
        return run([BIN / "flask", "--app", "app", "db", *args], tmp_path, fresh=fresh, **env)

    def write_app(more: str) -> None:
        source = textwrap.dedent(FLASK_APP).replace("#MORE#", textwrap.dedent(more))
        (tmp_path / "app.py").write_text(source)

    versions = tmp_path / "migrations" / "versions"
    write_app("")
    flask("init", fresh=True)  # the console script as typed; the rest forked (tests/console.py)
    flask("migrate", "-m", "shipments")
    (first,) = versions.glob("*.py")
    assert "batch_op.create_index(batch_op.f('shipment_claim_idx')" in first.read_text()
    assert "concurrently" not in first.read_text()
    flask("upgrade")
    assert "No changes in schema detected" in flask("migrate")  # skip_empty: no empty file
    assert len(list(versions.glob("*.py"))) == 1

    # A new column and an index on it. Flask-Migrate renders batch_alter_table blocks,
    # which defer their DDL to the block's end: the concurrent op must come after it.
    write_app("""
        Shipment.weight = db.Column(db.Integer, index=True)
    """)
    flask("migrate", "-m", "weight")
    (second,) = set(versions.glob("*.py")) - {first}
    migration = second.read_text()
    assert "\nfrom sqla_queue import alembic_ops as sq_ops" in migration
    upgrade, downgrade = migration.split("def upgrade()")[1].split("def downgrade()")
    assert upgrade.index("batch_op.add_column(sa.Column('weight'") < upgrade.index(
        "\n    sq_ops.create_index_concurrently(op.f('ix_shipment_weight'), 'shipment', ['weight']"
    )
    assert downgrade.index(
        "\n    sq_ops.drop_index_concurrently(op.f('ix_shipment_weight')"
    ) < downgrade.index("batch_op.drop_column('weight')")
    flask("upgrade")
    assert schema(url)["pg_indexes"]["ix_shipment_weight"][1] is True
    flask("downgrade")
    after = schema(url)
    assert (
        "ix_shipment_weight" not in after["pg_indexes"]
        and "weight" not in after["shipment"]["columns"]
    )


SCHEDULES = """
    from sqla_queue import schedules_table

    schedules_table(Task)
"""


@pytest.mark.system
def test_autogenerate_adds_the_schedules_table_to_an_existing_queue(
    project: Project, new_database: NewDatabase
) -> None:
    """Schedules added to a deployed queue: autogenerate creates the watermark table,
    the same as create_all, and nothing else; downgrade drops it."""
    project.models(models())
    project.autogenerate("initial")
    project.alembic("upgrade", "head")
    project.models(models(more=SCHEDULES))
    migration = project.autogenerate("schedules")
    upgrade = project.upgrade_body(migration)
    assert "op.create_table('tasks_schedules'" in upgrade
    assert upgrade.count("op.create_table(") == 1 and "create_index" not in upgrade
    assert "info=" not in migration
    assert "op.drop_table('tasks_schedules')" in migration.split("def downgrade()")[1]
    project.alembic("upgrade", "head")
    reference = new_database()
    project.create_all(reference)
    migrated = schema(project.url)
    assert migrated == schema(reference)
    assert set(migrated["tasks_schedules"]["columns"]) == {
        "name", "last_tick", "previous_tick", "updated_at", "paused_at"
    }
    project.alembic("check")
    project.alembic("downgrade", "-1")
    assert "tasks_schedules" not in schema(project.url)


@pytest.mark.system
def test_autogenerate_adds_paused_at_to_a_watermark_table_made_before_it(
    project: Project, new_database: NewDatabase
) -> None:
    """A watermark table of a release before pauses: autogenerate adds the one nullable
    column (no rewrite, nothing else), and the result is what create_all makes."""
    project.models(models(more=SCHEDULES))
    project.autogenerate("initial")
    project.alembic("upgrade", "head")
    engine = create_engine(project.url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("ALTER TABLE tasks_schedules DROP COLUMN paused_at")
    finally:
        engine.dispose()
    migration = project.autogenerate("pauses")
    upgrade = project.upgrade_body(migration)
    added = "op.add_column('tasks_schedules', sa.Column('paused_at', sa.DateTime(timezone=True), nullable=True))"
    assert added in upgrade
    assert upgrade.count("op.") == 1
    assert "op.drop_column('tasks_schedules', 'paused_at')" in migration.split("def downgrade()")[1]
    project.alembic("upgrade", "head")
    reference = new_database()
    project.create_all(reference)
    assert schema(project.url) == schema(reference)
    project.alembic("check")


QUEUES = """
    from sqla_queue import queues_table

    queues_table(Task)
"""


@pytest.mark.system
def test_autogenerate_adds_the_queues_table_to_an_existing_queue(project: Project, new_database: NewDatabase) -> None:
    """Pauses added to a deployed queue: autogenerate creates the queues table, the same
    as create_all, and nothing else; downgrade drops it."""
    project.models(models())
    project.autogenerate("initial")
    project.alembic("upgrade", "head")
    project.models(models(more=QUEUES))
    migration = project.autogenerate("queues")
    upgrade = project.upgrade_body(migration)
    assert "op.create_table('tasks_queues'" in upgrade
    assert upgrade.count("op.create_table(") == 1 and "create_index" not in upgrade
    project.alembic("upgrade", "head")
    reference = new_database()
    project.create_all(reference)
    migrated = schema(project.url)
    assert migrated == schema(reference)
    assert set(migrated["tasks_queues"]["columns"]) == {"queue", "paused_at", "concurrency", "rate", "updated_at"}
    project.alembic("check")
    project.alembic("downgrade", "-1")
    assert "tasks_queues" not in schema(project.url)


@pytest.mark.system
def test_a_changed_unique_declaration_is_migrated_by_autogenerate(project: Project, new_database: NewDatabase) -> None:
    """``__queue_unique__`` changed on an existing table: the index's columns stay, its
    ``WHERE`` changes, which Alembic's own comparison does not see. The migration drops
    and recreates it (concurrently), and its downgrade brings the old one back."""
    project.models(models(more=ONE_JOB_PER_ORDER.replace("column=\"order_id\", statuses=UNIQUE_EVER",
                                                         "column=\"order_id\"")))
    project.autogenerate("initial")
    project.alembic("upgrade", "head")
    before = schema(project.url)
    assert "'done'" not in before["pg_indexes"]["order_jobs_unique_idx"][0]
    project.models(models(more=ONE_JOB_PER_ORDER))
    migration = project.autogenerate("unique ever")
    upgrade = project.upgrade_body(migration)
    assert "sq_ops.drop_index_concurrently(op.f('order_jobs_unique_idx'), table_name='order_jobs'" in upgrade, upgrade
    create = "sq_ops.create_index_concurrently(op.f('order_jobs_unique_idx'), 'order_jobs', ['order_id'], unique=True"
    assert create in upgrade
    assert "done" in upgrade and "email_jobs" not in upgrade  # only the changed index
    project.alembic("upgrade", "head")
    reference = new_database()
    project.create_all(reference)
    assert schema(project.url) == schema(reference)
    project.alembic("check")  # and a second autogenerate finds nothing
    project.alembic("downgrade", "-1")
    assert schema(project.url) == before


@pytest.mark.system
def test_autogenerate_adds_the_columns_of_results_progress_history_and_workflows(
    project: Project, new_database: NewDatabase
) -> None:
    """ResultMixin, HistoryMixin and WorkflowMixin mixed into a deployed queue: three
    nullable JSONB columns, the workflow's five (two with server defaults for the rows
    already there) and its index, built concurrently; the same as create_all; downgrade
    drops them."""
    project.models(models())
    project.autogenerate("initial")
    project.alembic("upgrade", "head")
    project.models(
        models()
        .replace("class Task(Base, TaskMixin):",
                 "class Task(Base, TaskMixin, ResultMixin, HistoryMixin, WorkflowMixin):")
        .replace("from sqla_queue import JobMixin, TaskMixin", "from sqla_queue import HistoryMixin, JobMixin, "
                 "ResultMixin, TaskMixin, WorkflowMixin")
    )
    migration = project.autogenerate("results")
    upgrade = project.upgrade_body(migration)
    for column in ("result", "progress", "history"):
        assert f"op.add_column('tasks', sa.Column('{column}', sa.JSON(none_as_null=True).with_variant(" in upgrade
    for column in WORKFLOW_COLUMNS:
        assert f"op.add_column('tasks', sa.Column('{column}'" in upgrade
    assert upgrade.count("op.add_column(") == 3 + len(WORKFLOW_COLUMNS)
    indexes = {line.split("op.f('")[1].split("'")[0]: line for line in upgrade.splitlines() if "create_index" in line}
    assert set(indexes) == {"tasks_workflow_idx", "tasks_edges_idx"}, upgrade
    assert all("sq_ops.create_index_concurrently(" in line for line in indexes.values()), indexes
    index = indexes["tasks_workflow_idx"]
    assert "['workflow_id']" in index and "workflow_id IS NOT NULL" in index, index
    index = indexes["tasks_edges_idx"]
    assert "['id']" in index and "child_ids IS NOT NULL AND finished_at IS NOT NULL" in index, index
    project.alembic("upgrade", "head")
    reference = new_database()
    project.create_all(reference)
    assert schema(project.url) == schema(reference)
    project.alembic("check")
    project.alembic("downgrade", "-1")
    assert not {"result", "progress", "history", *WORKFLOW_COLUMNS} & set(schema(project.url)["tasks"]["columns"])


@pytest.mark.system
def test_autogenerate_adds_the_workers_table_to_an_existing_queue(project: Project, new_database: NewDatabase) -> None:
    """A workers table declared for a deployed queue: autogenerate creates it, the same as
    create_all, and nothing else; downgrade drops it."""
    project.models(models())
    project.autogenerate("initial")
    project.alembic("upgrade", "head")
    project.models(models(more="""
        from sqla_queue import workers_table

        workers_table(Task)
    """))
    migration = project.autogenerate("workers")
    upgrade = project.upgrade_body(migration)
    assert "op.create_table('tasks_workers'" in upgrade
    assert upgrade.count("op.create_table(") == 1 and "create_index" not in upgrade
    project.alembic("upgrade", "head")
    reference = new_database()
    project.create_all(reference)
    migrated = schema(project.url)
    assert migrated == schema(reference)
    assert set(migrated["tasks_workers"]["columns"]) == {
        "name", "host", "pid", "queues", "concurrency", "runtime", "version", "started_at", "last_seen", "running",
        "jobs",
    }
    project.alembic("check")
    project.alembic("downgrade", "-1")
    assert "tasks_workers" not in schema(project.url)


@pytest.mark.system
def test_autogenerate_adds_the_finished_index_and_the_activity_table_to_an_existing_queue(
    project: Project, new_database: NewDatabase
) -> None:
    """A queue deployed before the index of finished jobs, given an activity table:
    autogenerate builds the index concurrently and creates the table, the same as
    create_all, and nothing else; downgrade drops both."""
    project.models(models())
    project.autogenerate("initial")
    project.alembic("upgrade", "head")
    engine = create_engine(project.url, poolclass=NullPool)
    with engine.begin() as conn:  # as a version of sqla_queue before it made the index
        conn.execute(text("DROP INDEX tasks_finished_idx"))
    engine.dispose()
    project.models(models(more="""
        from sqla_queue import activity_table

        activity_table(Task)
    """))
    migration = project.autogenerate("activity")
    upgrade = project.upgrade_body(migration)
    assert "op.create_table('tasks_activity'" in upgrade and upgrade.count("op.create_table(") == 1
    (index,) = [line for line in upgrade.splitlines() if "create_index" in line]
    assert "sq_ops.create_index_concurrently(op.f('tasks_finished_idx'), 'tasks', ['finished_at']" in index, index
    assert "finished_at IS NOT NULL" in index, index
    project.alembic("upgrade", "head")
    reference = new_database()
    project.create_all(reference)
    migrated = schema(project.url)
    assert migrated == schema(reference)
    assert set(migrated["tasks_activity"]["columns"]) == {
        "seconds", "bucket", "queue", "done", "failed", "cancelled", "pickup_p50", "pickup_p99", "run_p50",
        "run_p99", "waiting",
    }
    assert migrated["tasks_activity"]["pk"]["constrained_columns"] == ["seconds", "bucket", "queue"]
    project.alembic("check")
    project.alembic("downgrade", "-1")
    after = schema(project.url)
    assert "tasks_activity" not in after and "tasks_finished_idx" not in after["pg_indexes"]
