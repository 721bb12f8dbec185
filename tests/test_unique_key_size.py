"""A unique key column of the user's own without a length (``Text``): a key longer than
its B-tree index can hold is refused before anything is written, on every enqueue path,
and the caller's transaction stays usable. Real PostgreSQL."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, Text, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from sqla_queue import UNIQUE_EVER, EnqueueError, JobMixin, QueueSession, UniqueJobs, enqueue_values
from sqla_queue.enqueue._rules import MAX_KEY_BYTES


class _Base(DeclarativeBase):
    pass


class _Note(_Base):
    __tablename__ = "key_size_notes"
    id: Mapped[int] = mapped_column(primary_key=True)


class _RefJob(_Base, JobMixin):
    __tablename__ = "key_size_jobs"
    __queue_unique__ = UniqueJobs(column="ref", statuses=UNIQUE_EVER)
    ref: Mapped[str | None] = mapped_column(Text)


@pytest.fixture
def tables(engine: Engine) -> Iterator[None]:
    _Base.metadata.create_all(engine)
    yield
    _Base.metadata.drop_all(engine)


def _random(size: int) -> str:
    """Incompressible ASCII: the server cannot shrink it to fit an index entry."""
    return secrets.token_urlsafe(size)[:size]


def _count(engine: Engine, model: Any) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(model)) or 0)


def test_a_key_too_long_for_the_index_is_refused_and_the_transaction_goes_on(engine: Engine, tables: None) -> None:
    too_long = _random(MAX_KEY_BYTES + 1)
    with sessionmaker(engine, class_=QueueSession)() as session:
        session.add(_Note(id=1))  # the caller's business row
        with pytest.raises(EnqueueError, match="unique key of 2693 bytes"):
            session.enqueue(_RefJob(), unique_key=too_long)
        with pytest.raises(EnqueueError, match="ref"):
            session.enqueue_many(_RefJob, [{"ref": "fine"}, {"ref": too_long}])
        with pytest.raises(EnqueueError, match="ref"):
            session.enqueue_many(_RefJob, [{"ref": "fine"}, {"ref": too_long}], method="insert")
        with pytest.raises(EnqueueError, match="ref"):
            enqueue_values(session, _RefJob, {}, unique_key="é" * (MAX_KEY_BYTES // 2 + 1))
        # The longest incompressible key the index takes goes in.
        assert session.enqueue(_RefJob(), unique_key=_random(MAX_KEY_BYTES)).inserted
        session.commit()
    assert _count(engine, _Note) == 1
    assert _count(engine, _RefJob) == 1
