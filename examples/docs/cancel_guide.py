"""The cancel and timeouts guide's snippets: timeouts at three levels, a handler that
checks its job's flag, and a cancel of a running job, whose writes never commit."""

from __future__ import annotations

import threading

from sqlalchemy import func, select

from _db import database_url

# isort: split
# --8<-- [start:timeouts]
from sqlalchemy import create_engine
from sqlalchemy.orm import Session, sessionmaker

from sqla_queue import QueueSession, Tasks, Worker, current_job

from shop_models import Base, Charge, Order, Task  # the guides' models: Task is a TaskMixin table

tasks = Tasks()


@tasks.task(timeout=30)  # every attempt of this task: 30 s at most
def export_report(job: Task) -> None:
    context = current_job()  # the running job's context, in any handler
    for _chunk in range(20):
        context.check()  # raises JobCancelled once cancelled or past the deadline
        if context.wait(0.05):  # an interruptible sleep: True once told to stop
            break


@tasks.task
def charge(job: Task, session: Session) -> None:  # transactional
    session.add(Charge(order_id=job.payload["order_id"]))
    current_job().wait(60)  # ignores the flag: its writes still never commit if cancelled
# --8<-- [end:timeouts]


def import_batch(job: Task, batch: int) -> None:
    """One batch of an import, saved on its own (a stand-in here)."""


# --8<-- [start:stopping]
@tasks.task
def import_rows(job: Task) -> None:
    context = current_job()
    for batch in range(job.payload.get("batches", 10)):
        # Between two batches: once the worker stops, raises JobCancelled("stopping"),
        # and the job is handed back now rather than at the end of the grace.
        context.check()
        import_batch(job, batch)  # saved on its own: a later run skips what is done
# --8<-- [end:stopping]


def main(url: str) -> None:
    # --8<-- [start:enqueue]
    engine = create_engine(url)  # postgresql+psycopg://...
    Base.metadata.create_all(engine)  # a real app migrates (see Alembic)
    Sessions = sessionmaker(engine, class_=QueueSession)
    with Sessions() as session:
        order = Order(customer="ada")
        session.add(order)
        session.flush()
        session.enqueue(Task(task="export_report", payload={}), timeout=5)  # this job: 5 s
        job = session.enqueue(Task(task="charge", payload={"order_id": order.id}))
        session.commit()
        job_id = job.id
    # --8<-- [end:enqueue]
    try:
        # --8<-- [start:worker]
        worker = Worker(engine, Task, tasks, timeout=600)  # jobs and tasks without one: 10 min
        # --8<-- [end:worker]
        worker.start()
        try:
            pause = threading.Event()
            for _ in range(600):  # until the charge runs
                with engine.connect() as conn:
                    if conn.scalar(select(Task.status).where(Task.id == job_id)) == "running":
                        break
                pause.wait(0.05)
            # --8<-- [start:cancel]
            from sqla_queue import cancel

            with Session(engine) as session:
                cancelled = cancel(session, Task, ids=[job_id])  # pending or running
                session.commit()  # the running job's worker hears of it now
            # --8<-- [end:cancel]
            assert cancelled == [job_id]
            for _ in range(600):
                if worker.stats.cancelled == 1 and worker.stats.done == 1:
                    break
                pause.wait(0.05)
        finally:
            worker.stop()
        with engine.connect() as conn:
            statuses = dict(conn.execute(select(Task.task, Task.status)).all())
            charges = conn.scalar(select(func.count()).select_from(Charge))
            owner = conn.scalar(select(Task.lease_owner).where(Task.id == job_id))
        print(f"statuses: {statuses}; charges committed: {charges}; cancelled job's lease_owner: {owner}")
        assert statuses == {"export_report": "done", "charge": "cancelled"}, statuses
        assert charges == 0
        assert owner is not None  # kept: the worker that ran the cancelled attempt
    finally:
        Base.metadata.drop_all(engine)
        engine.dispose()


if __name__ == "__main__":
    with database_url() as url:
        main(url)
