"""A FastAPI shop whose order confirmations run on an AsyncWorker inside the app.

Placing an order writes the order, takes it from stock and enqueues its confirmation in one
``AsyncSession`` transaction: an order that fails (out of stock) leaves neither an order
nor a job behind. The app's lifespan starts an ``AsyncWorker`` on the app's event loop and
stops it at shutdown; its async transactional handler writes the confirmation in the job's
own transaction, so every order is confirmed exactly once.

    python examples/fastapi_shop.py      # a scripted tour over HTTP (embedded PostgreSQL
                                         # if DATABASE_URL is unset)
    DATABASE_URL=... uvicorn --factory --app-dir examples fastapi_shop:create_app   # served
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import httpx
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel
from sqlalchemy import ForeignKey, String, func, insert, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqla_queue import AsyncQueueSession, AsyncWorker, JobMixin
from sqla_queue.urls import psycopg_url


class Base(DeclarativeBase):
    pass


class Product(Base):
    __tablename__ = "fastapi_shop_products"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100))
    stock: Mapped[int]


class Order(Base):
    __tablename__ = "fastapi_shop_orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    product_id: Mapped[int] = mapped_column(ForeignKey(Product.id))
    quantity: Mapped[int]
    email: Mapped[str] = mapped_column(String(200))


class ConfirmOrder(Base, JobMixin):
    """The queue table: the shop's own model, with a foreign key to the order."""

    __tablename__ = "fastapi_shop_confirm_order"

    order_id: Mapped[int] = mapped_column(ForeignKey(Order.id))


class Confirmation(Base):
    """Written by the handler: one row per order, as it commits with the job's completion."""

    __tablename__ = "fastapi_shop_confirmations"

    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[int] = mapped_column(ForeignKey(Order.id))
    attempt: Mapped[int]
    confirmed_at: Mapped[datetime] = mapped_column(server_default=func.now())


async def confirm(job: ConfirmOrder, session: AsyncSession) -> None:
    """Transactional: the confirmation commits with the job's completion, or not at all.

    The worker commits after this returns; a rerun (after a crash or a lost lease) finds
    the earlier run's writes rolled back, so no order is confirmed twice.
    """
    order = await session.get(Order, job.order_id)
    assert order is not None  # the job and its order were committed together
    session.add(Confirmation(order_id=order.id, attempt=job.attempts))


class OrderIn(BaseModel):
    product_id: int
    quantity: int
    email: str


class OutOfStock(Exception):
    pass


async def db_session(request: Request) -> AsyncIterator[AsyncQueueSession]:
    sessions: async_sessionmaker[AsyncQueueSession] = request.app.state.sessions
    async with sessions() as session:
        yield session


DB = Annotated[AsyncQueueSession, Depends(db_session)]

router = APIRouter()


@router.post("/orders", status_code=201)
async def place_order(data: OrderIn, db: DB) -> dict[str, int]:
    # The product is locked first: inserting the order takes a key-share lock on it (the
    # foreign key), and two orders upgrading theirs to FOR UPDATE would deadlock.
    product = await db.get(Product, data.product_id, with_for_update=True)
    if product is None:
        raise HTTPException(404, f"no product {data.product_id}")
    order = Order(product_id=product.id, quantity=data.quantity, email=data.email)
    db.add(order)
    await db.flush()
    db.enqueue(ConfirmOrder(order_id=order.id), max_attempts=5)
    try:
        take_from_stock(product, order)
    except OutOfStock as exc:
        await db.rollback()  # the order and its job go together
        raise HTTPException(409, str(exc)) from None
    await db.commit()  # the order, the stock, the job and the worker's wake-up: all or nothing
    return {"order_id": order.id}


