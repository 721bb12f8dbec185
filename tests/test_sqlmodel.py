"""SQLModel queue tables (``sqla_queue.sqlmodel``): the schema of ``JobMixin``, and every
enqueue path, both workers and the sessions, on SQLModel models against real PostgreSQL.

Alembic autogenerate on a SQLModel project is in ``test_sqlmodel_alembic.py``.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any, get_type_hints

import psycopg
import pytest
from sqlalchemy import (
    CheckConstraint,
    Column,
    Engine,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    text,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker
from sqlalchemy.schema import CreateColumn, CreateIndex, CreateTable
from sqlmodel import Session, SQLModel, col, select
from sqlmodel.sql.sqltypes import AutoString

from sqla_queue import (
    AsyncWorker,
    BulkRowError,
    EnqueueError,
    IdempotencyKeyMixin,
    JobMixin,
    TaskMixin,
    Tasks,
    Worker,
    enqueue,
    enqueue_many,
    enqueue_values,
    queue_table,
)
from sqla_queue.cli import main as cli_main
from sqla_queue.sqlmodel import (
    AsyncQueueSession,
    IdempotencyKeyModel,
    JobModel,
    QueueSession,
    TaskModel,
    mixin_field,
)

from .helpers import SENTINEL_CHANNEL, Server, notifications_until_sentinel, table_of, wait_for
from .sqlmodel_models import TABLES, BareJob, Handled, KeyedJob, ShipJob, Shipment, SqlTask
from .workers import FAST

SHIP_CHANNEL = queue_table(ShipJob).channel
DIALECT = postgresql.dialect()  # type: ignore[no-untyped-call]


# -- the same schema as JobMixin -----------------------------------------------------------


class Twin(DeclarativeBase):
    """The same tables written with JobMixin/TaskMixin, in a MetaData of their own."""

    metadata = MetaData()


class TwinShipment(Twin):
    __tablename__ = "sqlmodel_shipments"

    id: Mapped[int] = mapped_column(primary_key=True)
    address: Mapped[str] = mapped_column(AutoString(200))


class TwinShipJob(Twin, JobMixin):
    __tablename__ = "sqlmodel_ship_jobs"
    __table_args__ = (
        Index("ix_sqlmodel_ship_jobs_shipment", "shipment_id"),
        CheckConstraint("length(carrier) > 0", name="ck_sqlmodel_ship_jobs_carrier"),
    )

    shipment_id: Mapped[int | None] = mapped_column(ForeignKey(TwinShipment.id))
    carrier: Mapped[str] = mapped_column(AutoString(50), default="post")


class TwinBareJob(Twin, JobMixin):
    __tablename__ = "sqlmodel_bare_jobs"


class TwinTask(Twin, TaskMixin):
    __tablename__ = "sqlmodel_tasks"


class TwinHandled(Twin):
    __tablename__ = "sqlmodel_handled"

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int]
    note: Mapped[str] = mapped_column(AutoString(200))


class TwinKeyedJob(Twin, JobMixin, IdempotencyKeyMixin):
    __tablename__ = "sqlmodel_keyed_jobs"

    note: Mapped[str] = mapped_column(AutoString(50), default="")


TWINS = [(ShipJob, TwinShipJob), (BareJob, TwinBareJob), (SqlTask, TwinTask), (KeyedJob, TwinKeyedJob)]


def python_default(column: Column[Any]) -> Any:
    """What the column's Python default gives (the function for a callable one)."""
    default = column.default
    if default is None:
        return None
    if default.is_scalar:
        return ("scalar", getattr(default, "arg", None))
    return ("callable", getattr(getattr(default, "arg", None), "__wrapped__", None))  # the function SQLAlchemy wraps


