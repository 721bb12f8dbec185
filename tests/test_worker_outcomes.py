"""How a handler's run is classified and recorded: whose connection was lost, and a
completion whose answer was lost with its connection.

Both runtimes (the ``runtime`` fixture). Real PostgreSQL throughout: connections are cut
by ``pg_terminate_backend`` (only backends of this test's ``application_name``) or by a
small TCP proxy of the test's own between the worker and the server.
"""

from __future__ import annotations

import itertools
import re
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import URL, Engine, text
from sqlalchemy.orm import Session

from sqla_queue import Backoff, Tasks
from sqla_queue.model import DEFAULT_MAX_ATTEMPTS
from sqla_queue.runtime import sleep

from .helpers import Server, wait_for, wait_for_counts
from .models import Effect, Task
from .workers import FAST, TASKS, add, effects, engine_with, job

#: A backoff whose lower bound a test can see: every retry waits at least LOW seconds.
LOW = 0.5
SEEN_BACKOFF = Backoff(base=LOW, factor=1.0, cap=LOW, jitter=0)
#: Losses of the worker's connection in a row under one job that are handed back for free
#: (docs/guides/workers.md, What a worker does: Failures).
FREE_HAND_BACKS = 2
#: A backoff no test waits for: a retry within seconds did not go through it.
MINUTE = Backoff(base=60, factor=2, cap=600, jitter=0)


class Runs:
    """Every run of a handler: (job id, attempt, wall time at start, the job's run_after)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.all: list[tuple[int, int, float, float]] = []

    def __call__(self, job: Any) -> int:
        with self.lock:
            self.all.append((job.id, job.attempts, time.time(), job.run_after.timestamp()))
            return sum(1 for r in self.all if r[0] == job.id)

    def of(self, job_id: int) -> list[tuple[int, float, float]]:
        with self.lock:
            return [(a, at, due) for i, a, at, due in self.all if i == job_id]


def _unique(what: str) -> str:
    return f"sqla_queue_outcomes_{what}_{uuid.uuid4().hex[:8]}"


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A local TCP port that refuses connections: bound, never listening (so nothing
    else can take it meanwhile)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


# -- a handler's own connection errors get the backoff ------------------------------------


def _raise_upstream_error(kind: str, port: int, conninfo: str) -> None:
    """What a handler sees when an upstream of its own is down."""
    if kind == "refused_socket":
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # ConnectionRefusedError
    elif kind == "connection_error":
        raise ConnectionError("webhook endpoint timed out")
    elif kind == "psycopg_refused":
        psycopg.connect(f"host=127.0.0.1 port={port} dbname=upstream connect_timeout=5").close()
    elif kind == "psycopg_terminated":
        with psycopg.connect(conninfo, autocommit=True) as other:  # another database, say
            other.execute("SELECT pg_terminate_backend(pg_backend_pid())")
    raise AssertionError(f"{kind}: no error was raised")


@pytest.mark.parametrize("kind", ["refused_socket", "connection_error", "psycopg_refused", "psycopg_terminated"])
def test_a_plain_handler_whose_upstream_is_down_gets_the_backoff(
    engine: Engine, Sessions: Any, server: Server, start_worker: Any, closed_port: int, kind: str
) -> None:
    """A ``ConnectionError`` or ``psycopg.OperationalError`` of the handler's own is the
    job's failure: each attempt counts and waits the backoff (the job's ``run_after``
    moves by at least its lower bound), however fast the handler fails."""
    runs = Runs()
    tasks = Tasks()

    @tasks.task
    def upstream(job: Any) -> None:
        runs(job)
        _raise_upstream_error(kind, closed_port, server.conninfo)

    worker = start_worker(tasks, backoff=SEEN_BACKOFF)
    (job_id,) = add(Sessions, "upstream", max_attempts=3)
    wait_for(lambda: job(engine, job_id).status == "failed", timeout=30, what="the dead letter")
    seen = runs.of(job_id)
    assert [a for a, _, _ in seen] == [1, 2, 3]
    for (_, began, due), (_, next_began, next_due) in itertools.pairwise(seen):
        assert next_due - due >= LOW - 0.01, f"run_after moved {next_due - due:.3f}s, backoff {LOW}s"
        assert next_began - began >= LOW - 0.01, f"retried {next_began - began:.3f}s later, backoff {LOW}s"
    row = job(engine, job_id)
    assert row.attempts == 3 and not row.last_error.startswith("connection lost"), row.last_error
    wait_for_counts(worker, retried=2, failed=1, released=0)


# -- the worker's own connection lost under a transactional handler ------------------------


def _terminate(engine: Engine, pid: int, app: str) -> int:
    """Terminate backend ``pid`` if it is one of this test's (``application_name`` ``app``)."""
    with engine.connect() as conn:
        killed = conn.scalar(
            text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE pid = :pid AND application_name = :app AND datname = current_database()"
            ),
            {"pid": pid, "app": app},
        )
        conn.commit()
    return int(killed or 0)


