"""Test database: ``DATABASE_URL`` if set, else an embedded PostgreSQL started for the run.

Each run works in a database of its own (created here, dropped at the end), so runs never
see each other's rows; worker processes started by tests find it in ``SQLA_QUEUE_TEST_URL``.

Every test is in one tier (``pytest -m unit``, ``-m integration``, ``-m system``; see
CONTRIBUTING.md), given here from what it uses and kept true while it runs: a ``unit``
test that opens a database connection, or a test outside ``system`` that starts an OS
process, fails and says which mark it needs.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import URL, Engine, create_engine, make_url, text
from sqlalchemy.pool import NullPool

from sqla_queue.embedded import EmbeddedPostgres

from . import models
from .helpers import Server

pytest_plugins = ["tests.workers"]

TIERS = ("unit", "integration", "system")
#: Fixtures that make a test a ``system`` one: OS processes, or a server of its own.
SYSTEM_FIXTURES = frozenset({"worker_processes", "private_server", "private_engine"})
#: Every fixture that reaches the database goes through ``server``.
DATABASE_FIXTURES = frozenset({"server"})
#: The modules the compatibility run (the oldest SQLAlchemy series on the newest
#: PostgreSQL, in ``.ci/run``) takes beside the unit tier: the layers whose behaviour
#: depends on SQLAlchemy's or PostgreSQL's version (enqueue paths, ORM loading, async,
#: Alembic, the statement builders and the operations layer, the contract suite) and the
#: embedded server. Worker smoke tests join it with ``@pytest.mark.compat``.
COMPAT_MODULES = frozenset(
    {
        "test_activity",
        "test_alembic",
        "test_async_enqueue",
        "test_async_values",
        "test_bulk",
        "test_claim_cursor",
        "test_embedded",
        "test_enqueue",
        "test_idempotency_key",
        "test_inspect_sql",
        "test_loader_types",
        "test_model",
        "test_ops",
        "test_ops_contract",
        "test_schema_translate",
        "test_sql",
        "test_sqlmodel",
        "test_sqlmodel_alembic",
        "test_unique",
        "test_values",
        "test_worker_rows",
    }
)
UNIT_DIR = Path(__file__).resolve().parent / "unit"


def _tier(item: pytest.Item) -> str:
    explicit = [tier for tier in TIERS if item.get_closest_marker(tier) is not None]
    if "system" in explicit:
        return "system"
    if explicit:
        return explicit[0]
    names = set(getattr(item, "fixturenames", ()))
    if names & SYSTEM_FIXTURES:
        return "system"
    if names & DATABASE_FIXTURES:
        return "integration"
    return "unit"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _group_for_xdist(config, items)
    for item in items:
        tier = _tier(item)
        if item.path.is_relative_to(UNIT_DIR) and tier != "unit":
            raise pytest.UsageError(f"{item.nodeid} is under tests/unit/ but needs the {tier} tier")
        item.add_marker(tier)
        item.stash[_TIER] = tier
        in_compat = tier == "unit" or item.path.stem in COMPAT_MODULES
        if in_compat and item.get_closest_marker("not_compat") is None:
            item.add_marker("compat")


def _group_for_xdist(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Send the tests marked ``xdist_group(name)`` to one test process, as ``--dist
    loadgroup`` promises. The scheduler reads the group from a ``@name`` suffix of the
    test's id, which pytest-xdist (3.8) writes to ``item._nodeid``; pytest 9 keeps the id
    in ``item._id`` instead, so xdist's suffix is lost there, and this adds it."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        marks = item.iter_markers("xdist_group")
        names = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks}
        if not names or "@" in item.nodeid:
            continue
        grouped = f"{item.nodeid}@{'_'.join(sorted(names))}"
        if hasattr(item, "_id"):  # pytest 9
            from _pytest.nodeid import coerce_node_id

            item._id = coerce_node_id(grouped)
        else:  # pytest 8, where xdist's own suffix holds: not reached
            vars(item)["_nodeid"] = grouped


_TIER = pytest.StashKey[str]()


def _refuse(what: str, tier: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        needed = "integration" if what == "a database connection" else "system"
        raise AssertionError(f"a {tier} test opened {what}: mark it @pytest.mark.{needed}")

    return refuse


def _postgresql_refused(method: Any, tier: str) -> Any:
    refuse = _refuse("a database connection", tier)

    def guarded(engine: Engine, *args: Any, **kwargs: Any) -> Any:
        if engine.dialect.name == "postgresql":
            refuse()
        return method(engine, *args, **kwargs)

    return guarded


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """Hold each test to its tier while it runs (its session fixtures are already up)."""
    tier = item.stash.get(_TIER, "system")
    with pytest.MonkeyPatch.context() as patch:
        if tier != "system":
            patch.setattr(subprocess.Popen, "_execute_child", _refuse("an OS process", tier))
            patch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("an OS process", tier))
        if tier == "unit":
            patch.setattr(psycopg.Connection, "connect", classmethod(_refuse("a database connection", tier)))
            patch.setattr(psycopg.AsyncConnection, "connect", classmethod(_refuse("a database connection", tier)))
            for method in ("connect", "raw_connection"):  # SQLite in memory stays a unit test's
                patch.setattr(Engine, method, _postgresql_refused(getattr(Engine, method), tier))
        return (yield)


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


#: Rows deleted since the shared tables were last truncated; past this many, the next
#: test truncates them again, so dead rows (this server may run without autovacuum) never
#: pile up under the statements a test measures or explains.
DEAD_ROWS_BEFORE_TRUNCATE = 20_000
_deleted_since_truncate = 0


def _empty_tables(engine: Engine) -> None:
    """Empty the shared tables and restart their ids, as ``TRUNCATE … RESTART IDENTITY``.

    A ``DELETE`` of the few rows a test leaves costs a few milliseconds; a ``TRUNCATE`` of
    twenty tables makes new files for each table and index and costs 0.1-0.6 s, which
    before every test was a quarter of the suite's time.
    """
    global _deleted_since_truncate
    tables = models.all_tables()
    with engine.begin() as conn:
        if _deleted_since_truncate > DEAD_ROWS_BEFORE_TRUNCATE:
            names = ", ".join(f'"{t.name}"' for t in tables)
            conn.execute(text(f"TRUNCATE {names} RESTART IDENTITY CASCADE"))
            _deleted_since_truncate = 0
            return
        for table in reversed(tables):
            _deleted_since_truncate += conn.execute(table.delete()).rowcount
        conn.execute(text(_RESTART_SEQUENCES), {"tables": [t.name for t in tables]})


#: Every sequence owned by a column of the shared tables, back to its start.
_RESTART_SEQUENCES = """
SELECT setval(s.seqrelid, s.seqstart, false)
FROM pg_sequence s
JOIN pg_depend d ON d.objid = s.seqrelid AND d.classid = 'pg_class'::regclass AND d.deptype IN ('a', 'i')
JOIN pg_class t ON t.oid = d.refobjid
JOIN pg_namespace n ON n.oid = t.relnamespace
WHERE n.nspname = current_schema() AND t.relname = ANY(:tables)
"""


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
