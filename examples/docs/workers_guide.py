"""The worker guide's snippets: a handler per table, a task registry, a worker embedded
in another program, and the settings for PgBouncer."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from sqlalchemy import create_engine, func, select
from sqlalchemy.orm import Session, sessionmaker

from sqla_queue import QueueSession

from _db import database_url
from shop_models import Base, Charge, EmailJob, Order, Task


class _Outbox:
    """Stands for a mail client and an image library: records what it was asked to do."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()

    def send(self, recipient: str, **details: Any) -> None:
        with self.lock:
            self.calls.append((recipient, details))

    def resize(self, **size: Any) -> None:
        self.send("resize", **size)


mailer = images = _Outbox()

# --8<-- [start:workers]
from sqla_queue import DeadLetter, RetryLater, Tasks, Worker


def send_confirmation(job: EmailJob) -> None:  # typed table: one handler
    if job.recipient.endswith(".invalid"):
        raise DeadLetter("undeliverable address")  # failed now, no more attempts
    mailer.send(job.recipient, order_id=job.order_id)


tasks = Tasks()  # task table: a registry


@tasks.task
def resize(job: Task) -> None:
    images.resize(**job.payload)


@tasks.task(name="billing.charge")
def charge(job: Task, session: Session) -> None:  # transactional handler
    if job.payload.get("bank") == "down":
        raise RetryLater(60)  # try again in a minute
    session.add(Charge(order_id=job.payload["order_id"]))
# --8<-- [end:workers]


@contextlib.contextmanager
def tracing_span() -> Iterator[None]:
    yield


def main(url: str) -> None:
    engine = create_engine(url)
    Base.metadata.create_all(engine)
    try:
        with sessionmaker(engine, class_=QueueSession)() as session:
            order = Order(customer="ada")
            session.add(order)
            session.flush()
            session.enqueue(EmailJob(order_id=order.id, recipient="ada@example.com"), queue="emails")
            session.enqueue(EmailJob(order_id=order.id, recipient="x@mail.invalid"), queue="receipts")
            session.enqueue(Task(task="resize", payload={"w": 640}))
            session.enqueue(Task(task="billing.charge", payload={"order_id": order.id}))
            session.commit()

        # --8<-- [start:run]
        worker = Worker(engine, EmailJob, send_confirmation, concurrency=8, queues=("emails", "receipts"), lease=60)
        # --8<-- [end:run]
        worker.run(until_idle=True)  # the guide shows worker.run(): until SIGTERM/SIGINT
        # --8<-- [start:run-tasks]
        Worker(engine, Task, tasks, job_context=tracing_span).run(until_idle=True)
        # --8<-- [end:run-tasks]

        # --8<-- [start:embed]
        worker = Worker(engine, EmailJob, send_confirmation)
        worker.start()  # raises WorkerStartError if the table or the server is not there
        # ... the rest of your program runs here ...
        worker.stop(grace=10)  # running jobs get 10 s, then go back to pending
        # --8<-- [end:embed]

        with engine.connect() as conn:
            statuses = {row.recipient: row.status for row in conn.execute(select(EmailJob.recipient, EmailJob.status))}
            charges = conn.scalar(select(func.count()).select_from(Charge))
            tasks_done = conn.scalar(select(func.count()).where(Task.status == "done"))
        print(f"emails: {statuses}; tasks done: {tasks_done}; charges: {charges}; calls: {mailer.calls}")
        assert statuses == {"ada@example.com": "done", "x@mail.invalid": "failed"}
        assert (tasks_done, charges) == (2, 1)
        assert mailer.calls == [("ada@example.com", {"order_id": 1}), ("resize", {"w": 640})], mailer.calls
    finally:
        Base.metadata.drop_all(engine)
        engine.dispose()


def behind_pgbouncer(url: str) -> None:
    """The PgBouncer guide's settings; here ``url`` is the server itself (the test suite
    runs them through a real PgBouncer, in tests/test_pgbouncer.py)."""
    # --8<-- [start:pgbouncer]
    engine = create_engine(
        url,  # the pooler's address: "postgresql+psycopg://app@pgbouncer:6432/shop"
        connect_args={"prepare_threshold": None},  # no automatic prepared statements
    )
    worker = Worker(engine, EmailJob, send_confirmation, listen=False, poll_interval=1)  # poll only
    # --8<-- [end:pgbouncer]
    Base.metadata.create_all(engine)
    try:
        with sessionmaker(engine, class_=QueueSession)() as session:
            order = Order(customer="bob")
            session.add(order)
            session.flush()
            session.enqueue(EmailJob(order_id=order.id, recipient="bob@example.com"))
            session.commit()
        worker.run(until_idle=True)
        with engine.connect() as conn:
            assert conn.scalar(select(EmailJob.status)) == "done"
        print("behind PgBouncer: polling worker done")
    finally:
        Base.metadata.drop_all(engine)
        engine.dispose()


if __name__ == "__main__":
    with database_url() as url:
        main(url)
        behind_pgbouncer(url)