@router.get("/orders/{order_id}")
async def show_order(order_id: int, db: DB) -> dict[str, Any]:
    order = await db.get(Order, order_id)
    if order is None:
        raise HTTPException(404, f"no order {order_id}")
    confirmed = await db.scalar(select(func.count()).where(Confirmation.order_id == order_id))
    job = await db.scalar(select(ConfirmOrder.status).where(ConfirmOrder.order_id == order_id))
    return {"order_id": order.id, "confirmed": bool(confirmed), "job": job}


def take_from_stock(product: Product, order: Order) -> None:
    if product.stock < order.quantity:
        raise OutOfStock(f"only {product.stock} left")
    product.stock -= order.quantity


def create_app(database_url: str | None = None, **worker_options: Any) -> FastAPI:
    """The shop and its worker; ``worker_options`` (``concurrency``, ``poll_interval``...)
    override the worker's defaults."""
    url = database_url or os.environ.get("DATABASE_URL")
    if not url:
        raise RuntimeError("set DATABASE_URL (or run this file directly for an embedded database)")
    engine = create_async_engine(psycopg_url(url))  # postgresql+psycopg: psycopg 3, async
    options: dict[str, Any] = {"concurrency": 4, "poll_interval": 1.0, **worker_options}
    worker = AsyncWorker(engine, ConfirmOrder, confirm, **options)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with engine.begin() as conn:  # a real app migrates instead (see Alembic)
            await conn.run_sync(Base.metadata.create_all)
        await worker.start()  # fails here (WorkerStartError), before any request is served
        try:
            yield
        finally:
            await worker.stop()  # running confirmations finish within the grace
            await engine.dispose()

    app = FastAPI(title="sqla_queue shop", lifespan=lifespan)
    app.state.sessions = async_sessionmaker(engine, class_=AsyncQueueSession, expire_on_commit=False)
    app.state.worker = worker
    app.include_router(router)
    return app


async def tour(database_url: str) -> None:
    """Place a few orders over HTTP, wait for the in-process worker, show what happened."""
    app = create_app(database_url, poll_interval=0.5)
    own = create_async_engine(psycopg_url(database_url))  # the tour's own look at the tables
    try:
        async with (
            app.router.lifespan_context(app),  # what uvicorn runs at start-up and shutdown
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://shop") as client,
        ):
            async with own.begin() as conn:
                await conn.execute(insert(Product).values(id=1, name="teapot", stock=5))
            placed: list[int] = []
            for email, quantity in [("ada@example.com", 2), ("bob@example.com", 2), ("cy@example.com", 3)]:
                response = await client.post("/orders", json={"product_id": 1, "quantity": quantity, "email": email})
                print(f"order by {email:<16} x{quantity}: HTTP {response.status_code}")
                if response.status_code == 201:
                    placed.append(response.json()["order_id"])
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while True:  # the worker confirms them beside the app, on the same event loop
                states = [(await client.get(f"/orders/{order_id}")).json() for order_id in placed]
                if all(state["confirmed"] and state["job"] == "done" for state in states):
                    break
                if loop.time() > deadline:
                    raise RuntimeError(f"orders not confirmed in time: {states}")
                await asyncio.sleep(0.05)
            for state in states:
                print(f"order {state['order_id']}: confirmed={state['confirmed']} job={state['job']}")
        async with own.connect() as conn:
            counted = select(Confirmation.order_id, func.count().label("n")).group_by(Confirmation.order_id)
            per_order = {row.order_id: row.n for row in await conn.execute(counted.order_by(Confirmation.order_id))}
        print(f"confirmations per order: {per_order}")
        print(f"worker stats: {app.state.worker.stats}")
    finally:
        async with own.begin() as conn:
            await conn.run_sync(Base.metadata.drop_all)
        await own.dispose()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if os.environ.get("DATABASE_URL"):
        asyncio.run(tour(os.environ["DATABASE_URL"]))
    else:
        from sqla_queue.embedded import EmbeddedPostgres

        with EmbeddedPostgres() as pg:
            asyncio.run(tour(pg.url.render_as_string(hide_password=False)))
