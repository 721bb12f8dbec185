"""The unique jobs and Snooze snippets: one job per key on every enqueue path, a key
column of your own, and a handler that polls without spending its attempts."""

from __future__ import annotations

from typing import Any

from sqlalchemy import ForeignKey, create_engine, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from _db import database_url

# isort: split
# --8<-- [start:models]
from sqla_queue import UNIQUE_EVER, JobMixin, QueueSession, TaskMixin, UniqueJobs


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str]


class Task(Base, TaskMixin):  # unique_key column; held while pending or running
    __tablename__ = "tasks"


class InvoiceJob(Base, JobMixin):  # one job per order, ever: the key is order_id itself
    __tablename__ = "invoice_jobs"
    __queue_unique__ = UniqueJobs(column="order_id", statuses=UNIQUE_EVER)
    order_id: Mapped[int | None] = mapped_column(ForeignKey("orders.id"))
# --8<-- [end:models]


def main(url: str) -> None:
    engine = create_engine(url)
    Session = sessionmaker(engine, class_=QueueSession)
    Base.metadata.create_all(engine)
    try:
        # --8<-- [start:enqueue]
        with Session() as session:
            first = session.enqueue(Task(task="sync_account", payload={"id": 7}), unique_key="sync:7")
            again = session.enqueue(Task(task="sync_account", payload={"id": 7}), unique_key="sync:7")
            assert first.inserted and first.job is not None  # the job, persistent, id known
            assert again.skipped and again.job_id == first.job_id  # who holds the key
            session.commit()  # never an IntegrityError: the duplicate was skipped
        # --8<-- [end:enqueue]

        # --8<-- [start:own-column]
        with Session() as session:
            session.add(Order(id=42, customer="ada"))
            made = session.enqueue(InvoiceJob(), unique_key=42)  # sets order_id=42
            assert session.enqueue(InvoiceJob(), unique_key=42).job_id == made.job_id
            session.commit()
        # --8<-- [end:own-column]

        # --8<-- [start:bulk]
        from sqla_queue import enqueue_values

        with Session() as session:
            rows = [{"task": "sync_account", "unique_key": f"sync:{n % 3}"} for n in range(6)]
            rows.append({"task": "ping"})  # no key: COPY, as always
            written = session.enqueue_many(Task, rows)
            print(f"inserted {written.inserted}, skipped {written.skipped}")  # 4 and 3
            found = enqueue_values(session, Task, {"task": "sync_account"}, unique_key="sync:7")
            assert found.skipped
            session.commit()
        # --8<-- [end:bulk]
        assert (written.inserted, written.skipped) == (4, 3)

        with engine.connect() as conn:
            assert conn.scalar(select(func.count()).select_from(Task)) == 5
        snooze(engine)
    finally:
        Base.metadata.drop_all(engine)
        engine.dispose()


def snooze(engine: Any) -> None:
    Session = sessionmaker(engine, class_=QueueSession)
    polls: list[int] = []

    # --8<-- [start:snooze]
    from sqla_queue import Snooze, Tasks, Worker

    tasks = Tasks()

    @tasks.task
    def wait_for_export(job: Task) -> None:
        polls.append(job.attempts)
        if len(polls) < 3:  # e.g. the export is still being made
            raise Snooze(0.1, "export not ready")  # again in 0.1 s; no attempt spent
        print(f"exported after {len(polls)} polls, on attempt {job.attempts}")
    # --8<-- [end:snooze]

    with Session() as session:
        session.enqueue(Task(task="wait_for_export"), queue="exports", max_attempts=1)
        session.commit()
    worker = Worker(engine, Task, tasks, queues=["exports"], poll_interval=0.2)
    worker.run(install_signal_handlers=False, until_idle=True)
    # Each run is a claim of its own (a new attempt number, so a new fencing token), and
    # none was counted against max_attempts=1: the snoozes raised it instead.
    assert polls == [1, 2, 3]


if __name__ == "__main__":
    with database_url() as url:
        main(url)