def described(table: Table) -> dict[str, Any]:
    """A table as PostgreSQL DDL, column by column, plus what the DDL does not show."""
    return {
        "columns": {
            c.name: (
                str(CreateColumn(c).compile(dialect=DIALECT)),
                getattr(c.type, "impl_instance", c.type).python_type,  # SQLAlchemy 2.0: not of a TypeDecorator
                c.nullable,
                c.primary_key,
                repr(c.identity),
                python_default(c),
            )
            for c in table.c
        },
        "constraints": sorted(
            (type(c).__name__, str(c.name), str(getattr(c, "sqltext", "")))
            for c in table.constraints
        ),
        "indexes": sorted(str(CreateIndex(i).compile(dialect=DIALECT)) for i in table.indexes),
    }


@pytest.mark.parametrize(("model", "twin"), TWINS, ids=lambda m: m.__name__)
def test_schema_is_the_mixins(model: Any, twin: Any) -> None:
    table, expected = table_of(model), table_of(twin)
    assert described(table) == described(expected)
    ddl, expected_ddl = (str(CreateTable(t).compile(dialect=DIALECT)) for t in (table, expected))
    # Declarative puts a model's own columns before the mixin's, SQLModel after its base's.
    assert sorted(ddl.splitlines()) == sorted(expected_ddl.splitlines())
    if model is BareJob:
        assert ddl == expected_ddl
    names = {i.name for i in table.indexes} | {c.name for c in table.constraints}
    queue_names = {f"{table.name}_{s}" for s in ("claim_idx", "claim_queue_idx", "isolated_idx", "lease_idx")}
    assert queue_names | {f"{table.name}_status_check"} <= names
    (payload_default,) = [c.default for c in table.c if c.name == "payload"] or [None]
    if payload_default is not None:  # one dict per row, never shared between rows
        assert payload_default.arg(None) == {}  # type: ignore[attr-defined]
        assert payload_default.arg(None) is not payload_default.arg(None)  # type: ignore[attr-defined]


def test_the_idempotency_key_field_is_the_mixins() -> None:
    (name,) = IdempotencyKeyModel.model_fields
    field = IdempotencyKeyModel.model_fields[name]
    assert name == "idempotency_key" and field.annotation is uuid.UUID
    assert field.default_factory is uuid.uuid4
    assert "idempotency_key" not in JobModel.model_fields  # opt-in, as the mixin
    first, second = KeyedJob().idempotency_key, KeyedJob().idempotency_key
    assert first.version == 4 and first != second


def test_user_table_args_are_kept_beside_the_queues() -> None:
    table = table_of(ShipJob)
    assert {"ix_sqlmodel_ship_jobs_shipment", "sqlmodel_ship_jobs_claim_idx"} <= {i.name for i in table.indexes}
    assert {"ck_sqlmodel_ship_jobs_carrier", "sqlmodel_ship_jobs_status_check"} <= {c.name for c in table.constraints}


def test_two_tables_get_columns_of_their_own() -> None:
    """A field's schema items are copied per table: each identity belongs to its own column."""
    for model in (ShipJob, BareJob, SqlTask):
        pk = table_of(model).c.id
        assert pk.identity is not None and pk.identity.column is pk
    assert table_of(ShipJob).c.queue is not table_of(BareJob).c.queue


def test_fields_are_the_mixins_columns_with_their_python_types() -> None:
    """Every column of the mixins is a field, with the mixin's annotation; a column only
    the database fills in (no Python default, NOT NULL) is ``T | None`` defaulting to None,
    as a SQLModel model writes its key. A column added to a mixin fails this test until
    its field is added too."""
    for model, mixin, twin in ((JobModel, JobMixin, TwinBareJob), (TaskModel, TaskMixin, TwinTask)):
        hints = {
            name: value.__args__[0]
            for name, value in get_type_hints(mixin, vars(sys.modules[mixin.__module__])).items()
        }
        assert set(model.model_fields) == set(hints) == set(table_of(twin).c.keys())
        for name, field in model.model_fields.items():
            column = table_of(twin).c[name]
            server_filled = column.default is None and (
                column.server_default is not None or column.identity is not None
            )
            expected = hints[name] | None if server_filled and not column.nullable else hints[name]
            assert field.annotation == expected, name
            if server_filled:
                assert field.default is None, name
            assert field.is_required() == (column.default is None and not column.nullable and not server_filled)


