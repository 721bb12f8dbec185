"""A keyed ``enqueue()`` of an ``AsyncSession`` inserts its job when awaited; one that is
never awaited makes the commit fail loudly instead of losing the job. Real PostgreSQL,
through psycopg 3's async driver."""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from sqla_queue import AsyncQueueSession, EnqueueError, enqueue

from .helpers import Server, table_of
from .models import Order, Task

TASKS = table_of(Task)


def _run(server: Server, body: Callable[[AsyncEngine], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        async_engine = create_async_engine(server.url.set(drivername="postgresql+psycopg"))
        try:
            return await body(async_engine)
        finally:
            await async_engine.dispose()

    return asyncio.run(main())


def _count(engine: Engine, model: Any) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(model)) or 0)


@pytest.mark.parametrize("session_class", [AsyncQueueSession, AsyncSession])
def test_a_keyed_enqueue_never_awaited_fails_the_commit(engine: Engine, server: Server, session_class: Any) -> None:
    async def body(async_engine: AsyncEngine) -> None:
        Sessions = async_sessionmaker(async_engine, class_=session_class)
        async with Sessions() as session:
            session.add(Order(id=1, customer="ada"))
            enqueue(session, Task(task="invoice"), unique_key="order:1")  # the await forgotten
            with pytest.raises(EnqueueError, match=r"never awaited.*Task unique_key='order:1'"):
                await session.commit()
            with pytest.raises(EnqueueError, match="never awaited"):
                await session.commit()  # still refused: the job is still not in
            await session.rollback()  # the caller gives up: nothing of it stays
            session.add(Order(id=2, customer="bob"))
            await session.commit()  # a new transaction commits as usual

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # and no "never awaited" warning
        _run(server, body)
        gc.collect()
    assert _count(engine, Task) == 0
    assert _count(engine, Order) == 1


def test_awaited_late_gathered_or_closed_on_purpose_commits(engine: Engine, server: Server) -> None:
    async def body(async_engine: AsyncEngine) -> list[bool]:
        Sessions = async_sessionmaker(async_engine, class_=AsyncQueueSession)
        async with Sessions() as session:
            late = session.enqueue(Task(task="a"), unique_key="a")
            session.add(Order(id=1, customer="ada"))
            first = await late  # awaited before the commit: fine
            gathered = await asyncio.gather(session.enqueue(Task(task="b"), unique_key="b"))
            task = await asyncio.create_task(session.enqueue(Task(task="a"), unique_key="a"))
            given_up = session.enqueue(Task(task="c"), unique_key="c")
            given_up.close()  # deliberately not run
            await session.commit()
        return [first.inserted, gathered[0].inserted, task.inserted]

    assert _run(server, body) == [True, True, False]
    with engine.connect() as conn:
        assert sorted(conn.scalars(select(TASKS.c.unique_key))) == ["a", "b"]
    assert _count(engine, Order) == 1
