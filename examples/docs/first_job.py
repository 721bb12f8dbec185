"""Your first job, on plain SQLAlchemy: a queue table, a job enqueued beside an order in
one transaction, a worker that runs it.

    python examples/docs/first_job.py     # DATABASE_URL, or an embedded server
"""

from __future__ import annotations

from sqlalchemy import select

from _db import database_url

# isort: split
# --8<-- [start:model]
from sqlalchemy import ForeignKey, create_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from sqla_queue import JobMixin, QueueSession, Worker


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str]


class WelcomeEmail(Base, JobMixin):  # the queue columns and indexes come from the mixin
    __tablename__ = "welcome_emails"
    order_id: Mapped[int] = mapped_column(ForeignKey(Order.id))
    to: Mapped[str]
# --8<-- [end:model]


# --8<-- [start:handler]
def send_welcome(job: WelcomeEmail) -> None:
    print(f"welcome mail to {job.to}")  # your mail client; a job may run twice: see the docs
# --8<-- [end:handler]


def main(url: str) -> None:
    # --8<-- [start:run]
    engine = create_engine(url)  # postgresql+psycopg://user:password@host/db
    Base.metadata.create_all(engine)  # or an Alembic migration
    Session = sessionmaker(engine, class_=QueueSession)

    with Session() as session:
        order = Order(customer="ada")
        session.add(order)
        session.flush()
        session.enqueue(WelcomeEmail(order_id=order.id, to="ada@example.com"))
        session.commit()  # the order and its job, or neither

    worker = Worker(engine, WelcomeEmail, send_welcome)
    worker.run(until_idle=True)  # a service runs worker.run() (or `sqla-queue worker`)
    # --8<-- [end:run]
    try:
        with Session() as session:
            status = session.scalar(select(WelcomeEmail.status))
        print(f"job {status}")
        assert status == "done"
    finally:
        Base.metadata.drop_all(engine)
        engine.dispose()


if __name__ == "__main__":
    with database_url() as url:
        main(url)
