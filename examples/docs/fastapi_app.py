"""A first job with FastAPI: the order and its job commit in one AsyncSession
transaction, and an AsyncWorker runs in the app's lifespan.

    python examples/docs/fastapi_app.py      # DATABASE_URL, or an embedded server
    DATABASE_URL=... uvicorn --factory --app-dir examples/docs fastapi_app:app_from_env
"""

from __future__ import annotations

import asyncio
import os

import httpx
from sqlalchemy import select

from _db import database_url

# isort: split
# --8<-- [start:app]
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from sqlalchemy import ForeignKey
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqla_queue import AsyncQueueSession, AsyncWorker, JobMixin


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str]


class ConfirmationEmail(Base, JobMixin):
    __tablename__ = "confirmation_emails"
    order_id: Mapped[int] = mapped_column(ForeignKey(Order.id))
    to: Mapped[str]


async def send_confirmation(job: ConfirmationEmail) -> None:
    print(f"mail to {job.to} about order {job.order_id}")  # an async mail client here


def create_app(url: str) -> FastAPI:
    engine = create_async_engine(url)  # postgresql+psycopg://...: psycopg 3
    Session = async_sessionmaker(engine, class_=AsyncQueueSession, expire_on_commit=False)
    worker = AsyncWorker(engine, ConfirmationEmail, send_confirmation)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await worker.start()  # WorkerStartError now, before the app serves a request
        yield
        await worker.stop()  # running jobs get shutdown_grace, then go back to pending
        await engine.dispose()

    app = FastAPI(lifespan=lifespan)

    @app.post("/orders", status_code=201)
    async def place_order(customer: str) -> dict[str, int]:
        async with Session() as session:
            order = Order(customer=customer)
            session.add(order)
            await session.flush()
            session.enqueue(ConfirmationEmail(order_id=order.id, to=f"{customer}@example.com"))
            await session.commit()  # the order, its job and the worker's wake-up, or none
        return {"order_id": order.id}

    return app
# --8<-- [end:app]


def app_from_env() -> FastAPI:
    return create_app(os.environ["DATABASE_URL"])


async def tour(url: str) -> None:
    own = create_async_engine(url)
    async with own.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)  # a real app migrates (see Alembic)
    try:
        app = create_app(url)
        async with (
            app.router.lifespan_context(app),  # what uvicorn runs at start-up and shutdown
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://shop") as client,
        ):
            response = await client.post("/orders", params={"customer": "ada"})
            assert response.status_code == 201, response.text
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while True:
                async with own.connect() as conn:
                    status = await conn.scalar(select(ConfirmationEmail.status))
                if status == "done":
                    break
                assert loop.time() < deadline, f"the job is still {status}"
                await asyncio.sleep(0.05)
        print(f"order {response.json()['order_id']}: confirmation {status}")
    finally:
        async with own.begin() as conn:
            await conn.run_sync(Base.metadata.drop_all)
        await own.dispose()


if __name__ == "__main__":
    with database_url() as url:
        asyncio.run(tour(url))
