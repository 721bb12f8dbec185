"""A PostgreSQL primary and a streaming standby of a test's own, for failover tests.

:class:`Pair` creates both on free ports in a temporary directory (``initdb``, then
``pg_basebackup -R`` of the running primary), with synchronous replication, and can crash
the primary (``pg_ctl stop -m immediate``) and promote the standby. The standby streams
through a :class:`~tests.proxy.Proxy`, so a test can hold replication back
(:meth:`Pair.freeze_replication`): the primary's commits then wait for the standby, as on
a slow or broken link. :meth:`Pair.close` stops every server it started and removes the
directory, whatever state they are in.

PostgreSQL refuses to run as root: when the tests run as root (CI does), the servers run
as the ``postgres`` system user (``runuser``), in a directory that user owns.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

import psycopg

from .helpers import wait_for
from .proxy import Proxy


def _version(bin_dir: str) -> tuple[int, ...]:
    name = Path(bin_dir).parent.name
    return tuple(int(part) for part in name.split(".")) if name.replace(".", "").isdigit() else ()


#: Where Debian and Ubuntu install the server binaries, newest version first.
_BIN_DIRS = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version, reverse=True)


def find_bin_dir() -> Path | None:
    """A directory holding ``initdb``, ``pg_ctl`` and ``pg_basebackup`` (``PG_BIN_DIR``
    if set), or None when ``pg_basebackup`` is not installed."""
    wanted = ("initdb", "pg_ctl", "pg_basebackup")
    candidates = [os.environ["PG_BIN_DIR"]] if os.environ.get("PG_BIN_DIR") else _BIN_DIRS
    for directory in candidates:
        if all((Path(directory) / name).is_file() for name in wanted):
            return Path(directory)
    found = shutil.which("pg_basebackup")
    if found and all(shutil.which(name) for name in wanted):
        return Path(found).parent
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Server:
    """One server of the pair: its data directory and port."""

    def __init__(self, pair: Pair, name: str) -> None:
        self.pair = pair
        self.name = name
        self.data = pair.root / name
        self.port = free_port()
        self.log = pair.root / f"{name}.log"
        self.started = False

    @property
    def conninfo(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=test connect_timeout=5"

    def configure(self, **settings: str) -> None:
        """Append settings to ``postgresql.conf`` (later lines win)."""
        lines = "".join(f"{key} = '{value}'\n" for key, value in settings.items())
        self.pair.run("sh", "-c", f"cat >> {self.data}/postgresql.conf", stdin=lines)

    def start(self) -> None:
        self.started = True
        self.pair.run(self.pair.bin("pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "start")

    def stop(self, mode: str = "fast") -> None:
        if not self.started:
            return
        self.pair.run(self.pair.bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "30", "stop")
        self.started = False

    def kill(self) -> None:
        """Whatever it takes to leave no process of this server behind."""
        if not self.started:
            return
        with contextlib.suppress(Exception):
            self.stop("immediate")
        pid_file = self.data / "postmaster.pid"
        with contextlib.suppress(Exception):
            pid = int(pid_file.read_text().splitlines()[0])
            os.kill(pid, signal.SIGKILL)
        self.started = False


class Pair:
    """A primary and its synchronous standby (``pg_basebackup -R``), on free ports."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin_dir = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="sqla_queue_failover_"))
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
        self.primary = Server(self, "primary")
        self.standby = Server(self, "standby")
        self.replication: Proxy | None = None

    def bin(self, name: str) -> str:
        return str(self.bin_dir / name)

    def run(self, *cmd: str, stdin: str | None = None) -> None:
        """Run ``cmd`` as the user the servers run as; its output goes into the error."""
        full = ["runuser", "-u", "postgres", "--", *cmd] if self._as_postgres else list(cmd)
        done = subprocess.run(full, input=stdin, capture_output=True, text=True, timeout=120, cwd=self.root)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stdout}{done.stderr}")

    def start(self) -> Pair:
        """Primary up with database ``test``, standby streaming from it synchronously."""
        primary, standby = self.primary, self.standby
        self.run(self.bin("initdb"), "-D", str(primary.data), "-U", "postgres", "--auth=trust",
                 "-E", "UTF8", "--no-sync", "--no-instructions")
        primary.configure(
            port=str(primary.port), listen_addresses="127.0.0.1", unix_socket_directories=str(self.root),
            wal_level="replica", max_wal_senders="4", hot_standby="on", synchronous_commit="on",
        )
        primary.start()
        with psycopg.connect(primary.conninfo.replace("dbname=test", "dbname=postgres"), autocommit=True) as conn:
            conn.execute("CREATE DATABASE test")
        # The standby's primary_conninfo (written by -R) names the proxy.
        self.replication = Proxy(("127.0.0.1", primary.port), markers={})
        self.run(self.bin("pg_basebackup"), "-h", "127.0.0.1", "-p", str(self.replication.port), "-U", "postgres",
                 "-D", str(standby.data), "-R", "-X", "stream", "-c", "fast", "--no-sync")
        standby.configure(port=str(standby.port), cluster_name="standby")
        standby.start()
        with psycopg.connect(primary.conninfo, autocommit=True) as conn:
            # From now on a commit waits until the standby has flushed its WAL: none
            # acknowledged can be missing from it after a promotion. (Set on the primary
            # alone: the promoted standby has no standby of its own to wait for.)
            conn.execute("ALTER SYSTEM SET synchronous_standby_names = 'standby'")
            conn.execute("SELECT pg_reload_conf()")
            query = "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'"
            wait_for(lambda: conn.execute(query).fetchone() == (1,), timeout=30, what="a synchronous standby")
        return self

    def url(self) -> str:
        """Both servers in one URL; libpq picks the one that accepts writes."""
        return (
            f"postgresql+psycopg://postgres@/test?host=127.0.0.1:{self.primary.port}"
            f"&host=127.0.0.1:{self.standby.port}&target_session_attrs=read-write&connect_timeout=5"
        )

    def freeze_replication(self) -> None:
        """Nothing more reaches the standby; commits on the primary wait for it."""
        assert self.replication is not None
        self.replication.freeze(lambda link: True)

    def replication_links(self) -> list[str]:
        """The proxy's connections, for a failure's message: open or closed, frozen or not."""
        if self.replication is None:
            return []
        return [
            f"{'closed' if link.closed else 'open'}{' frozen' if link.frozen else ''}"
            for link in self.replication.links
        ]

    def cut_replication(self) -> None:
        """The replication link is gone for good (the standby keeps what it received)."""
        if self.replication is not None:
            self.replication.close()

    def crash_primary(self) -> None:
        """The primary stops as if it crashed: no shutdown checkpoint, clients cut off."""
        self.primary.stop("immediate")

    def promote_standby(self) -> None:
        """Promote the standby and wait until it accepts writes."""
        self.run(self.bin("pg_ctl"), "-D", str(self.standby.data), "-w", "-t", "60", "promote")

    def close(self) -> None:
        self.standby.kill()
        self.primary.kill()
        self.cut_replication()
        shutil.rmtree(self.root, ignore_errors=True)
