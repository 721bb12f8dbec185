"""Testing a FastAPI app's jobs with pytest: an AsyncEngine, an AsyncSession, async handlers.

Run it with pytest (``DATABASE_URL=postgresql://… python -m pytest examples/docs/testing_fastapi.py``),
or as a script, which runs pytest on itself. The async tests use the anyio pytest plugin
that comes with FastAPI (``@pytest.mark.anyio``); the queue table is real (created in the
test database, dropped afterwards).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import String, create_engine
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.pool import NullPool

from sqla_queue import AsyncQueueSession, JobMixin
from sqla_queue.testing import (
    aassert_enqueued,
    aassert_not_enqueued,
    arun_until_idle,
    assert_enqueued,
)


class Base(DeclarativeBase):
    pass


class WelcomeEmail(Base, JobMixin):
    __tablename__ = "example_fastapi_welcome_emails"

    recipient: Mapped[str] = mapped_column(String(200))


# --8<-- [start:app]
# -- the application code under test --------------------------------------------------

sent: list[str] = []


async def send_welcome(job: WelcomeEmail) -> None:
    sent.append(job.recipient)  # an async mail client here


def create_app(engine: AsyncEngine) -> FastAPI:
    Session = async_sessionmaker(engine, class_=AsyncQueueSession, expire_on_commit=False)
    app = FastAPI()

    @app.post("/signups", status_code=201)
    async def sign_up(email: str) -> dict[str, str]:
        async with Session() as session:
            session.enqueue(WelcomeEmail(recipient=email), queue="mail")
            await session.commit()
        return {"email": email}

    return app
# --8<-- [end:app]


URL = os.environ.get("DATABASE_URL", "").replace("postgresql://", "postgresql+psycopg://", 1)


# --8<-- [start:tests]
@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def tables() -> Iterator[None]:
    setup = create_engine(URL)  # postgresql+psycopg://: the same driver, synchronous
    Base.metadata.create_all(setup)
    sent.clear()
    yield
    Base.metadata.drop_all(setup)
    setup.dispose()


@pytest.fixture
async def engine(tables: None) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(URL)
    yield engine
    await engine.dispose()


@pytest.mark.anyio
async def test_sign_up_enqueues_a_welcome_email(engine: AsyncEngine) -> None:
    app = create_app(engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        response = await client.post("/signups", params={"email": "ada@example.com"})
    assert response.status_code == 201
    await aassert_enqueued(engine, WelcomeEmail, recipient="ada@example.com", queue="mail")


@pytest.mark.anyio
async def test_the_worker_sends_it(engine: AsyncEngine) -> None:
    app = create_app(engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        await client.post("/signups", params={"email": "ada@example.com"})
    stats = await arun_until_idle(engine, WelcomeEmail, send_welcome)  # an AsyncWorker
    assert stats.done == 1
    assert sent == ["ada@example.com"]
    await aassert_not_enqueued(engine, WelcomeEmail)  # nothing left pending


@pytest.mark.anyio
async def test_an_async_session_s_jobs_are_seen_before_its_commit(engine: AsyncEngine) -> None:
    async with async_sessionmaker(engine, class_=AsyncQueueSession)() as session:
        session.enqueue(WelcomeEmail(recipient="bob@example.com"))
        await aassert_enqueued(session, WelcomeEmail, recipient="bob@example.com")  # on its connection
        await aassert_not_enqueued(engine, WelcomeEmail)  # not committed: no one else sees it


def test_with_the_synchronous_test_client(tables: None) -> None:
    # TestClient runs the app on an event loop of its own: no pool shared across loops.
    engine = create_async_engine(URL, poolclass=NullPool)
    with TestClient(create_app(engine)) as client:
        assert client.post("/signups", params={"email": "eve@example.com"}).status_code == 201
    # The synchronous helpers take the AsyncEngine too (committed rows).
    assert_enqueued(engine, WelcomeEmail, recipient="eve@example.com", count=1)
# --8<-- [end:tests]


if __name__ == "__main__":
    # A process of its own: this one imported anyio (and its pytest plugin) already.
    # -o addopts=: in one process, whatever the pytest settings of the folder around it say
    # (this repository's run its own suite in four); these tests share one database.
    command = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    sys.exit(subprocess.call(command))
