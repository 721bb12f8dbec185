"""``__queue_unique__`` changed on an existing table: the database's unique index no
longer says what the model says. A keyed enqueue refuses to run (naming both
definitions, the caller's transaction intact) and a worker refuses to start, on both
runtimes; the index the model describes makes both work again. Real PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, Table, func, select, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker
from sqlalchemy.schema import CreateIndex

from sqla_queue import (
    UNIQUE_EVER,
    EnqueueError,
    JobMixin,
    QueueSession,
    UniqueJobs,
    WorkerStartError,
    enqueue_many,
    unique_index,
)
from sqla_queue.model import constraint_name

TABLE = "unique_change_jobs"


class _Before(DeclarativeBase):
    pass


class _After(DeclarativeBase):
    pass


class _Note(_Before):
    __tablename__ = "unique_change_notes"
    id: Mapped[int] = mapped_column(primary_key=True)


class JobBefore(_Before, JobMixin):  # as first created: keys held while pending or running
    __tablename__ = TABLE


class JobAfter(_After, JobMixin):  # the model now: "at most once, ever"
    __tablename__ = TABLE
    __queue_unique__ = UniqueJobs(statuses=UNIQUE_EVER)


@pytest.fixture
def before(engine: Engine) -> Iterator[None]:
    unique_index._checked.clear()  # each test's tables are new: forget what matched before
    _Before.metadata.create_all(engine)
    yield
    _Before.metadata.drop_all(engine)


def _count(engine: Engine, table: Any) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(table)) or 0)


def _migrate(engine: Engine) -> None:
    """What the Alembic guide's migration does: drop the old index, create the model's."""
    table: Table = JobAfter.__table__  # type: ignore[assignment]
    index = next(i for i in table.indexes if i.name == constraint_name(TABLE, "unique_idx"))
    with engine.begin() as conn:
        conn.execute(text(f'DROP INDEX "{index.name}"'))
        conn.execute(CreateIndex(index))


def test_a_keyed_enqueue_names_both_definitions_and_leaves_the_transaction_usable(
    engine: Engine, before: None
) -> None:
    Sessions = sessionmaker(engine, class_=QueueSession)
    with Sessions() as session:
        session.add(_Note(id=1))
        with pytest.raises(EnqueueError) as caught:
            session.enqueue(JobAfter(), unique_key="order:42")
        message = str(caught.value)
        assert "does not match the model's __queue_unique__ = UniqueJobs(column='unique_key', " in message
        assert "statuses=('pending', 'running', 'done'))" in message
        database, model = (line for line in message.splitlines() if line.startswith("  "))
        assert database.startswith("  database: CREATE UNIQUE INDEX unique_change_jobs_unique_idx")
        assert "'done'" not in database and "'done'" in model
        assert model.startswith("  model:    CREATE UNIQUE INDEX unique_change_jobs_unique_idx")
        with pytest.raises(EnqueueError, match="does not match"):
            enqueue_many(session, JobAfter, [{"unique_key": "order:43"}])
        session.commit()  # the business row goes in: nothing aborted the transaction
    assert _count(engine, _Note.__table__) == 1
    assert _count(engine, JobAfter.__table__) == 0
    _migrate(engine)
    with Sessions() as session:
        assert session.enqueue(JobAfter(), unique_key="order:42").inserted
        session.commit()


def test_a_worker_refuses_to_start_on_both_runtimes(engine: Engine, before: None, make_worker: Any) -> None:
    worker = make_worker(engine, JobAfter, lambda job: None)
    with pytest.raises(WorkerStartError, match=r"(?s)does not match.*database: CREATE UNIQUE INDEX.*model: "):
        worker.start()
    worker.stop()
    _migrate(engine)
    worker = make_worker(engine, JobAfter, lambda job: None)
    worker.start()
    worker.stop(grace=1)


def test_drop_and_create_queue_indexes_replace_the_unique_index(engine: Engine, before: None) -> None:
    """The Alembic guide's hand-written migration: drop the queue's indexes with the old
    declaration, create them with the new one; and back, for the downgrade. Without a
    declaration the unique index is left alone, as before."""
    from alembic.migration import MigrationContext
    from alembic.operations import Operations

    import sqla_queue.alembic  # noqa: F401  (registers the operations)

    def indexes(conn: Any = None) -> dict[str, str]:
        if conn is None:
            with engine.connect() as own:
                return indexes(own)
        rows = conn.execute(text("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = :t"), {"t": TABLE})
        return {str(name): str(definition) for name, definition in rows}

    old = indexes()
    with engine.begin() as conn:
        op: Any = Operations(MigrationContext.configure(conn))
        op.drop_queue_indexes(TABLE)
        assert set(indexes(conn)) == {f"{TABLE}_pkey", f"{TABLE}_unique_idx"}
        op.create_queue_indexes(TABLE)
        op.drop_queue_indexes(TABLE, unique=UniqueJobs())
        assert set(indexes(conn)) == {f"{TABLE}_pkey"}
        op.create_queue_indexes(TABLE, unique=JobAfter.__queue_unique__)
    new = indexes()
    assert set(new) == set(old) and "'done'" in new[f"{TABLE}_unique_idx"]
    with sessionmaker(engine, class_=QueueSession)() as session:
        assert session.enqueue(JobAfter(), unique_key="k").inserted
        session.commit()
    with engine.begin() as conn:
        op = Operations(MigrationContext.configure(conn))
        op.drop_queue_indexes(TABLE, unique=JobAfter.__queue_unique__)
        op.create_queue_indexes(TABLE, unique=UniqueJobs())
    assert indexes() == old


def test_a_missing_unique_index_is_named_too(engine: Engine, before: None) -> None:
    with engine.begin() as conn:
        conn.execute(text(f'DROP INDEX "{constraint_name(TABLE, "unique_idx")}"'))
    with sessionmaker(engine, class_=QueueSession)() as session, pytest.raises(
        EnqueueError, match="database: \\(no index named 'unique_change_jobs_unique_idx'\\)"
    ):
        session.enqueue(JobBefore(), unique_key="k")

