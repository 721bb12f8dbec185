"""Small helpers for tests: the server under test and polls with deadlines."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from sqlalchemy import URL, Table, create_engine
from sqlalchemy.pool import NullPool

from sqla_queue.embedded import EmbeddedPostgres

T = TypeVar("T")


@dataclass
class Server:
    url: URL
    admin_url: URL
    embedded: EmbeddedPostgres | None

    @property
    def conninfo(self) -> str:
        """The URL as libpq conninfo, for raw psycopg connections."""
        return self.url.set(drivername="postgresql").render_as_string(hide_password=False)

    def restart(self) -> None:
        """Restart the server: only ever one this test run started itself.

        A server named by ``DATABASE_URL`` may be shared with other people and programs, so
        the suite never restarts it; tests that need a restart use the ``private_server``
        fixture, an embedded server of their own.
        """
        if self.embedded is None:
            raise RuntimeError("refusing to restart a server this test run did not start")
        self.embedded.restart()


class ConnectLag:
    """How long a new connection and one committed write take right now, sampled every
    0.05 s on a thread while a block runs: the same-run measure of how loaded the machine
    is (CPU, and the disk a commit waits for).

    A test that bounds how soon a worker reconnects allows this on top of its bound: a
    worker cannot reconnect and commit faster than the server lets anyone, and on a
    machine shared with another test suite that is now and then seconds, not milliseconds.
    """

    def __init__(self, url: URL) -> None:
        self._engine = create_engine(url, poolclass=NullPool)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="connect-lag", daemon=True)
        #: The longest sample so far, in seconds.
        self.worst = 0.0

    def _sample(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                with self._engine.connect() as conn:
                    conn.exec_driver_sql("SELECT txid_current()")  # a transaction id: its commit is flushed
                    conn.commit()
            except Exception:  # noqa: BLE001 - a failed sample took as long as it took
                pass
            self.worst = max(self.worst, time.monotonic() - began)
            self._stop.wait(0.05)

    def __enter__(self) -> ConnectLag:
        self._thread.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(30)
        self._engine.dispose()


def table_of(model: Any) -> Table:
    """A model's ``Table``, typed as one (declarative types ``__table__`` as a FromClause)."""
    table = model.__table__
    assert isinstance(table, Table)
    return table


def wait_for(
    predicate: Callable[[], T], *, timeout: float = 20.0, interval: float = 0.02, what: str = ""
) -> T:
    """Poll ``predicate`` until it returns something truthy, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


def wait_for_counts(worker: Any, *, timeout: float = 20.0, **expected: int) -> None:
    """Wait until ``worker.stats`` holds ``expected`` (``done=3``, ...), or fail showing them.

    A worker counts an outcome once its COMMIT returns, a moment after the row is visible
    to other connections: a test that waited for the rows waits for the counts too.
    """
    try:
        wait_for(
            lambda: all(getattr(worker.stats, name) == value for name, value in expected.items()),
            timeout=timeout,
            what=f"the worker's counts {expected}",
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}; stats: {worker.stats}") from None


def notifications(conn: Any, timeout: float) -> list[tuple[str, str]]:
    """Every notification ``conn`` receives within ``timeout`` seconds."""
    return [(n.channel, n.payload) for n in conn.notifies(timeout=timeout)]


SENTINEL_CHANNEL = "sqla_queue_test_sentinel"


def notifications_until_sentinel(listen_conn: Any, conninfo: str, timeout: float = 10.0) -> list[tuple[str, str]]:
    """Notifications delivered to ``listen_conn`` before a sentinel sent now.

    PostgreSQL delivers notifications in commit order, so whatever an earlier commit sent
    arrives before the sentinel: no fixed wait is needed to prove that nothing came.
    ``listen_conn`` must already LISTEN on :data:`SENTINEL_CHANNEL`.
    """
    import uuid

    import psycopg

    token = uuid.uuid4().hex
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("SELECT pg_notify(%s, %s)", (SENTINEL_CHANNEL, token))
    received: list[tuple[str, str]] = []
    for note in listen_conn.notifies(timeout=timeout):
        if note.channel == SENTINEL_CHANNEL and note.payload == token:
            return received
        received.append((note.channel, note.payload))
    raise AssertionError(f"sentinel not received within {timeout}s; got {received}")


class WorkerProcess:
    """``sqla-queue worker TARGET`` (by default ``tests.worker_app:make_worker``) in a
    process of its own: ``python -m sqla_queue.cli worker TARGET ARGS``, started in
    milliseconds by ``tests/console.py`` (a fresh interpreter would spend a second on its
    imports first, and the system tests start a few hundred workers). ``proc`` has the
    parts of :class:`subprocess.Popen` the tests use."""

    def __init__(
        self,
        *args: str,
        app_name: str = "sqla_queue_worker",
        log_dir: Any,
        url: str | None = None,
        target: str = "tests.worker_app:make_worker",
        runtime: str = "thread",
    ) -> None:
        import os
        import sys
        from pathlib import Path

        from . import console

        self.log_path = Path(log_dir) / f"worker-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "SQLA_QUEUE_APP_NAME": app_name, "PYTHONUNBUFFERED": "1",
               "SQLA_QUEUE_TEST_RUNTIME": runtime}
        if url is not None:  # another database than the run's own (a private server)
            env["SQLA_QUEUE_TEST_URL"] = url
        repo = Path(__file__).resolve().parent.parent
        self.proc: console.Started = console.start(
            [sys.executable, "-m", "sqla_queue.cli", "worker", target, *args], repo, env, self.log_path
        )
        self.pid = self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_for_log(self, text: str, timeout: float = 20.0) -> None:
        wait_for(lambda: text in self.log(), timeout=timeout, what=f"{text!r} in the worker log")

    def signal(self, signum: int) -> None:
        import os

        os.kill(self.pid, signum)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def run_until_done(
    engine: Any, table: Table, ids: list[Any], processes: list[WorkerProcess],
    start: Callable[[], WorkerProcess], *, timeout: float,
) -> dict[int, float]:
    """Wait until every job of ``ids`` in ``table`` is done, starting a new worker
    process (``start()``) in place of any of ``processes`` that exits (a job killed it);
    the time (``time.time()``) each exited process was found dead, by pid."""
    from sqlalchemy import func, select

    deaths: dict[int, float] = {}
    began = time.monotonic()
    while True:
        with engine.connect() as conn:
            done = conn.scalar(select(func.count()).where(table.c.id.in_(ids), table.c.status == "done"))
        if done == len(ids):
            return deaths
        assert time.monotonic() - began < timeout, f"{done} of {len(ids)} done"
        for n, process in enumerate(processes):
            if process.proc.poll() is not None:
                deaths[process.pid] = time.time()
                processes[n] = start()
        time.sleep(0.1)  # the supervisor's pace, not a wait for anything


def terminate_backend(conninfo: str, pid: int) -> None:
    """End the server process ``pid`` (another connection's) and wait until it is gone,
    as when the server or the network drops that connection."""
    import psycopg

    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        wait_for(
            lambda: conn.execute("SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()[0],  # type: ignore[index]
            what=f"backend {pid} to end",
        )
