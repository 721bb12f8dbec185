"""The handlers guide's logging snippet: every record a handler logs carries its job's id
and attempt, through one filter on the log handler."""

from __future__ import annotations

import io

from _db import database_url

# isort: split
# --8<-- [start:logging]
import logging

from sqla_queue import JobLogFilter, Tasks

from shop_models import Task  # the guides' task table

stream = logging.StreamHandler()
stream.addFilter(JobLogFilter())  # job_id, job_attempt, job_task, job_queue, job_table; "-" outside a job
stream.setFormatter(logging.Formatter("%(levelname)s [%(job_task)s %(job_id)s/%(job_attempt)s] %(message)s"))
logging.getLogger("shop").addHandler(stream)

log = logging.getLogger("shop.mail")
tasks = Tasks()


@tasks.task
def send_receipt(job: Task) -> None:
    log.warning("sending a receipt to %s", job.payload["to"])  # WARNING [send_receipt 1/1] sending ...
# --8<-- [end:logging]


def main(url: str) -> None:
    from sqlalchemy import create_engine
    from sqlalchemy.orm import sessionmaker

    from sqla_queue import QueueSession, Worker

    from shop_models import Base

    captured = io.StringIO()
    stream.setStream(captured)
    engine = create_engine(url)
    Base.metadata.create_all(engine)
    with sessionmaker(engine, class_=QueueSession)() as session:
        job = session.enqueue(Task(task="send_receipt", payload={"to": "ada@example.com"}))
        session.commit()
        job_id = job.id
    Worker(engine, Task, tasks).run(until_idle=True)
    log.warning("outside any job")
    engine.dispose()
    lines = captured.getvalue().splitlines()
    assert lines == [f"WARNING [send_receipt {job_id}/1] sending a receipt to ada@example.com",
                     "WARNING [- -/-] outside any job"], lines
    print("a handler's log records carry its job; others say -")


if __name__ == "__main__":
    with database_url() as url:
        main(url)