def test_a_transactional_handler_whose_connection_is_terminated_is_handed_back_at_once(
    engine: Engine, Sessions: Any, server: Server, make_worker: Any
) -> None:
    """The backend under the handler's session is terminated from outside while the
    handler runs: not the job's fault. The job is handed back at once (the backoff is a
    minute) without counting the attempt, runs again under a new attempt number (a
    fencing token names one claim), and commits its effect once."""
    app = _unique("terminated")
    worker_engine = engine_with(server.url, application_name=app)
    runs = Runs()
    backend: list[int] = []
    cut = threading.Event()
    tasks = Tasks()

    @tasks.task
    def cut_off(job: Any, session: Session) -> None:
        if runs(job) == 1:
            backend.append(session.execute(text("SELECT pg_backend_pid()")).scalar_one())
            while not cut.is_set():
                sleep(0.01)
            session.execute(text("SELECT 1"))  # the connection is gone: raises
        session.add(Effect(job_id=job.id, worker="w", note=f"attempt {job.attempts}"))

    worker = make_worker(worker_engine, Task, tasks, backoff=MINUTE, poll_interval=0.5)
    worker.start()
    try:
        (job_id,) = add(Sessions, "cut_off")
        wait_for(lambda: backend, what="the handler's backend")
        assert _terminate(engine, backend[0], app) == 1
        cut.set()
        wait_for(lambda: job(engine, job_id).status == "done", timeout=30, what="the job done")
        seen = runs.of(job_id)
        assert [a for a, _, _ in seen] == [1, 2], "a claim's attempt number was handed out again"
        assert seen[1][1] - seen[0][1] < 1.0 + 0.5, f"handed back after {seen[1][1] - seen[0][1]:.2f}s"
        row = job(engine, job_id)
        # Not counted: the attempts max_attempts allows grew by the one given back.
        assert (row.attempts, row.max_attempts) == (2, DEFAULT_MAX_ATTEMPTS + 1)
        assert Counter(e.job_id for e in effects(engine)) == Counter({job_id: 1})
        assert (worker.stats.released, worker.stats.retried, worker.stats.failed, worker.stats.lost) == (1, 0, 0, 0)
    finally:
        cut.set()
        worker.stop(grace=1)
        worker_engine.dispose()


def test_a_handler_that_kills_its_own_connection_every_time_ends_dead_lettered_with_backoff(
    engine: Engine, Sessions: Any, start_worker: Any
) -> None:
    """``pg_terminate_backend(pg_backend_pid())`` through its session, on every run: the
    first FREE_HAND_BACKS losses in a row are handed back without counting; from then on
    each spends an attempt and waits the backoff, and the job ends ``failed``, saying
    why. Every run has an attempt number of its own."""
    runs = Runs()
    tasks = Tasks()

    @tasks.task
    def suicide(job: Any, session: Session) -> None:
        runs(job)
        session.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))

    worker = start_worker(tasks, backoff=SEEN_BACKOFF)
    (job_id,) = add(Sessions, "suicide", max_attempts=3)
    wait_for(lambda: job(engine, job_id).status == "failed", timeout=30, what="the dead letter")
    seen = runs.of(job_id)
    total = FREE_HAND_BACKS + 3
    assert [a for a, _, _ in seen] == list(range(1, total + 1))
    spent = seen[FREE_HAND_BACKS:]
    for (_, began, _), (_, next_began, _) in itertools.pairwise(spent):
        assert next_began - began >= LOW - 0.01, f"retried {next_began - began:.3f}s later, backoff {LOW}s"
    row = job(engine, job_id)
    assert (row.attempts, row.max_attempts) == (total, total)
    assert row.last_error.startswith(f"connection lost ({total} in a row under this job; attempt counted)"), (
        row.last_error)
    assert (worker.stats.released, worker.stats.retried, worker.stats.failed) == (FREE_HAND_BACKS, 2, 1)


def test_the_losses_in_a_row_are_read_from_the_row_so_they_hold_across_workers(
    engine: Engine, Sessions: Any, start_worker: Any
) -> None:
    """The row says its job's runs already lost their connection FREE_HAND_BACKS times in
    a row (under other workers, or before a restart): a fresh worker counts on from
    there, so the next loss spends an attempt instead of starting a new free streak."""
    runs = Runs()
    tasks = Tasks()

    @tasks.task
    def cut_once(job: Any, session: Session) -> None:
        if runs(job) == 1:
            session.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))

    (job_id,) = add(Sessions, "cut_once", max_attempts=3)
    earlier = f"connection lost ({FREE_HAND_BACKS} in a row under this job; handed back, attempt not counted): x"
    with engine.begin() as conn:
        conn.execute(TASKS.update().where(TASKS.c.id == job_id).values(last_error=earlier))
    worker = start_worker(tasks, backoff=FAST)
    wait_for(lambda: job(engine, job_id).status == "done", timeout=30, what="the job done")
    assert [a for a, _, _ in runs.of(job_id)] == [1, 2]
    row = job(engine, job_id)
    assert (row.attempts, row.max_attempts) == (2, 3), "the loss was not counted"
    assert (worker.stats.released, worker.stats.retried, worker.stats.done) == (0, 1, 1)


