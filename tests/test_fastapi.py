"""FastAPI with an in-process AsyncWorker, through the example shop: its HTTP API, its
lifespan and real PostgreSQL."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import func, insert, select
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from .helpers import Server

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "fastapi_shop.py"


def _load_shop() -> Any:
    spec = importlib.util.spec_from_file_location("fastapi_shop", EXAMPLE)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["fastapi_shop"] = module
    spec.loader.exec_module(module)
    return module


shop = _load_shop()


@asynccontextmanager
async def running_shop(server: Server, stock: int) -> AsyncIterator[tuple[Any, httpx.AsyncClient, AsyncEngine]]:
    """The app with its lifespan entered (tables created, worker started), an HTTP client
    on it, and an engine of the test's own; the example's tables dropped afterwards."""
    url = server.url.render_as_string(hide_password=False)
    app = shop.create_app(url, concurrency=3, poll_interval=0.5)
    engine = create_async_engine(url)
    try:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://shop") as client,
        ):
            async with engine.begin() as conn:
                await conn.execute(insert(shop.Product).values(id=1, name="teapot", stock=stock))
            yield app, client, engine
    finally:
        async with engine.begin() as conn:
            await conn.run_sync(shop.Base.metadata.drop_all)
        await engine.dispose()


async def wait_until(condition: Callable[[], Awaitable[bool]], timeout: float = 20.0, what: str = "") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or condition}")
        await asyncio.sleep(0.02)


async def order(client: httpx.AsyncClient, quantity: int, email: str) -> httpx.Response:
    return await client.post("/orders", json={"product_id": 1, "quantity": quantity, "email": email})


def test_every_order_is_confirmed_once_by_the_worker_in_the_lifespan(server: Server) -> None:
    async def scenario() -> None:
        async with running_shop(server, stock=100) as (app, client, engine):
            responses = await asyncio.gather(*(order(client, 1, f"c{i}@example.com") for i in range(12)))
            assert [r.status_code for r in responses] == [201] * 12
            placed = sorted(r.json()["order_id"] for r in responses)

            async def all_done() -> bool:
                async with engine.connect() as conn:
                    statuses = (await conn.scalars(select(shop.ConfirmOrder.status))).all()
                return len(statuses) == 12 and set(statuses) == {"done"}

            await wait_until(all_done, what="every confirmation job done")
            async with engine.connect() as conn:
                counted = select(shop.Confirmation.order_id, func.count().label("n")).group_by(
                    shop.Confirmation.order_id
                )
                per_order = {row.order_id: row.n for row in await conn.execute(counted)}
                jobs = (await conn.execute(select(shop.ConfirmOrder.order_id, shop.ConfirmOrder.attempts))).all()
            assert per_order == dict.fromkeys(placed, 1)
            assert sorted(jobs) == [(order_id, 1) for order_id in placed]
            shown = (await client.get(f"/orders/{placed[0]}")).json()
            assert shown == {"order_id": placed[0], "confirmed": True, "job": "done"}

            async def all_counted() -> bool:  # counted once each COMMIT returns
                return bool(app.state.worker.stats.done == 12)

            await wait_until(all_counted, what="the worker to count the twelve")
        # The lifespan's exit stopped the worker: it holds nothing.
        assert app.state.worker.held() == []

    asyncio.run(scenario())


def test_an_order_that_fails_leaves_neither_order_nor_job(server: Server) -> None:
    async def scenario() -> None:
        async with running_shop(server, stock=2) as (_app, client, engine):
            assert (await order(client, 3, "greedy@example.com")).status_code == 409
            assert (await client.get("/orders/1")).status_code == 404
            kept = await order(client, 2, "ada@example.com")
            assert kept.status_code == 201

            async def confirmed() -> bool:
                return bool((await client.get(f"/orders/{kept.json()['order_id']}")).json()["confirmed"])

            await wait_until(confirmed, what="the kept order confirmed")
            async with engine.connect() as conn:
                orders = (await conn.scalars(select(shop.Order.email))).all()
                jobs = await conn.scalar(select(func.count()).select_from(shop.ConfirmOrder))
                stock = await conn.scalar(select(shop.Product.stock))
            assert (orders, jobs, stock) == (["ada@example.com"], 1, 0)

    asyncio.run(scenario())
