"""The flow control guide's snippets: a queue table whose queues can be paused, a pause in
the caller's transaction, a worker that leaves the paused queue's jobs alone, a resume."""

from __future__ import annotations

from sqlalchemy import func, select

from _db import database_url

# isort: split
# --8<-- [start:declare]
from sqlalchemy.orm import Mapped

from sqla_queue import JobMixin, queues_table

from shop_models import Base  # the guides' declarative base


class ExportJob(Base, JobMixin):
    __tablename__ = "export_jobs"
    report: Mapped[str]


queues_table(ExportJob)  # beside the model: adds export_jobs_queues; every claim reads it
# --8<-- [end:declare]


def run(job: ExportJob) -> None:
    """The handler: a stand-in."""


def main(url: str) -> None:
    from sqlalchemy import create_engine
    from sqlalchemy.orm import sessionmaker

    from sqla_queue import QueueSession, Worker

    engine = create_engine(url)
    Base.metadata.create_all(engine)  # a real app migrates (Alembic autogenerate adds the table)
    Sessions = sessionmaker(engine, class_=QueueSession)
    # --8<-- [start:pause]
    from sqla_queue import pause, resume

    with Sessions() as session:
        pause(session, ExportJob, "reports")  # joins this transaction: holds from its commit
        session.enqueue(ExportJob(report="daily"), queue="reports")  # waits while paused
        session.enqueue(ExportJob(report="now"), queue="urgent")
        session.commit()

    Worker(engine, ExportJob, run).run(until_idle=True)  # runs "urgent" only

    with Sessions() as session:
        resume(session, ExportJob, "reports")  # wakes the queue's workers at the commit
        session.commit()
    # --8<-- [end:pause]
    with engine.connect() as conn:
        waiting = dict(conn.execute(select(ExportJob.queue, ExportJob.status)).all())
    assert waiting == {"reports": "pending", "urgent": "done"}, waiting
    Worker(engine, ExportJob, run).run(until_idle=True)
    with engine.connect() as conn:
        done = conn.scalar(select(func.count()).where(ExportJob.status == "done"))
    assert done == 2, done
    engine.dispose()
    print("paused queue left alone, then run once resumed")


if __name__ == "__main__":
    with database_url() as url:
        main(url)
