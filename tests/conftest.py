"""Test database: ``DATABASE_URL`` if set, else an embedded PostgreSQL started for the run.

Each run works in a database of its own (created here, dropped at the end), so runs never
see each other's rows; worker processes started by tests find it in ``SQLA_QUEUE_TEST_URL``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import URL, Engine, create_engine, make_url, text
from sqlalchemy.pool import NullPool

from sqla_queue.embedded import EmbeddedPostgres

from . import models
from .helpers import Server

pytest_plugins = ["tests.workers"]


def _admin_url() -> tuple[URL, EmbeddedPostgres | None]:
    raw = os.environ.get("DATABASE_URL")
    if raw:
        url = make_url(raw)
        if url.drivername in ("postgresql", "postgres"):
            url = url.set(drivername="postgresql+psycopg")
        return url, None
    pg = EmbeddedPostgres().start()
    return pg.url, pg


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    admin, embedded = _admin_url()
    name = f"sqla_queue_test_{uuid.uuid4().hex[:10]}"
    admin_engine = create_engine(admin, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin_engine.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = admin.set(database=name)
    os.environ["SQLA_QUEUE_TEST_URL"] = url.render_as_string(hide_password=False)
    try:
        yield Server(url=url, admin_url=admin, embedded=embedded)
    finally:
        with admin_engine.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin_engine.dispose()
        if embedded is not None:
            embedded.stop()


@pytest.fixture(scope="session")
def _schema(server: Server) -> Iterator[Engine]:
    engine = create_engine(server.url, pool_pre_ping=True)
    models.Base.metadata.create_all(engine)
    yield engine
    engine.dispose()


def _empty_tables(engine: Engine) -> None:
    tables = ", ".join(f'"{t.name}"' for t in models.all_tables())
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))


@pytest.fixture
def engine(_schema: Engine) -> Engine:
    """The test database's engine, with every shared table emptied before the test."""
    _empty_tables(_schema)
    return _schema


@pytest.fixture(scope="session")
def private_server() -> Iterator[Server]:
    """An embedded PostgreSQL of the suite's own, for tests that restart the server.

    Started whatever ``DATABASE_URL`` says: the suite never restarts a server it did not
    start, since that one may serve other people too. Stopped (and removed) at the end.
    """
    with EmbeddedPostgres() as pg:
        setup = create_engine(pg.url, poolclass=NullPool)
        models.Base.metadata.create_all(setup)
        setup.dispose()
        yield Server(url=pg.url, admin_url=pg.url, embedded=pg)


@pytest.fixture
def private_engine(private_server: Server) -> Iterator[Engine]:
    """An engine on :func:`private_server`, its tables emptied before the test."""
    engine = create_engine(private_server.url, pool_pre_ping=True)
    _empty_tables(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def listener(server: Server) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """A raw autocommit psycopg connection, for LISTEN."""
    conn = psycopg.connect(server.conninfo, autocommit=True)
    try:
        yield conn
    finally:
        conn.close()


@pytest.fixture
def worker_processes(tmp_path: object, runtime: Any) -> Iterator[object]:
    """Start worker processes of the test's runtime with ``start(*cli_args)``; all are
    killed after the test."""
    from .helpers import WorkerProcess

    started: list[WorkerProcess] = []

    def start(
        *args: str,
        app_name: str = "sqla_queue_worker",
        url: str | None = None,
        target: str = "tests.worker_app:make_worker",
    ) -> WorkerProcess:
        process = WorkerProcess(
            *args, app_name=app_name, log_dir=tmp_path, url=url, target=target, runtime=runtime.name
        )
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()
