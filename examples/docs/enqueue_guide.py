"""The enqueue guide's snippets: in your transaction, from plain values, in bulk."""

from __future__ import annotations

from sqlalchemy import func, select

from _db import database_url
from shop_models import Base, EmailJob, Order, Task

# isort: split
# --8<-- [start:session]
from sqlalchemy import create_engine
from sqlalchemy.orm import sessionmaker

from sqla_queue import QueueSession

# --8<-- [end:session]
# isort: split
# --8<-- [start:wake]
from sqlalchemy.orm import Mapped, mapped_column

from sqla_queue import JobMixin


class PushJob(Base, JobMixin):  # written by every request of a busy API
    __tablename__ = "push_jobs"
    __queue_wake__ = "after_commit"  # the wake-up after the COMMIT, coalesced, not in it

    device: Mapped[str] = mapped_column(default="")


# --8<-- [end:wake]


def main(url: str) -> None:
    # --8<-- [start:engine]
    engine = create_engine(url)  # "postgresql+psycopg://app:secret@localhost/shop": psycopg 3
    Session = sessionmaker(engine, class_=QueueSession)
    # --8<-- [end:engine]
    Base.metadata.create_all(engine)
    try:
        # --8<-- [start:enqueue]
        with Session() as session:
            order = Order(customer="ada")
            session.add(order)
            session.flush()
            session.enqueue(
                EmailJob(order_id=order.id, recipient="ada@example.com"),
                queue="emails", priority=5, delay=30, max_attempts=5,
            )
            session.commit()  # the order, the job and the wake-up, or none of them
        # --8<-- [end:enqueue]
        with engine.connect() as conn:
            order_id = conn.scalar(select(Order.id))

        # --8<-- [start:values]
        from sqla_queue import enqueue_values

        with engine.begin() as conn:  # or inside a Session: enqueue_values(session, ...)
            job_id = enqueue_values(
                conn, EmailJob, {"order_id": order_id, "recipient": "ada@example.com"},
                queue="emails", delay=30,
            )
        # --8<-- [end:values]
        assert isinstance(job_id, int)

        # --8<-- [start:bulk]
        with Session() as session:
            orders = session.scalars(select(Order)).all()
            rows = ({"order_id": o.id, "recipient": f"{o.customer}@example.com"} for o in orders)  # any iterable
            n = session.enqueue_many(EmailJob, rows, queue="emails", delay=30)
            session.enqueue_many(Task, [{"task": "resize", "payload": {"w": 640}}, Task(task="ping")])
            session.commit()  # the jobs and one NOTIFY per queue, or nothing on rollback
        # --8<-- [end:bulk]
        assert n == 1

        # --8<-- [start:notify]
        from sqlalchemy import insert

        from sqla_queue import notify_on_commit

        with Session() as session:
            session.execute(insert(EmailJob).values(order_id=order_id, recipient="bob@example.com", queue="emails"))
            notify_on_commit(session, EmailJob, "emails")  # workers of "emails" wake up on commit
            session.commit()
        # --8<-- [end:notify]

        with Session() as session:
            session.enqueue(PushJob(device="phone"))
            session.commit()  # returns before the wake-up is sent, by the process's waker thread

        with engine.connect() as conn:
            assert conn.scalar(select(func.count()).select_from(PushJob)) == 1
            counts = (conn.scalar(select(func.count()).select_from(EmailJob)),
                      conn.scalar(select(func.count()).select_from(Task)))
        print(f"email jobs: {counts[0]}, tasks: {counts[1]}")
        assert counts == (4, 2)
    finally:
        Base.metadata.drop_all(engine)
        engine.dispose()


if __name__ == "__main__":
    with database_url() as url:
        main(url)