# -- a completion whose answer was lost ------------------------------------------------------

#: ReadyForQuery at the end of what the server sent: the statement ran and committed.
_READY = re.compile(rb"Z\x00\x00\x00\x05[ITE]\Z")


class AnswerDroppingProxy:
    """A TCP proxy to the test server. Armed, it forwards the next statement whose text
    contains ``marker``, withholds the server's whole answer to it (up to ReadyForQuery,
    so the statement has committed) and then drops that client's connection."""

    def __init__(self, url: URL, marker: bytes) -> None:
        self.url = url
        self.marker = marker
        self.armed = threading.Event()
        self.fired = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._closed = False
        self._threads = [threading.Thread(target=self._accept, daemon=True, name="test-proxy")]
        self._threads[0].start()

    def _upstream(self) -> socket.socket:
        host = self.url.host or self.url.query.get("host")
        assert isinstance(host, str)
        port = self.url.port or 5432
        if host.startswith("/"):
            sock = socket.socket(socket.AF_UNIX)
            sock.connect(f"{host}/.s.PGSQL.{port}")
            return sock
        return socket.create_connection((host, port))

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = self._upstream()
            self._sockets += [client, upstream]
            doomed: list[bool] = []
            for target in (self._forward_up, self._forward_down):
                thread = threading.Thread(target=target, args=(client, upstream, doomed), daemon=True)
                self._threads.append(thread)
                thread.start()

    def _forward_up(self, client: socket.socket, upstream: socket.socket, doomed: list[bool]) -> None:
        try:
            while data := client.recv(65536):
                if self.armed.is_set() and self.marker in data:
                    self.armed.clear()
                    doomed.append(True)
                upstream.sendall(data)
        except OSError:
            pass
        _close(upstream)

    def _forward_down(self, client: socket.socket, upstream: socket.socket, doomed: list[bool]) -> None:
        withheld = b""
        try:
            while data := upstream.recv(65536):
                if not doomed:
                    client.sendall(data)
                    continue
                withheld += data
                if _READY.search(withheld):
                    self.fired.set()
                    break
        except OSError:
            pass
        _close(client)
        _close(upstream)

    def url_through(self) -> URL:
        return self.url.set(host="127.0.0.1", port=self.port, query={})

    def close(self) -> None:
        self._closed = True
        _close(self._listener)
        for sock in self._sockets:
            _close(sock)
        for thread in self._threads:
            thread.join(5)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


@pytest.fixture
def proxy_for(server: Server) -> Iterator[Callable[[bytes], AnswerDroppingProxy]]:
    made: list[AnswerDroppingProxy] = []

    def make(marker: bytes) -> AnswerDroppingProxy:
        proxy = AnswerDroppingProxy(server.url, marker)
        made.append(proxy)
        return proxy

    yield make
    for proxy in made:
        proxy.close()


@pytest.mark.parametrize(
    ("outcome", "marker", "status"),
    [
        ("done", b"'done'", "done"),  # the completion (with the next claim, or alone)
        ("retry", b"tokens.sqla_queue_delays", "pending"),  # a failed attempt's retry
    ],
)
def test_an_outcome_whose_answer_was_lost_is_counted_as_recorded_not_lost(
    engine: Engine, Sessions: Any, make_worker: Any, proxy_for: Callable[[bytes], AnswerDroppingProxy],
    outcome: str, marker: bytes, status: str,
) -> None:
    """The statement recording an outcome commits, but its answer never reaches the
    worker: the connection drops first. The worker retries it on a new connection,
    which moves nothing (the job is already recorded); it must recognise its own earlier
    success and count the job ``done`` (or ``retried``), not ``lost``."""
    proxy = proxy_for(marker)
    # No prepared statements: every execution carries its text, which the proxy looks for.
    worker_engine = engine_with(proxy.url_through(), sslmode="disable", prepare_threshold=None)
    entered, release = threading.Event(), threading.Event()
    tasks = Tasks()

    @tasks.task
    def held_up(job: Any) -> None:
        entered.set()
        while not release.is_set():
            sleep(0.01)
        if outcome == "retry":
            raise RuntimeError("this attempt fails")

    worker = make_worker(worker_engine, Task, tasks, backoff=MINUTE, concurrency=1, poll_interval=0.5,
                         sweep_interval=0.2)
    worker.start()
    try:
        (job_id,) = add(Sessions, "held_up")
        wait_for(entered.is_set, what="the handler to start")
        proxy.armed.set()
        release.set()
        wait_for(proxy.fired.is_set, what="the proxy to drop an answer")
        wait_for(lambda: job(engine, job_id).status == status, what=f"the job {status}")
        wait_for(lambda: not worker.held(), what="the worker to settle the job")
        stats = worker.stats
        if outcome == "done":
            assert (stats.done, stats.lost) == (1, 0), stats
        else:
            assert (stats.retried, stats.lost) == (1, 0), stats
    finally:
        release.set()
        worker.stop(grace=1)
        worker_engine.dispose()