class LabelMixin:
    """A declarative mixin of the user's: what ``mixin_field`` copies from it."""

    label: Mapped[str | None] = mapped_column(String(20), unique=True, comment="a label")
    rank: Mapped[int] = mapped_column(Integer, index=True, default=3, server_default=text("3"))


class LabelledJob(JobModel, table=True):
    __tablename__ = "sqlmodel_labelled_jobs"

    label: str | None = mixin_field("label", LabelMixin)
    rank: int = mixin_field("rank", LabelMixin)


class TwinLabelledJob(Twin, JobMixin, LabelMixin):
    __tablename__ = "sqlmodel_labelled_jobs"


def test_mixin_field_copies_any_declarative_mixins_column() -> None:
    """The way a column added to a mixin gets its SQLModel field."""
    assert described(table_of(LabelledJob)) == described(table_of(TwinLabelledJob))
    assert LabelledJob().rank == 3 and LabelledJob().label is None


@pytest.mark.system
def test_importing_sqla_queue_does_not_need_sqlmodel() -> None:
    code = (
        "import sys; sys.modules['sqlmodel'] = None\n"  # any import of it raises ImportError
        "import sqla_queue, sqla_queue.alembic, sqla_queue.cli, sqla_queue.flask\n"
        "try:\n"
        "    import sqla_queue.sqlmodel\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "sqla_queue.sqlmodel needs SQLModel: pip install 'sqla-queue[sqlmodel]'"


# -- against PostgreSQL --------------------------------------------------------------------


@pytest.fixture(scope="module")
def _sm_schema(server: Server) -> Iterator[Engine]:
    engine = create_engine(server.url)
    SQLModel.metadata.create_all(engine, tables=TABLES)
    yield engine
    SQLModel.metadata.drop_all(engine, tables=TABLES)
    engine.dispose()


@pytest.fixture
def sm_engine(_sm_schema: Engine) -> Engine:
    """The SQLModel tables, emptied before the test."""
    names = ", ".join(f'"{t.name}"' for t in TABLES)
    with _sm_schema.begin() as conn:
        conn.execute(text(f"TRUNCATE {names} RESTART IDENTITY CASCADE"))
    return _sm_schema


@pytest.fixture
def listening(listener: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    for channel in (SHIP_CHANNEL, SENTINEL_CHANNEL):
        listener.execute(f'LISTEN "{channel}"')
    return listener


def jobs(engine: Engine) -> list[ShipJob]:
    with Session(engine) as session:
        return list(session.exec(select(ShipJob).order_by(col(ShipJob.id))).all())


def test_session_enqueue_commits_with_the_business_row_and_notifies(
    sm_engine: Engine, listening: Any, server: Server
) -> None:
    with QueueSession(sm_engine) as session:
        shipment = Shipment(address="1 Main St")
        session.add(shipment)
        session.flush()
        job = session.enqueue(ShipJob(shipment_id=shipment.id, carrier="dhl"), queue="express", priority=5)
        session.enqueue(ShipJob(shipment_id=shipment.id))
        session.commit()
        assert job.id is not None and job.status == "pending"
        assert session.exec(select(Shipment.address)).all() == ["1 Main St"]  # SQLModel's exec()
    rows = jobs(sm_engine)
    assert [(r.queue, r.priority, r.carrier, r.attempts, r.max_attempts) for r in rows] == [
        ("express", 5, "dhl", 0, 20),
        ("default", 0, "post", 0, 20),
    ]
    assert all(isinstance(r.run_after, datetime) and r.run_after.tzinfo for r in rows)  # the server default
    assert sorted(notifications_until_sentinel(listening, server.conninfo)) == [
        (SHIP_CHANNEL, "default"),
        (SHIP_CHANNEL, "express"),
    ]


def test_rollback_keeps_neither_job_nor_notification(sm_engine: Engine, listening: Any, server: Server) -> None:
    with QueueSession(sm_engine) as session:
        session.add(Shipment(address="gone"))
        session.enqueue(ShipJob())
        session.flush()
        session.rollback()
    assert jobs(sm_engine) == []
    assert notifications_until_sentinel(listening, server.conninfo) == []


def test_enqueue_on_a_plain_sqlmodel_session(sm_engine: Engine, listening: Any, server: Server) -> None:
    """``sqla_queue.enqueue(session, job)`` hooks a ``sqlmodel.Session`` of its own making."""
    with Session(sm_engine) as session:
        enqueue(session, ShipJob(carrier="ups"), delay=timedelta(hours=1), max_attempts=3)
        session.commit()
    (row,) = jobs(sm_engine)
    assert (row.carrier, row.max_attempts) == ("ups", 3)
    assert row.created_at is not None and row.run_after is not None
    assert row.run_after - row.created_at > timedelta(minutes=59)
    assert notifications_until_sentinel(listening, server.conninfo) == [(SHIP_CHANNEL, "default")]


@pytest.mark.parametrize(
    ("job", "message"),
    [
        (ShipJob(status="done"), "has status='done'; the queue manages status"),
        (ShipJob(attempts=2), "the queue manages attempts"),
        (ShipJob(carrier="x" * 51), "carrier"),
        (ShipJob(carrier="nul\x00"), "carrier"),
        (ShipJob(priority=2**40), "priority must be a 32-bit integer"),
    ],
)
def test_bad_jobs_fail_before_anything_is_written(sm_engine: Engine, job: ShipJob, message: str) -> None:
    with QueueSession(sm_engine) as session:
        session.add(Shipment(address="kept"))
        with pytest.raises(EnqueueError, match=message):
            session.enqueue(job)
        assert job not in session
        session.commit()  # the caller's transaction is untouched
    assert jobs(sm_engine) == []
    with Session(sm_engine) as session:
        assert session.exec(select(Shipment.address)).all() == ["kept"]


def test_unique_keys_on_sqlmodel_tables(sm_engine: Engine) -> None:
    with QueueSession(sm_engine) as session:
        first = session.enqueue(ShipJob(carrier="ups"), unique_key="ship:1")
        assert first.inserted and first.job is not None and first.job.id == first.job_id
        assert session.enqueue(ShipJob(carrier="dhl"), unique_key="ship:1").job_id == first.job_id
        assert enqueue_values(session, ShipJob, {"carrier": "dhl"}, unique_key="ship:1").skipped
        written = session.enqueue_many(ShipJob, [{"carrier": "x", "unique_key": "ship:1"}, {"unique_key": "ship:2"}])
        assert (written.inserted, written.skipped) == (1, 1)
        session.commit()
    assert sorted(r.unique_key or "" for r in jobs(sm_engine)) == ["ship:1", "ship:2"]


def test_enqueue_values(sm_engine: Engine, listening: Any, server: Server) -> None:
    with QueueSession(sm_engine) as session:
        first = enqueue_values(session, ShipJob, {"carrier": "fedex"}, queue="bulk")
        second = enqueue_values(session, ShipJob)
        with pytest.raises(EnqueueError, match="status is managed by the queue"):
            enqueue_values(session, ShipJob, {"status": "running"})  # checked before anything is sent
        session.commit()
    assert [(r.id, r.queue, r.carrier) for r in jobs(sm_engine)] == [
        (first, "bulk", "fedex"),
        (second, "default", "post"),
    ]
    assert sorted(notifications_until_sentinel(listening, server.conninfo)) == [
        (SHIP_CHANNEL, "bulk"),
        (SHIP_CHANNEL, "default"),
    ]


@pytest.mark.parametrize("method", ["copy", "insert"])
def test_enqueue_many_of_instances_and_dicts(
    sm_engine: Engine, listening: Any, server: Server, method: Any
) -> None:
    """SQLModel instances hold None for each unset field: the column's default applies,
    as in ``enqueue()``."""
    rows: list[Any] = [ShipJob(carrier=f"c{n}") if n % 2 else {"carrier": f"c{n}"} for n in range(6)]
    rows.append(ShipJob(priority=None, run_after=None))  # type: ignore[arg-type]
    with QueueSession(sm_engine) as session:
        assert session.enqueue_many(ShipJob, rows, queue="many", method=method) == 7
        assert enqueue_many(session, ShipJob, [{"carrier": "x"}], method=method, priority=3) == 1
        session.commit()
    got = jobs(sm_engine)
    assert [(r.carrier, r.queue, r.priority) for r in got] == [
        *((f"c{n}", "many", 0) for n in range(6)),
        ("post", "many", 0),
        ("x", "default", 3),
    ]
    assert all(r.status == "pending" and r.run_after is not None for r in got)
    assert sorted(notifications_until_sentinel(listening, server.conninfo)) == [
        (SHIP_CHANNEL, "default"),
        (SHIP_CHANNEL, "many"),
    ]


@pytest.mark.parametrize("method", ["copy", "insert"])
@pytest.mark.parametrize("options", [{}, {"queue": "q", "priority": -4, "max_attempts": 3}])
def test_every_path_writes_the_same_row(sm_engine: Engine, method: Any, options: dict[str, Any]) -> None:
    """enqueue(), enqueue_many() of a dict and of an instance, and enqueue_values(), in one
    transaction (one now()): the same row but for its id."""
    with QueueSession(sm_engine) as session:
        session.enqueue(ShipJob(carrier="same"), **options)
        session.flush()
        session.enqueue_many(ShipJob, [{"carrier": "same"}, ShipJob(carrier="same")], method=method, **options)
        enqueue_values(session, ShipJob, {"carrier": "same"}, **options)
        table = table_of(ShipJob)
        rows = [dict(r._mapping) for r in session.connection().execute(table.select().order_by(table.c.id))]
        first, *others = [{k: v for k, v in row.items() if k != "id"} for row in rows]
        assert len(others) == 3 and others == [first] * 3
        assert (first["queue"], first["priority"], first["max_attempts"]) == (
            options.get("queue", "default"),
            options.get("priority", 0),
            options.get("max_attempts", 20),
        )
        session.rollback()


def test_enqueue_many_checks_the_users_text_fields(sm_engine: Engine) -> None:
    with QueueSession(sm_engine) as session:
        for row in ({"carrier": "x" * 51}, ShipJob(carrier="nul\x00")):
            with pytest.raises(BulkRowError, match=r"^row 1: .*carrier"):
                session.enqueue_many(ShipJob, [{"carrier": "fine"}, row])
        session.commit()
    assert jobs(sm_engine) == []


def test_async_queue_session(sm_engine: Engine, server: Server) -> None:
    async def main() -> list[int]:
        engine = create_async_engine(server.url)
        try:
            sessions = async_sessionmaker(engine, class_=AsyncQueueSession, expire_on_commit=False)
            async with sessions() as session:
                shipment = Shipment(address="async")
                session.add(shipment)
                await session.flush()
                job = session.enqueue(ShipJob(shipment_id=shipment.id, carrier="async"))
                assert await session.enqueue_many(ShipJob, [{"carrier": "a1"}, ShipJob(carrier="a2")]) == 2
                assert await enqueue_values(session, ShipJob, {"carrier": "a3"}) is not None
                await session.commit()
                assert job.id is not None
                result = await session.exec(select(ShipJob.carrier).order_by(col(ShipJob.id)))  # SQLModel's exec()
                return [len(c) for c in result.all()]
        finally:
            await engine.dispose()

    assert asyncio.run(main()) == [5, 2, 2, 2]
    assert [r.carrier for r in jobs(sm_engine)] == ["async", "a1", "a2", "a3"]


# -- both workers ---------------------------------------------------------------------------


def three_ways(engine: Engine) -> list[int]:
    """One job by ``session.enqueue``, two by ``enqueue_many``, one by ``enqueue_values``."""
    with QueueSession(engine) as session:
        shipment = Shipment(address="2 High St")
        session.add(shipment)
        session.flush()
        session.enqueue(ShipJob(shipment_id=shipment.id, carrier="enqueue"))
        session.enqueue_many(ShipJob, [ShipJob(shipment_id=shipment.id, carrier="many")] * 2)
        enqueue_values(session, ShipJob, {"shipment_id": shipment.id, "carrier": "values"})
        session.commit()
    return [job.id for job in jobs(engine) if job.id is not None]


def handled(engine: Engine) -> list[tuple[int, str]]:
    with Session(engine) as session:
        return [(h.job_id, h.note) for h in session.exec(select(Handled).order_by(col(Handled.job_id)))]


def all_done(engine: Engine, ids: list[int]) -> Callable[[], bool]:
    return lambda: [j.status for j in jobs(engine)] == ["done"] * len(ids)


def test_thread_worker_runs_sqlmodel_jobs_to_done(sm_engine: Engine) -> None:
    seen: list[Any] = []

    def ship(job: ShipJob, session: QueueSession) -> None:
        """Transactional, on SQLModel's session: reads with exec(), writes with add()."""
        seen.append(type(job))
        shipment = session.exec(select(Shipment).where(Shipment.id == job.shipment_id)).one()
        session.add(Handled(job_id=job.id or 0, note=f"{job.carrier} to {shipment.address}"))

    ids = three_ways(sm_engine)
    worker = Worker(
        sm_engine, ShipJob, ship, session_factory=sessionmaker(sm_engine, class_=QueueSession),
        concurrency=2, backoff=FAST, poll_interval=0.2,
    )
    worker.run(install_signal_handlers=False, until_idle=True)
    assert [j.status for j in jobs(sm_engine)] == ["done"] * 4
    assert handled(sm_engine) == [
        (ids[0], "enqueue to 2 High St"),
        (ids[1], "many to 2 High St"),
        (ids[2], "many to 2 High St"),
        (ids[3], "values to 2 High St"),
    ]
    assert seen == [ShipJob] * 4 and worker.stats.done == 4


def test_thread_worker_is_woken_by_the_sqlmodel_sessions_commit(sm_engine: Engine) -> None:
    """A poll interval longer than the wait: only the NOTIFY sent on commit can start the job."""
    worker = Worker(sm_engine, ShipJob, lambda job: None, poll_interval=300, backoff=FAST)
    worker.start()
    try:
        wait_for(worker.idle, what="the worker to go idle")
        with QueueSession(sm_engine) as session:
            session.enqueue(ShipJob(carrier="woken"))
            session.commit()
        wait_for(lambda: [j.status for j in jobs(sm_engine)] == ["done"], timeout=60, what="job done")
    finally:
        worker.stop(grace=5)


def test_async_worker_runs_sqlmodel_jobs_to_done(sm_engine: Engine, server: Server) -> None:
    async def ship(job: ShipJob, session: AsyncQueueSession) -> None:
        """Transactional, on SQLModel's async session."""
        shipment = (await session.exec(select(Shipment).where(Shipment.id == job.shipment_id))).one()
        session.add(Handled(job_id=job.id or 0, note=f"{job.carrier} to {shipment.address}"))
        if job.carrier == "many" and job.attempts == 1:
            raise RuntimeError("first attempt fails: its Handled row must not survive")

    ids = three_ways(sm_engine)

    async def main() -> Any:
        engine = create_async_engine(server.url)
        try:
            worker = AsyncWorker(
                engine, ShipJob, ship,
                session_factory=async_sessionmaker(engine, class_=AsyncQueueSession),
                concurrency=2, backoff=FAST, poll_interval=0.2,
            )
            await worker.run(install_signal_handlers=False, until_idle=True)
            return worker.stats
        finally:
            await engine.dispose()

    stats = asyncio.run(main())
    got = jobs(sm_engine)
    assert [j.status for j in got] == ["done"] * 4
    assert [j.attempts for j in got] == [1, 2, 2, 1]
    assert handled(sm_engine) == [
        (ids[0], "enqueue to 2 High St"),
        (ids[1], "many to 2 High St"),
        (ids[2], "many to 2 High St"),
        (ids[3], "values to 2 High St"),
    ]
    assert stats.done == 4 and stats.retried == 2


def test_task_model_with_a_registry_on_both_runtimes(sm_engine: Engine, make_worker: Any) -> None:
    tasks = Tasks()

    @tasks.task
    def note(job: SqlTask, session: Any) -> None:
        session.add(Handled(job_id=job.id or 0, note=str(job.payload["text"])))

    with QueueSession(sm_engine) as session:
        session.enqueue(SqlTask(task="note", payload={"text": "one"}))
        rows = [{"task": "note", "payload": {"text": "two"}}, SqlTask(task="note", payload={"text": "three"})]
        session.enqueue_many(SqlTask, rows)
        session.commit()
    worker = make_worker(sm_engine, SqlTask, tasks, backoff=FAST, poll_interval=0.2)
    worker.run(install_signal_handlers=False, until_idle=True)
    with Session(sm_engine) as plain:
        assert plain.exec(select(SqlTask.status)).all() == ["done"] * 3
    assert sorted(note for _, note in handled(sm_engine)) == ["one", "three", "two"]


def test_queue_table_reads_the_sqlmodel_model() -> None:
    qt = queue_table(ShipJob)
    assert qt.mapped_class is ShipJob and qt.pk is table_of(ShipJob).c.id
    assert qt.channel == "sqla_queue.sqlmodel_ship_jobs_jobs"
    assert queue_table(SqlTask).is_task_table and not qt.is_task_table


def test_cli_stats_and_worker_on_a_sqlmodel_model(sm_engine: Engine, server: Server, capsys: Any) -> None:
    with QueueSession(sm_engine) as session:
        session.enqueue_many(ShipJob, [{"carrier": "a"}, {"carrier": "b", "queue": "slow"}])
        session.commit()
    url = server.url.render_as_string(hide_password=False)
    assert cli_main(["stats", "tests.sqlmodel_models:ShipJob", "--url", url]) == 0
    lines = [line.split()[:3] for line in capsys.readouterr().out.splitlines()[2:]]
    assert lines == [["default", "pending", "1"], ["slow", "pending", "1"]]
    assert cli_main(["worker", "tests.sqlmodel_models:make_worker", "--until-idle", "--queue", "slow"]) == 0
    assert [(j.carrier, j.status) for j in jobs(sm_engine)] == [("a", "pending"), ("b", "done")]
    assert [note for _, note in handled(sm_engine)] == ["cli b"]



def test_every_path_gives_a_keyed_sqlmodel_job_a_key_of_its_own(sm_engine: Engine, server: Server) -> None:
    with QueueSession(sm_engine) as session:
        job = session.enqueue(KeyedJob(note="enqueue"))
        held = job.idempotency_key  # from construction, before the flush
        given = uuid.uuid4()
        session.enqueue(KeyedJob(note="given", idempotency_key=given))
        for method in ("copy", "insert"):
            session.enqueue_many(KeyedJob, [KeyedJob(note=method), {"note": method}], method=method)
        enqueue_values(session, KeyedJob, {"note": "values"})
        session.commit()
    seen: dict[str, uuid.UUID] = {}

    def record(job: KeyedJob) -> None:
        seen[f"{job.note}:{job.id}"] = job.idempotency_key

    worker = Worker(sm_engine, KeyedJob, record, backoff=FAST, poll_interval=0.2)
    worker.run(install_signal_handlers=False, until_idle=True)
    with Session(sm_engine) as plain:
        stored = {f"{j.note}:{j.id}": j.idempotency_key for j in plain.exec(select(KeyedJob))}
    assert seen == stored and len(stored) == 7
    keys = list(stored.values())
    assert len(set(keys)) == 7 and all(k.version == 4 for k in keys if k != given)
    assert stored["enqueue:1"] == held and stored["given:2"] == given
