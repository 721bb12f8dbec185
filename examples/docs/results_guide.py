"""The results guide's snippets: a task table that keeps results, a handler that returns
one, a caller that waits for it (sync and async), and the error of a job that failed."""

from __future__ import annotations

import asyncio
import threading

from _db import database_url

# isort: split
# --8<-- [start:declare]
from sqla_queue import HistoryMixin, ResultMixin, TaskMixin, Tasks

from shop_models import Base  # the guides' declarative base


class ReportTask(Base, TaskMixin, ResultMixin, HistoryMixin):  # result, progress, history
    __tablename__ = "report_tasks"


tasks = Tasks()


@tasks.task
def total(job: ReportTask) -> dict[str, int]:
    amounts = job.payload["amounts"]
    return {"count": len(amounts), "total": sum(amounts)}  # stored with the job's "done"


@tasks.task
def refuse(job: ReportTask) -> None:
    raise ValueError("no such account")
# --8<-- [end:declare]


# --8<-- [start:progress]
from sqla_queue import RetryLater, current_job


def fetch_page(number: int) -> None:
    """One page of an import (a stand-in): fails on page 3 the first time."""
    if number == 3 and not flaky_done:
        flaky_done.append(True)
        raise RetryLater(0.1, "the upstream timed out")


@tasks.task
def import_pages(job: ReportTask) -> int:
    start = int((job.progress or {}).get("pages", 0))  # a retry resumes where the last one was
    pages = int(job.payload["pages"])
    for number in range(start, pages):
        fetch_page(number)
        current_job().progress({"pages": number + 1})  # written with the heartbeat and the outcome
    return pages
# --8<-- [end:progress]


flaky_done: list[bool] = []


# --8<-- [start:typed]
from sqlalchemy.orm import Mapped

from sqla_queue import JobMixin


class InvoiceJob(Base, JobMixin):
    __tablename__ = "invoice_jobs"
    __queue_result__ = "total_cents"  # the results go to this column, in its type

    order_id: Mapped[int]
    total_cents: Mapped[int | None]


def price(job: InvoiceJob) -> int:
    return 1999 * job.order_id  # an int, as the column is
# --8<-- [end:typed]


def main(url: str) -> None:
    from sqlalchemy import create_engine
    from sqlalchemy.ext.asyncio import create_async_engine
    from sqlalchemy.orm import sessionmaker

    from sqla_queue import JobFailedError, QueueSession, Worker, result, wait_for_result

    engine = create_engine(url)
    Base.metadata.create_all(engine)
    Sessions = sessionmaker(engine, class_=QueueSession)
    worker = Worker(engine, ReportTask, tasks)
    worker.start()
    try:
        # --8<-- [start:wait]
        with Sessions() as session:
            job = session.enqueue(ReportTask(task="total", payload={"amounts": [5, 7, 30]}))
            session.commit()  # commit first: the wait runs on a connection of its own
            job_id = job.id

        value = wait_for_result(engine, ReportTask, job_id, timeout=30)
        assert value == {"count": 3, "total": 42}

        with Sessions() as session:  # later, in any transaction
            assert result(session, ReportTask, job_id) == {"count": 3, "total": 42}
        # --8<-- [end:wait]

        # --8<-- [start:failed]
        with Sessions() as session:
            job = session.enqueue(ReportTask(task="refuse", payload={}), max_attempts=1)
            session.commit()
            job_id = job.id
        try:
            wait_for_result(engine, ReportTask, job_id, timeout=30)
        except JobFailedError as exc:  # JobCancelledError for a cancelled job
            print("failed:", exc.last_error.splitlines()[0] if exc.last_error else "")
        # --8<-- [end:failed]
        else:
            raise AssertionError("the job should have failed")

        with Sessions() as session:
            job = session.enqueue(ReportTask(task="total", payload={"amounts": [1, 2]}))
            session.commit()
            job_id = job.id

        # --8<-- [start:async]
        async def report() -> dict[str, int]:
            async_engine = create_async_engine(url)  # postgresql+psycopg://...
            try:
                value: dict[str, int] = await wait_for_result(async_engine, ReportTask, job_id, timeout=30)
                return value
            finally:
                await async_engine.dispose()
        # --8<-- [end:async]

        outcome: list[dict[str, int]] = []
        waiting = threading.Thread(target=lambda: outcome.append(asyncio.run(report())))
        waiting.start()
        waiting.join(60)
        assert outcome == [{"count": 2, "total": 3}], outcome

        with Sessions() as session:
            job = session.enqueue(ReportTask(task="import_pages", payload={"pages": 5}))
            session.commit()
            job_id = job.id
        assert wait_for_result(engine, ReportTask, job_id, timeout=30) == 5
        with Sessions() as session:
            imported = session.get_one(ReportTask, job_id)
            assert imported.history is not None
            assert imported.attempts == 2 and imported.progress == {"pages": 5}, (imported.attempts, imported.progress)
            # --8<-- [start:history]
            for attempt in imported.history:  # the last 20 attempts, oldest first
                print(attempt["attempt"], attempt["outcome"], attempt["worker"], attempt["seconds"],
                      (attempt["error"] or "").splitlines()[:1])
            # 1 retried host:1234:9f2c/0.0 0.103 ['RetryLater: the upstream timed out']
            # 2 done host:1234:9f2c/0.1 0.002 []
            # --8<-- [end:history]
            assert [a["outcome"] for a in imported.history] == ["retried", "done"], imported.history

        with Sessions() as session:
            invoice = session.enqueue(InvoiceJob(order_id=3))
            session.commit()
            invoice_id = invoice.id
        Worker(engine, InvoiceJob, price).run(until_idle=True)
        with Sessions() as session:
            assert result(session, InvoiceJob, invoice_id) == 5997
            assert session.get_one(InvoiceJob, invoice_id).total_cents == 5997
    finally:
        worker.stop()
        engine.dispose()
    print("a result stored with the job's completion, waited for sync and async; a failed job's error raised")


if __name__ == "__main__":
    with database_url() as url:
        main(url)
