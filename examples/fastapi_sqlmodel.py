"""A FastAPI shop on SQLModel whose order confirmations run on an AsyncWorker inside the app.

The tables are SQLModel models; the queue table is one too, built on
``sqla_queue.sqlmodel.JobModel``. Placing an order writes the order, takes it from stock
and enqueues its confirmation in one transaction of SQLModel's ``AsyncSession`` (with
``enqueue()``): an order that fails (out of stock) leaves neither an order nor a job
behind. A bulk endpoint enqueues many reminders at once (``enqueue_many``, by COPY). The
app's lifespan starts an ``AsyncWorker`` and stops it at shutdown; the async
transactional handler writes the confirmation in the job's own transaction, so every
order is confirmed exactly once.

    python examples/fastapi_sqlmodel.py      # a scripted tour over HTTP (embedded PostgreSQL
                                             # if DATABASE_URL is unset)
    DATABASE_URL=... uvicorn --factory --app-dir examples fastapi_sqlmodel:create_app   # served
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
from sqlalchemy import func
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlmodel import Field, SQLModel, col, select

if __name__ == "__main__":  # run from a checkout: the package beside this folder
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqla_queue import AsyncWorker
from sqla_queue.sqlmodel import AsyncQueueSession, JobModel
from sqla_queue.urls import psycopg_url


class Product(SQLModel, table=True):
    __tablename__ = "fastapi_sqlmodel_products"

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=100)
    stock: int


class Order(SQLModel, table=True):
    __tablename__ = "fastapi_sqlmodel_orders"

    id: int | None = Field(default=None, primary_key=True)
    product_id: int = Field(foreign_key="fastapi_sqlmodel_products.id")
    quantity: int
    email: str = Field(max_length=200)


class ConfirmOrder(JobModel, table=True):
    """The queue table: a SQLModel model of the shop's, with a foreign key to the order."""

    __tablename__ = "fastapi_sqlmodel_confirm_order"

    order_id: int = Field(foreign_key="fastapi_sqlmodel_orders.id")
    reminder: bool = False


class Confirmation(SQLModel, table=True):
    """Written by the handler: one row per job, committed with the job's completion."""

    __tablename__ = "fastapi_sqlmodel_confirmations"

    id: int | None = Field(default=None, primary_key=True)
    order_id: int = Field(foreign_key="fastapi_sqlmodel_orders.id")
    reminder: bool
    attempt: int
    confirmed_at: datetime | None = Field(default=None, sa_column_kwargs={"server_default": func.now()})


class OrderIn(SQLModel):
    product_id: int
    quantity: int
    email: str


class OrderOut(SQLModel):
    order_id: int
    confirmed: bool
    job: str | None


async def confirm(job: ConfirmOrder, session: AsyncQueueSession) -> None:
    """Transactional: the confirmation commits with the job's completion, or not at all.

    The worker commits after this returns; a rerun (after a crash or a lost lease) finds
    the earlier run's writes rolled back, so no order is confirmed twice.
    """
    order = await session.get(Order, job.order_id)
    assert order is not None and order.id is not None  # the job and its order were committed together
    session.add(Confirmation(order_id=order.id, reminder=job.reminder, attempt=job.attempts))


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
    order = Order(product_id=data.product_id, quantity=data.quantity, email=data.email)
    db.add(order)
    await db.flush()
    assert order.id is not None
    db.enqueue(ConfirmOrder(order_id=order.id), max_attempts=5)
    try:
        take_from_stock(product, order)
    except OutOfStock as exc:
        await db.rollback()  # the order and its job go together
        raise HTTPException(409, str(exc)) from None
    await db.commit()  # the order, the stock, the job and the worker's wake-up: all or nothing
    return {"order_id": order.id}


