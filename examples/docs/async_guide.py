"""The async guide's snippets: enqueue from asyncio, async handlers, the AsyncWorker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from sqlalchemy import func, select

from _db import database_url
from shop_models import Base, Charge, EmailJob, Order


class _Mailer:
    def __init__(self) -> None:
        self.sent: list[str] = []

    async def send(self, recipient: str, *, order_id: int) -> None:
        self.sent.append(recipient)


mailer = _Mailer()

# --8<-- [start:handlers]
from sqlalchemy.ext.asyncio import AsyncSession


async def send_confirmation(job: EmailJob) -> None:
    await mailer.send(job.recipient, order_id=job.order_id)


async def charge(job: EmailJob, session: AsyncSession) -> None:  # transactional
    order = await session.get(Order, job.order_id)
    assert order is not None
    session.add(Charge(order_id=order.id))  # commits with the job's completion, once
# --8<-- [end:handlers]


async def more_rows(order_id: int) -> AsyncIterator[dict[str, object]]:
    for n in range(3):
        yield {"order_id": order_id, "recipient": f"reader{n}@example.com"}


async def main(url: str) -> None:
    # --8<-- [start:enqueue]
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    from sqla_queue import AsyncQueueSession

    engine = create_async_engine(url)  # "postgresql+psycopg://app:secret@localhost/shop": psycopg 3
    Session = async_sessionmaker(engine, class_=AsyncQueueSession)
    # --8<-- [end:enqueue]
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    try:
        # --8<-- [start:enqueue-session]

        async with Session() as session:
            order = Order(customer="ada")
            session.add(order)
            await session.flush()
            session.enqueue(EmailJob(order_id=order.id, recipient="ada@example.com"), queue="emails")
            rows = more_rows(order.id)  # any iterable, or an async iterable
            await session.enqueue_many(EmailJob, rows, queue="emails")
            await session.commit()  # the order, the jobs and one NOTIFY per queue, or none of them
        # --8<-- [end:enqueue-session]
        async with engine.connect() as c:
            order_id = await c.scalar(select(Order.id))
        assert order_id is not None

        # --8<-- [start:values]
        from sqla_queue import enqueue_values

        async with engine.begin() as conn:  # or an AsyncSession, an async_scoped_session
            job_id = await enqueue_values(
                conn, EmailJob, {"order_id": order_id, "recipient": "bob@example.com"}, queue="billing"
            )
        # --8<-- [end:values]
        assert isinstance(job_id, int)

        # --8<-- [start:worker]
        from sqla_queue import AsyncWorker

        worker = AsyncWorker(engine, EmailJob, send_confirmation, queues=("emails",), concurrency=16)
        async with worker:  # started, and stopped when the block ends
            ...  # your application runs here
        # --8<-- [end:worker]
        await AsyncWorker(engine, EmailJob, send_confirmation, queues=("emails",)).run(until_idle=True)
        await AsyncWorker(engine, EmailJob, charge, queues=("billing",)).run(until_idle=True)

        async with engine.connect() as c:
            done = await c.scalar(select(func.count()).where(EmailJob.status == "done"))
            charges = await c.scalar(select(func.count()).select_from(Charge))
        print(f"jobs done: {done}; charges: {charges}; mail to {sorted(mailer.sent)}")
        assert (done, charges, len(mailer.sent)) == (5, 1, 4)
    finally:
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.drop_all)
        await engine.dispose()


if __name__ == "__main__":
    with database_url() as url:
        asyncio.run(main(url))
