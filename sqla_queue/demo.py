"""The sqla_queue tour: ``python -m sqla_queue.demo``.

Needs nothing but the package: without ``DATABASE_URL`` it starts an embedded PostgreSQL
(the ``embedded`` extra) and removes it on exit, Ctrl-C included. It then

1. places orders the way a web app does (an order row and its confirmation job in one
   transaction), bulk-loads thousands of image jobs with COPY, and adds jobs that fail;
2. runs workers in this process (threads) and in another process, showing progress;
3. kills the other process mid-run with SIGKILL, so its jobs come back after their lease;
4. keeps placing orders one by one to measure pickup latency (commit to handler start);
5. ends with a summary: done, retried, dead-lettered, recovered, throughput, latency.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, String, create_engine, func, select, text
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from .enqueue.bulk import enqueue_many
from .enqueue.session import QueueSession
from .model import TaskMixin
from .retry import Backoff
from .task_functions import Tasks
from .urls import psycopg_url
from .worker import Worker

LEASE = 2.0
TRICKLE_ORDERS = 150


class Base(DeclarativeBase):
    pass


class DemoOrder(Base):
    """The business table: each order's confirmation job commits with it."""

    __tablename__ = "sqla_queue_demo_orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str] = mapped_column(String(100))
    total_cents: Mapped[int]
    #: How many times the confirmation committed; exactly once, whatever happens.
    confirmations: Mapped[int] = mapped_column(default=0)
    #: When a handler picked the confirmation job up (epoch seconds), for the latency.
    picked_at: Mapped[float | None]


class DemoTask(Base, TaskMixin):
    """The queue: one generic task table."""

    __tablename__ = "sqla_queue_demo_tasks"


tasks = Tasks()


@tasks.task
def confirm_order(job: DemoTask, session: Session) -> None:
    """Transactional: the order's confirmation commits with the job's completion."""
    picked = time.time()
    order = session.get(DemoOrder, job.payload["order_id"])
    assert order is not None
    order.confirmations += 1
    order.picked_at = order.picked_at or picked


@tasks.task
def resize_image(job: DemoTask) -> None:
    time.sleep(random.uniform(0, 0.002))  # pretend work


@tasks.task
def call_webhook(job: DemoTask) -> None:
    if job.attempts == 1 and job.payload["flaky"]:
        raise ConnectionError("webhook endpoint timed out")


@tasks.task
def email_bad_address(job: DemoTask) -> None:
    raise ValueError(f"mailbox {job.payload['to']} does not exist")


def make_worker(engine: Engine, concurrency: int = 4) -> Worker:
    return Worker(
        engine,
        DemoTask,
        tasks,
        concurrency=concurrency,
        batch_size=concurrency * 4,
        lease=LEASE,
        heartbeat_interval=LEASE / 4,
        sweep_interval=0.5,
        poll_interval=1.0,
        backoff=Backoff(base=0.2, factor=2, cap=1.0),
        shutdown_grace=2.0,
    )


# -- the tour ------------------------------------------------------------------------------


