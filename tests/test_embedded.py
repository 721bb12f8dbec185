"""The embedded server: a restart keeps it under our control, and nothing outlives stop()."""

from __future__ import annotations

from pathlib import Path

import psutil
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from sqla_queue.embedded import EmbeddedPostgres


def servers_of(data_dir: Path) -> list[int]:
    """Live (not zombie) processes of a PostgreSQL server whose command line names ``data_dir``."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "status"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if str(data_dir.resolve()) in (proc.info["cmdline"] or []):
            found.append(proc.pid)
    return found


def backend_start(url: object) -> object:
    engine = create_engine(url, poolclass=NullPool)  # type: ignore[call-overload]
    try:
        with engine.connect() as conn:
            return conn.scalar(text("SELECT pg_postmaster_start_time()"))
    finally:
        engine.dispose()


def test_restart_then_stop_leaves_no_server_running() -> None:
    pg = EmbeddedPostgres().start()
    try:
        data_dir = pg.data_dir
        url = pg.url
        first = servers_of(data_dir)
        assert first, "the server should be running"
        started = backend_start(url)

        pg.restart()

        assert pg.url == url  # same socket: clients reconnect to the same address
        assert backend_start(url) != started  # a new postmaster answers there
        assert servers_of(data_dir) and not set(first) & set(servers_of(data_dir))
    finally:
        pg.stop()
    assert servers_of(data_dir) == []
    assert not data_dir.exists()


def test_stop_is_idempotent_and_context_manager_cleans_up() -> None:
    with EmbeddedPostgres() as pg:
        data_dir = pg.data_dir
        assert servers_of(data_dir)
    assert servers_of(data_dir) == []
    pg.stop()
    assert servers_of(data_dir) == []
