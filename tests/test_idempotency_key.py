"""``IdempotencyKeyMixin``: a random key set at enqueue on every path, never shared by two
jobs, and not reused when the primary key is (as after a failover to an asynchronous
standby that had not received the last jobs)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from alembic.autogenerate import produce_migrations, render_python_code
from alembic.migration import MigrationContext
from alembic.operations import Operations
from sqlalchemy import Engine, insert, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, sessionmaker

from sqla_queue import (
    AsyncQueueSession,
    IdempotencyKeyMixin,
    JobMixin,
    QueueSession,
    enqueue,
    enqueue_many,
    enqueue_values,
)

from .helpers import Server, table_of
from .models import EmailJob, KeyedJob, KeyedTask, Task

KEYED = table_of(KeyedJob)
KEYED_TASKS = table_of(KeyedTask)
METHODS = ["copy", "insert"]


def fields(model: Any) -> dict[str, Any]:
    """What a job of ``model`` needs besides its defaults."""
    return {"task": "t"} if model is KeyedTask else {}


@pytest.fixture
def Sessions(engine: Engine) -> sessionmaker[QueueSession]:
    return sessionmaker(engine, class_=QueueSession)


def stored_keys(engine: Engine, table: Any = KEYED) -> dict[Any, uuid.UUID]:
    with engine.connect() as conn:
        return {row[0]: row[1] for row in conn.execute(select(table.c.id, table.c.idempotency_key))}


def assert_random_keys(keys: list[Any]) -> None:
    assert all(isinstance(k, uuid.UUID) and k.version == 4 for k in keys), keys
    assert len(set(keys)) == len(keys), "two jobs share a key"


def run_async(server: Server, body: Callable[[AsyncEngine], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        async_engine = create_async_engine(server.url)
        try:
            return await body(async_engine)
        finally:
            await async_engine.dispose()

    return asyncio.run(main())


def test_the_job_mixin_alone_has_no_key() -> None:
    """Existing queue tables do not change: the key is opt-in."""
    assert "idempotency_key" not in table_of(EmailJob).c
    assert "idempotency_key" not in table_of(Task).c
    column = KEYED.c.idempotency_key
    assert not column.nullable and column.server_default is not None


@pytest.mark.parametrize("model", [KeyedJob, KeyedTask])
def test_orm_enqueue_sets_the_key_at_flush(Sessions: sessionmaker[QueueSession], engine: Engine, model: Any) -> None:
    with Sessions() as session:
        jobs = [session.enqueue(model(**fields(model))) for _ in range(3)]
        jobs.append(enqueue(session, model(**fields(model))))
        session.flush()
        keys = [job.idempotency_key for job in jobs]  # there before the commit
        assert_random_keys(keys)
        session.commit()
        ids = [job.id for job in jobs]
    table = table_of(model)
    stored = stored_keys(engine, table)
    assert [stored[i] for i in ids] == keys


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("model", [KeyedJob, KeyedTask])
def test_enqueue_many_sets_a_key_per_row(
    Sessions: sessionmaker[QueueSession], engine: Engine, method: Any, model: Any
) -> None:
    rows = [fields(model) for _ in range(500)]
    with Sessions() as session:
        session.enqueue_many(model, rows, method=method)
        session.commit()
    keys = list(stored_keys(engine, table_of(model)).values())
    assert len(keys) == 500
    assert_random_keys(keys)


def test_enqueue_values_sets_the_key(Sessions: sessionmaker[QueueSession], engine: Engine) -> None:
    with Sessions() as session:
        ids = [enqueue_values(session, KeyedJob, {"recipient": f"r{n}@example.com"}) for n in range(5)]
        session.commit()
    with engine.begin() as conn:  # a Connection too
        ids += [enqueue_values(conn, KeyedTask, {"task": "t"}), enqueue_values(conn, KeyedJob)]
    keys = stored_keys(engine)
    assert sorted(keys) == sorted(ids[:5] + ids[6:])
    assert_random_keys([*keys.values(), *stored_keys(engine, KEYED_TASKS).values()])


def test_async_paths_set_the_key(engine: Engine, server: Server) -> None:
    async def body(async_engine: AsyncEngine) -> list[Any]:
        Sessions = async_sessionmaker(async_engine, class_=AsyncQueueSession)
        async with Sessions() as session:
            job = session.enqueue(KeyedJob())
            await session.flush()
            job_id, flushed = job.id, job.idempotency_key
            assert isinstance(flushed, uuid.UUID)
            await session.enqueue_many(KeyedJob, [{} for _ in range(50)], method="copy")
            await session.enqueue_many(KeyedJob, [{} for _ in range(50)], method="insert")
            await enqueue_many(session, KeyedTask, [{"task": "t"} for _ in range(20)])
            value_id = await enqueue_values(session, KeyedJob)
            await session.commit()
            return [job_id, flushed, value_id]

    job_id, flushed, value_id = run_async(server, body)
    keys = stored_keys(engine)
    assert len(keys) == 102 and keys[job_id] == flushed and value_id in keys
    assert_random_keys([*keys.values(), *stored_keys(engine, KEYED_TASKS).values()])


def test_every_path_together_never_shares_a_key(Sessions: sessionmaker[QueueSession], engine: Engine) -> None:
    with Sessions() as session:
        for _ in range(100):
            session.enqueue(KeyedJob())
        session.enqueue_many(KeyedJob, [{} for _ in range(1000)], method="copy")
        session.enqueue_many(KeyedJob, [{} for _ in range(300)], method="insert")
        for _ in range(100):
            enqueue_values(session, KeyedJob)
        session.commit()
    with engine.begin() as conn:  # another program's INSERT: the server's default
        conn.execute(text("INSERT INTO keyed_jobs (recipient) SELECT 'x' FROM generate_series(1, 100)"))
    keys = list(stored_keys(engine).values())
    assert len(keys) == 1600
    assert_random_keys(keys)


def test_a_given_key_is_kept(Sessions: sessionmaker[QueueSession], engine: Engine) -> None:
    mine = uuid.uuid4()
    with Sessions() as session:
        job = session.enqueue(KeyedJob(idempotency_key=mine))
        session.enqueue_many(KeyedJob, [{"idempotency_key": mine}], method="copy")
        session.commit()
        job_id = job.id
    keys = stored_keys(engine)
    assert keys[job_id] == mine and list(keys.values()) == [mine, mine]


def test_a_reused_id_gets_a_new_key(Sessions: sessionmaker[QueueSession], engine: Engine) -> None:
    """What an asynchronous failover does to ids: the new primary's sequence had not seen
    the last jobs, so it hands their ids out again. Their keys are new."""
    with Sessions() as session:
        first = session.enqueue(KeyedJob())
        session.commit()
        first_id, first_key = first.id, first.idempotency_key
    with engine.begin() as conn:  # the job and the sequence's advance, gone with the old primary
        conn.execute(KEYED.delete())
        conn.execute(text(f"ALTER TABLE keyed_jobs ALTER COLUMN id RESTART WITH {first_id}"))
    with Sessions() as session:
        again = session.enqueue(KeyedJob())
        session.commit()
        assert again.id == first_id
        assert again.idempotency_key != first_key


def test_a_migration_adding_the_key_gives_existing_rows_distinct_keys(engine: Engine) -> None:
    """Opting in on a table with rows: Alembic's autogenerate writes one ``add_column``
    with the server default, and running it fills each existing row with its own key."""

    class Before(DeclarativeBase):
        pass

    class After(DeclarativeBase):
        pass

    class Plain(Before, JobMixin):
        __tablename__ = "keyed_migration"

    class Keyed(After, JobMixin, IdempotencyKeyMixin):
        __tablename__ = "keyed_migration"

    try:
        with engine.begin() as conn:
            Before.metadata.create_all(conn)
            conn.execute(text("INSERT INTO keyed_migration (queue) SELECT 'q' FROM generate_series(1, 200)"))
            context = MigrationContext.configure(conn, opts={
                "target_metadata": After.metadata,
                # This table only: the database holds the suite's other tables too.
                "include_name": lambda name, kind, parent: kind != "table" or name == "keyed_migration",
            })
            ops = produce_migrations(context, After.metadata).upgrade_ops
            assert ops is not None
            (change,) = ops.as_diffs()
            assert change[0] == "add_column" and change[3].name == "idempotency_key", change
            assert "gen_random_uuid()" in render_python_code(ops)
            operations = Operations(context)
            for table_ops in ops.ops:  # one ModifyTableOps: the add_column
                for op in getattr(table_ops, "ops", [table_ops]):
                    operations.invoke(op)
            keys = list(conn.scalars(text("SELECT idempotency_key FROM keyed_migration")))
    finally:
        with engine.begin() as conn:
            Before.metadata.drop_all(conn)
    assert len(keys) == 200
    assert_random_keys(keys)


def test_a_raw_insert_gets_the_server_default(engine: Engine) -> None:
    with engine.begin() as conn:
        pk = conn.execute(insert(KEYED).values(recipient="x").returning(KEYED.c.id)).scalar_one()
    # SQLAlchemy Core also fills the Python default; a row written without it gets the server's.
    with engine.begin() as conn:
        other = conn.execute(text("INSERT INTO keyed_jobs (recipient) VALUES ('y') RETURNING id")).scalar_one()
    keys = stored_keys(engine)
    assert_random_keys([keys[pk], keys[other]])