class Tour:
    def __init__(self, engine: Engine, url: str, jobs: int, out: Any) -> None:
        self.engine = engine
        self.url = url
        self.bulk_jobs = jobs
        self.out = out
        self.Sessions = sessionmaker(engine, class_=QueueSession)
        self.committed_at: dict[int, float] = {}
        self.total = 0
        self.other: subprocess.Popen[bytes] | None = None

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def place_order(self, customer: str) -> int:
        """What a web request does: the order and its confirmation job, one transaction."""
        with self.Sessions() as session:
            order = DemoOrder(customer=customer, total_cents=random.randint(500, 50_000))
            session.add(order)
            session.flush()
            session.enqueue(DemoTask(task="confirm_order", payload={"order_id": order.id}), priority=10)
            session.commit()
            self.committed_at[order.id] = time.time()
            return order.id

    def enqueue_everything(self) -> None:
        started = time.perf_counter()
        for n in range(200):
            self.place_order(f"customer-{n}")
        web = time.perf_counter() - started
        started = time.perf_counter()
        with self.Sessions() as session:
            rows = ({"task": "resize_image", "payload": {"image": f"img-{n}.jpg"}} for n in range(self.bulk_jobs))
            loaded = enqueue_many(session, DemoTask, rows, queue="images")
            session.commit()
        bulk = time.perf_counter() - started
        with self.Sessions() as session:
            for n in range(20):
                session.enqueue(DemoTask(task="call_webhook", payload={"flaky": n % 2 == 0}), queue="hooks")
            for n in range(5):
                session.enqueue(
                    DemoTask(task="email_bad_address", payload={"to": f"nobody{n}@invalid.example"}),
                    max_attempts=3,
                )
            session.commit()
        self.total = 200 + loaded + 25 + TRICKLE_ORDERS
        self.say(f"  200 orders placed, each with its job in one transaction ({web / 200 * 1000:.1f} ms each)")
        self.say(f"  {loaded:,} image jobs bulk-loaded with COPY in {bulk:.2f} s")
        self.say("  20 webhook jobs (half fail once) and 5 e-mails to bad addresses (always fail)")

    def start_other_process(self) -> None:
        env = {**os.environ, "SQLA_QUEUE_DEMO_URL": self.url}
        self.other = subprocess.Popen(
            [sys.executable, "-m", "sqla_queue.demo", "--worker-process"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def counts(self) -> dict[str, int]:
        """Finished jobs so far, by outcome."""
        t = DemoTask
        with self.engine.connect() as conn:
            row = conn.execute(
                select(
                    func.count().filter(t.status == "done"),
                    func.count().filter(t.status == "failed"),
                )
            ).one()
        return {"done": row[0], "failed": row[1]}

    def held_by(self, pid: int) -> int:
        """Jobs leased to the worker of process ``pid`` (owner names carry the pid)."""
        with self.engine.connect() as conn:
            return int(
                conn.scalar(
                    select(func.count()).where(
                        DemoTask.status == "running", DemoTask.lease_owner.like(f"%:{pid}:%")
                    )
                )
                or 0
            )

    def run(self) -> None:
        self.say("== enqueue")
        self.enqueue_everything()
        self.say("== process (4 threads here + 1 worker process)")
        worker = make_worker(self.engine)
        self.start_other_process()
        started = time.perf_counter()
        worker.start()
        trickle = threading.Thread(target=self.trickle, daemon=True)
        trickle.start()
        killed = False
        try:
            while True:
                c = self.counts()
                finished = c["done"] + c["failed"]
                self.progress(finished, c, time.perf_counter() - started)
                if not killed and finished >= self.total * 0.4 and self.other is not None:
                    self.other.send_signal(signal.SIGKILL)
                    self.other.wait()
                    killed = True
                    self.say(
                        f"\n  killed the worker process (pid {self.other.pid}) with SIGKILL; its "
                        f"{self.held_by(self.other.pid)} job(s) come back after their {LEASE:.0f} s lease"
                    )
                if finished >= self.total and not trickle.is_alive():
                    break
                time.sleep(0.2)
            elapsed = time.perf_counter() - started
        finally:
            worker.stop(grace=2)
        self.say()
        self.summary(elapsed, worker)

    def trickle(self) -> None:
        """Orders placed one by one while the workers run: the pickup latency sample."""
        for n in range(TRICKLE_ORDERS):
            self.place_order(f"late-customer-{n}")
            time.sleep(0.02)

    def progress(self, finished: int, c: dict[str, int], elapsed: float) -> None:
        width = 30
        filled = int(width * min(finished / max(self.total, 1), 1.0))
        line = (
            f"  [{'#' * filled}{'.' * (width - filled)}] {finished:,}/{self.total:,}"
            f"  dead-lettered {c['failed']}  {finished / max(elapsed, 1e-9):,.0f} jobs/s"
        )
        if self.out.isatty():
            print("\r" + line, end="", file=self.out, flush=True)
        elif int(elapsed * 5) % 5 == 0 or finished >= self.total:
            self.say(line)

    def summary(self, elapsed: float, worker: Worker) -> None:
        t = DemoTask
        with self.engine.connect() as conn:
            done, failed, retried, recovered = conn.execute(
                select(
                    func.count().filter(t.status == "done"),
                    func.count().filter(t.status == "failed"),
                    func.count().filter((t.status == "done") & (t.attempts > 1) & ~t.last_error.like("lease expired%")),
                    func.count().filter((t.status == "done") & t.last_error.like("lease expired%")),
                )
            ).one()
            twice = conn.scalar(select(func.count()).where(DemoOrder.confirmations > 1))
            unconfirmed = conn.scalar(select(func.count()).where(DemoOrder.confirmations == 0))
            picked = {row.id: row.picked_at for row in conn.execute(select(DemoOrder.id, DemoOrder.picked_at))}
            dead_reason = conn.scalar(select(t.last_error).where(t.status == "failed").limit(1)) or ""
        latencies = sorted(
            (at - committed) * 1000
            for i, committed in list(self.committed_at.items())[200:]
            if (at := picked.get(i)) is not None
        )
        self.say("== summary")
        dead_note = dead_reason.splitlines()[0].removeprefix("builtins.") if dead_reason else ""
        rows = [
            ("jobs", f"{self.total:,}", "orders, COPY-loaded images, webhooks, bad e-mails"),
            ("done", f"{done:,}", ""),
            ("retried, then done", f"{retried:,}", "webhooks whose endpoint was down once: retried after the backoff"),
            ("dead-lettered", f"{failed:,}", dead_note),
            ("recovered after the kill", f"{recovered:,}", "their lease expired; re-run alone, elsewhere"),
            ("orders confirmed twice", f"{twice}", f"{unconfirmed} unconfirmed; confirmations are transactional"),
            ("throughput", f"{done / elapsed:,.0f} jobs/s", f"{elapsed:.1f} s, 2 workers, one killed"),
        ]
        if latencies:
            q = statistics.quantiles(latencies, n=100, method="inclusive")
            rows.append(
                (
                    "pickup latency",
                    f"p50 {q[49]:.1f} ms",
                    (
                        f"p95 {q[94]:.1f} ms, p99 {q[98]:.1f} ms (commit to handler start, "
                        f"{len(latencies)} orders under load)"
                    ),
                )
            )
        width = max(len(r[0]) for r in rows)
        value = max(len(r[1]) for r in rows)
        for label, figure, note in rows:
            self.say(f"  {label:<{width}}  {figure:>{value}}  {note}".rstrip())


@contextmanager
def database(url: str | None) -> Iterator[str]:
    if url:
        yield psycopg_url(url).render_as_string(hide_password=False)
        return
    from .embedded import EmbeddedPostgres

    print("== starting an embedded PostgreSQL (set DATABASE_URL to use your own)", flush=True)
    with EmbeddedPostgres() as pg:
        yield pg.url.render_as_string(hide_password=False)


def _drop_tables(engine: Engine) -> None:
    """Drop the tour's tables, without waiting behind a transaction Ctrl-C cut short (its
    connection may still hold locks until the server notices it is gone)."""
    engine.dispose()
    try:
        with engine.begin() as conn:
            conn.execute(text("SET LOCAL lock_timeout = '5s'"))
            Base.metadata.drop_all(conn)
    except Exception as exc:  # noqa: BLE001 - the embedded server is removed anyway
        print(f"could not drop the demo's tables ({type(exc).__name__}); drop them by hand", file=sys.stderr)
    finally:
        engine.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sqla_queue.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=5000, help="image jobs to bulk-load (default 5000)")
    parser.add_argument("--worker-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN and threading.current_thread() is threading.main_thread():
        # Inherited (a background job of a non-interactive shell): Ctrl-C must still stop
        # the tour and clean up.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.worker_process:
        make_worker(create_engine(os.environ["SQLA_QUEUE_DEMO_URL"])).run()
        return 0

    # The workers' log goes to a file, not over the tour's output; it is removed on exit
    # unless the tour fails, when it is kept (and named) for the post-mortem.
    log_dir = tempfile.mkdtemp(prefix="sqla_queue_demo_")
    log_path = os.path.join(log_dir, "worker.log")
    log_handler = logging.FileHandler(log_path)
    log_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[log_handler])
    tour: Tour | None = None
    keep_log = False
    try:
        with database(os.environ.get("DATABASE_URL")) as url:
            engine = create_engine(url, pool_size=10)
            Base.metadata.drop_all(engine)
            Base.metadata.create_all(engine)
            try:
                tour = Tour(engine, url, args.jobs, sys.stdout)
                tour.run()
            except Exception:
                keep_log = True
                print(f"the tour failed; the workers' log is in {log_path}", file=sys.stderr)
                raise
            finally:
                if tour is not None and tour.other is not None and tour.other.poll() is None:
                    tour.other.kill()
                    tour.other.wait()
                _drop_tables(engine)
    except KeyboardInterrupt:
        print("\ninterrupted; cleaned up", file=sys.stderr)
        return 130
    finally:
        logging.getLogger().removeHandler(log_handler)
        log_handler.close()
        if not keep_log:
            shutil.rmtree(log_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
