"""The enqueue and handlers guides' task-function snippets: a task enqueued from its own
function, its payload checked against the function's signature, run by a worker that
passes the payload back as the same keywords."""

from __future__ import annotations

import asyncio

from sqlalchemy.orm import Session

from _db import database_url
from shop_models import Base, Charge, Order, Task

sent: list[str] = []

# --8<-- [start:tasks]
from sqla_queue import Tasks

tasks = Tasks(Task)  # the task table its functions enqueue into


@tasks.task
def send_receipt(job: Task, *, to: str, order_id: int, copy: bool = False) -> None:
    sent.append(f"receipt of order {order_id} to {to}")  # job.payload holds the same


@tasks.task(name="billing.charge")
def charge(job: Task, session: Session, *, order_id: int) -> None:  # transactional
    session.add(Charge(order_id=order_id))
# --8<-- [end:tasks]


def main(url: str) -> None:
    from sqlalchemy import create_engine, func, select
    from sqlalchemy.orm import sessionmaker

    from sqla_queue import QueueSession
    from sqla_queue.testing import run_until_idle

    engine = create_engine(url)
    Base.metadata.create_all(engine)
    Sessions = sessionmaker(engine, class_=QueueSession)
    try:
        with Sessions() as session:
            # --8<-- [start:enqueue]
            order = Order(customer="ada")
            session.add(order)
            session.flush()
            send_receipt.enqueue(session, to="ada@example.com", order_id=order.id)  # a Task row, added
            charge.with_options(queue="billing", priority=5).enqueue(session, order_id=order.id)
            once = send_receipt.with_options(unique_key=f"copy:{order.id}")
            first = once.enqueue(session, to="books@example.com", order_id=order.id)  # inserted
            again = once.enqueue(session, to="books@example.com", order_id=order.id)  # skipped: key held
            session.commit()  # the order and its jobs, or none of them
            # --8<-- [end:enqueue]
            assert first.inserted and again.skipped
            order_id = order.id

            # --8<-- [start:refused]
            from sqla_queue import TaskArgumentError

            try:
                send_receipt.enqueue(session, to="bo@example.com")  # type: ignore[call-overload]  # mypy says so too
            except TaskArgumentError as exc:  # a TypeError, and an EnqueueError
                print(exc)  # cannot enqueue task 'send_receipt': missing a required argument: 'order_id' ...
            # --8<-- [end:refused]
            assert not session.new
        stats = run_until_idle(engine, Task, tasks)
        assert stats.done == 3, stats
        receipts = [f"receipt of order {order_id} to {to}" for to in ("ada@example.com", "books@example.com")]
        assert sorted(sent) == receipts, sent
        with engine.connect() as conn:
            assert conn.scalar(select(func.count()).select_from(Charge)) == 1
        asyncio.run(enqueue_async(url, order_id))
        with engine.connect() as conn:
            assert conn.scalar(select(func.count()).select_from(Task)) == 4
    finally:
        engine.dispose()
    print("tasks enqueued from their functions ran with their payloads as keywords")


async def enqueue_async(url: str, order_id: int) -> None:
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    from sqla_queue import AsyncQueueSession

    engine = create_async_engine(url)
    AsyncSessions = async_sessionmaker(engine, class_=AsyncQueueSession, expire_on_commit=False)
    try:
        # --8<-- [start:async]
        async with AsyncSessions() as session:
            job = await send_receipt.enqueue(session, to="ada@example.com", order_id=order_id, copy=True)
            await session.commit()
        # --8<-- [end:async]
        assert job.payload == {"to": "ada@example.com", "order_id": order_id, "copy": True}
    finally:
        await engine.dispose()


if __name__ == "__main__":
    with database_url() as url:
        main(url)
