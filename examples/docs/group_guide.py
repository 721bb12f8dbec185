"""The workers guide's group snippet: two queue tables served by one process, with one
start and one shutdown."""

from __future__ import annotations

from _db import database_url


def main(url: str) -> None:
    from sqlalchemy import create_engine
    from sqlalchemy.orm import sessionmaker

    from sqla_queue import QueueSession

    from shop_models import Base, EmailJob, Order, Task

    engine = create_engine(url)
    Base.metadata.create_all(engine)
    with sessionmaker(engine, class_=QueueSession)() as session:
        order = Order(customer="ada")
        session.add(order)
        session.flush()
        session.enqueue(Task(task="report", payload={}))
        session.enqueue(EmailJob(order_id=order.id, recipient="ada@example.com"))
        session.commit()
    seen: list[str] = []
    # --8<-- [start:group]
    from sqla_queue import Tasks, Worker, Workers

    tasks = Tasks()

    @tasks.task
    def report(job: Task) -> None:
        seen.append("report")

    def send(job: EmailJob) -> None:
        seen.append(job.recipient)

    workers = Workers([Worker(engine, Task, tasks), Worker(engine, EmailJob, send)])
    workers.run(until_idle=True)  # a signal stops both: their grace runs side by side
    # --8<-- [end:group]
    assert sorted(seen) == ["ada@example.com", "report"], seen
    engine.dispose()
    print("one process served two queue tables and stopped them together")


if __name__ == "__main__":
    with database_url() as url:
        main(url)
