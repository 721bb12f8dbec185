"""Through a real PgBouncer in transaction pooling mode, with the settings docs/guides/pgbouncer.md gives.

Behind transaction pooling, consecutive transactions of one client may run on different
server connections and one server connection serves many clients, so psycopg's automatic
prepared statements collide; ``prepare_threshold=None`` turns them off, and LISTEN (a
session feature) is replaced by polling (``listen=False``).
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import socket
import subprocess
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import URL, Engine, create_engine, func, select
from sqlalchemy.orm import Session, sessionmaker

from sqla_queue import QueueSession, Worker

from .helpers import Server, wait_for
from .models import Effect, Task

pytestmark = pytest.mark.system

#: Fewer server connections than clients: each is shared, as in production.
POOL_SIZE = 3


@dataclass
class Bouncer:
    url: URL  # the test database, through PgBouncer
    single_url: URL  # the same, through a pool of one server connection

    def engine(self, **options: Any) -> Engine:
        return create_engine(self.url, connect_args={"prepare_threshold": None}, **options)


def _pgbouncer_binary() -> str | None:
    return shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.path.exists(p)), None
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def bouncer(server: Server, tmp_path: Path) -> Iterator[Bouncer]:
    """PgBouncer on a free port in front of the suite's database; stopped at teardown."""
    binary = _pgbouncer_binary()
    if binary is None:
        pytest.skip("pgbouncer is not installed (Debian: apt-get install pgbouncer)")
    version_text = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False).stdout
    version = tuple(int(n) for n in re.findall(r"(\d+)\.(\d+)", version_text)[0])

    url = server.url
    host = url.host or str(url.query.get("host", "/tmp"))
    user = url.username or "postgres"
    target = f"host={host} port={url.port or 5432} dbname={url.database} user={user}"
    if url.password:
        target += f" password={url.password}"
    port = _free_port()
    (tmp_path / "userlist.txt").write_text(f'"{user}" ""\n')
    settings = [
        "[databases]",
        f"sqla_queue_pooled = {target}",
        f"sqla_queue_single = {target} pool_size=1",
        "[pgbouncer]",
        "listen_addr = 127.0.0.1",
        f"listen_port = {port}",
        "unix_socket_dir =",
        "auth_type = trust",
        f"auth_file = {tmp_path / 'userlist.txt'}",
        "pool_mode = transaction",
        f"default_pool_size = {POOL_SIZE}",
        "max_client_conn = 200",
        "ignore_startup_parameters = extra_float_digits",
    ]
    if version >= (1, 21):  # protocol-level prepared statements would hide the collision
        settings.append("max_prepared_statements = 0")
    ini = tmp_path / "pgbouncer.ini"
    ini.write_text("\n".join(settings) + "\n")

    command = [binary, str(ini)]
    if os.geteuid() == 0:  # PgBouncer refuses to run as root
        command[1:1] = ["-u", _unprivileged_user(host)]
    log_path = tmp_path / "pgbouncer.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    pooled = URL.create("postgresql+psycopg", username=user, host="127.0.0.1", port=port)
    try:
        try:
            wait_for(
                lambda: proc.poll() is not None or _accepts(pooled.set(database="sqla_queue_pooled")),
                timeout=20,
                what="pgbouncer to accept connections",
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}; its log:\n{log_path.read_text()}") from None
        assert proc.poll() is None, f"pgbouncer exited: {log_path.read_text()}"
        yield Bouncer(pooled.set(database="sqla_queue_pooled"), pooled.set(database="sqla_queue_single"))
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _unprivileged_user(host: str) -> str:
    """Who PgBouncer runs as: the owner of the server's socket directory (the embedded
    server's system user, the only one allowed in), else ``postgres`` or ``nobody``."""
    if host.startswith("/"):
        owner = pwd.getpwuid(os.stat(host).st_uid).pw_name
        if owner != "root":
            return owner
    return next(name for name in ("postgres", "nobody") if _user_exists(name))


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _conninfo(url: URL) -> str:
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def _accepts(url: URL) -> bool:
    try:
        psycopg.connect(_conninfo(url), connect_timeout=2).close()
    except psycopg.OperationalError:
        return False
    return True


def _ten_times(conn: psycopg.Connection[Any]) -> None:
    for n in range(10):
        assert conn.execute("SELECT %s::int", (n,)).fetchone() == (n,)


def test_automatic_prepared_statements_collide_without_the_setting(bouncer: Bouncer) -> None:
    """The control: this PgBouncer really shares server connections between clients."""
    single = _conninfo(bouncer.single_url)
    with psycopg.connect(single, autocommit=True) as a, psycopg.connect(single, autocommit=True) as b:
        _ten_times(a)  # prepared as _pg3_0 on the only server connection
        with pytest.raises(psycopg.errors.DuplicatePreparedStatement):
            _ten_times(b)  # b's own first prepared statement is named _pg3_0 too

    with (
        psycopg.connect(single, autocommit=True, prepare_threshold=None) as a,
        psycopg.connect(single, autocommit=True, prepare_threshold=None) as b,
    ):
        _ten_times(a)
        _ten_times(b)


def test_enqueue_and_workers_through_pgbouncer(
    bouncer: Bouncer, engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("WARNING", logger="sqla_queue")
    producer = bouncer.engine()
    engines = [bouncer.engine() for _ in range(3)]
    try:
        make_session = sessionmaker(producer, class_=QueueSession)
        for n in range(40):  # one job per transaction: the same INSERT again and again
            with make_session() as session:
                session.enqueue(Task(task="record", payload={"n": n}), queue="one")
                session.commit()
        with make_session() as session:
            rows = [{"task": "record", "payload": {"n": n}} for n in range(40, 240)]
            assert session.enqueue_many(Task, rows, queue="copied", method="copy", batch_size=50) == 200
            rows = [{"task": "record", "payload": {"n": n}} for n in range(240, 300)]
            assert session.enqueue_many(Task, rows, queue="inserted", method="insert") == 60
            session.commit()
        with engine.connect() as conn:
            assert conn.scalar(select(func.count()).select_from(Task).where(Task.status == "pending")) == 300

        runs: Counter[int] = Counter()
        lock = threading.Lock()

        def record(job: Task, session: Session) -> None:
            with lock:
                runs[job.id] += 1
            session.add(Effect(job_id=job.id, worker=threading.current_thread().name))

        workers = [Worker(e, Task, record, listen=False, poll_interval=0.05, concurrency=2) for e in engines]
        failures: list[BaseException] = []

        def run(worker: Worker) -> None:
            try:
                worker.run(until_idle=True, install_signal_handlers=False)
            except BaseException as exc:  # noqa: BLE001 - reported by the test thread
                failures.append(exc)

        threads = [threading.Thread(target=run, args=(w,)) for w in workers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
        assert not any(t.is_alive() for t in threads), "a worker did not finish"
        assert failures == []

        with engine.connect() as conn:
            statuses = dict(conn.execute(select(Task.status, func.count()).group_by(Task.status)).all())
            effects = Counter(conn.scalars(select(Effect.job_id)).all())
            job_ids = set(conn.scalars(select(Task.id)).all())
        assert statuses == {"done": 300}
        assert set(runs) == job_ids and set(runs.values()) == {1}  # each job ran exactly once
        assert set(effects) == job_ids and set(effects.values()) == {1}  # and committed once
        problems = [r.getMessage() for r in caplog.records if r.name.startswith("sqla_queue") and r.levelno >= 30]
        assert problems == []  # no statement failed and was retried behind our back
    finally:
        producer.dispose()
        for e in engines:
            e.dispose()