@router.post("/reminders", status_code=202)
async def send_reminders(db: DB) -> dict[str, int]:
    """A reminder for every order, enqueued in one statement (COPY, for many rows)."""
    order_ids = (await db.exec(select(Order.id).order_by(col(Order.id)))).all()
    rows = ({"order_id": order_id, "reminder": True} for order_id in order_ids)
    count = await db.enqueue_many(ConfirmOrder, rows, queue="reminders", priority=-1)
    await db.commit()
    return {"enqueued": count}


@router.get("/orders/{order_id}", response_model=OrderOut)
async def show_order(order_id: int, db: DB) -> OrderOut:
    order = await db.get(Order, order_id)
    if order is None:
        raise HTTPException(404, f"no order {order_id}")
    confirmed = await db.exec(
        select(func.count()).select_from(Confirmation).where(Confirmation.order_id == order_id)
    )
    job = await db.exec(
        select(ConfirmOrder.status).where(ConfirmOrder.order_id == order_id, col(ConfirmOrder.reminder).is_(False))
    )
    return OrderOut(order_id=order_id, confirmed=bool(confirmed.one()), job=job.first())


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
    sessions = async_sessionmaker(engine, class_=AsyncQueueSession, expire_on_commit=False)
    options: dict[str, Any] = {"concurrency": 4, "poll_interval": 1.0, **worker_options}
    # The handler's session is SQLModel's too (exec()), joined to the job's transaction.
    worker = AsyncWorker(engine, ConfirmOrder, confirm, session_factory=sessions, **options)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with engine.begin() as conn:  # a real app migrates instead (see Alembic)
            await conn.run_sync(SQLModel.metadata.create_all)
        await worker.start()  # fails here (WorkerStartError), before any request is served
        try:
            yield
        finally:
            await worker.stop()  # running confirmations finish within the grace
            await engine.dispose()

    app = FastAPI(title="sqla_queue shop on SQLModel", lifespan=lifespan)
    app.state.sessions = sessions
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
            async with AsyncQueueSession(own) as session:
                session.add(Product(id=1, name="teapot", stock=5))
                await session.commit()
            placed: list[int] = []
            for email, quantity in [("ada@example.com", 2), ("bob@example.com", 2), ("cy@example.com", 3)]:
                response = await client.post("/orders", json={"product_id": 1, "quantity": quantity, "email": email})
                print(f"order by {email:<16} x{quantity}: HTTP {response.status_code}")
                if response.status_code == 201:
                    placed.append(response.json()["order_id"])
            print(f"reminders: {(await client.post('/reminders')).json()}")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while True:  # the worker confirms them beside the app, on the same event loop
                states = [(await client.get(f"/orders/{order_id}")).json() for order_id in placed]
                async with AsyncQueueSession(own) as session:
                    waiting = (await session.exec(select(func.count()).where(ConfirmOrder.status != "done"))).one()
                if all(state["confirmed"] and state["job"] == "done" for state in states) and not waiting:
                    break
                if loop.time() > deadline:
                    raise RuntimeError(f"orders not confirmed in time: {states}")
                await asyncio.sleep(0.05)
            for state in states:
                print(f"order {state['order_id']}: confirmed={state['confirmed']} job={state['job']}")
        async with AsyncQueueSession(own) as session:
            keys = col(Confirmation.order_id), col(Confirmation.reminder)
            counted = select(*keys, func.count()).group_by(*keys).order_by(*keys)
            result = await session.exec(counted)
            per_order = {(order_id, "reminder" if reminder else "confirmation"): n for order_id, reminder, n in result}
        print(f"per order: {per_order}")
        print(f"worker stats: {app.state.worker.stats}")
    finally:
        async with own.begin() as conn:
            await conn.run_sync(SQLModel.metadata.drop_all)
        await own.dispose()


if __name__ == "__main__":
    if os.environ.get("DATABASE_URL"):
        asyncio.run(tour(os.environ["DATABASE_URL"]))
    else:
        from sqla_queue.embedded import EmbeddedPostgres

        with EmbeddedPostgres() as pg:
            asyncio.run(tour(pg.url.render_as_string(hide_password=False)))
