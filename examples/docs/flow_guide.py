"""The flow control guide's snippets: a queue table whose queues can be paused, a pause in
the caller's transaction, a worker that leaves the paused queue's jobs alone, a resume;
the rules, and a queue's own limit set at run time."""

from __future__ import annotations

import threading
import time

from sqlalchemy import func, select

from _db import database_url

_lock = threading.Lock()

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


# --8<-- [start:concurrency]
from sqlalchemy.orm import mapped_column

from sqla_queue import Concurrency


class SyncJob(Base, JobMixin):
    __tablename__ = "sync_jobs"
    __queue_flow__ = (
        Concurrency(1, key="account_id"),  # one running sync per account
        Concurrency(50, key="queue"),  # at most 50 running per queue
    )
    account_id: Mapped[int | None] = mapped_column()  # NULL: not limited per account
# --8<-- [end:concurrency]


queues_table(SyncJob)  # its queues can be paused, and given limits of their own


# --8<-- [start:rate]
from sqla_queue import RateLimit


class WebhookJob(Base, JobMixin):
    __tablename__ = "webhook_jobs"
    __queue_flow__ = (
        RateLimit(10, per=1.0, key="host", strict=True),  # 10 calls a second per host
        RateLimit(1000, per=60.0),  # and 1,000 a minute in all
    )
    host: Mapped[str]
# --8<-- [end:rate]


# --8<-- [start:in-order]
from sqla_queue import InOrder


class LedgerJob(Base, JobMixin):
    __tablename__ = "ledger_jobs"
    __queue_flow__ = InOrder(key="account_id")  # one at a time per account, in order
    account_id: Mapped[int]
    entry: Mapped[str]
# --8<-- [end:in-order]

#: The entries each account's jobs applied, in the order they ran.
applied: dict[int, list[str]] = {}


def apply_entry(job: LedgerJob) -> None:
    with _lock:
        applied.setdefault(job.account_id, []).append(job.entry)


def run(job: ExportJob) -> None:
    """The handler: a stand-in."""


#: The most syncs of one account running at once, as the handler saw them.
running: dict[int, int] = {}
most = 0


def sync(job: SyncJob) -> None:
    """Counts the syncs of its account running at once, for the check below."""
    global most
    account = job.account_id or 0
    with _lock:
        running[account] = running.get(account, 0) + 1
        most = max(most, running[account])
    time.sleep(0.01)  # the sync's work
    with _lock:
        running[account] -= 1


#: The most "bulk" syncs running at once, as the handler saw them.
bulk_running = 0
bulk_most = 0


def bulk_sync(job: SyncJob) -> None:
    global bulk_running, bulk_most
    with _lock:
        bulk_running += 1
        bulk_most = max(bulk_most, bulk_running)
    time.sleep(0.01)
    with _lock:
        bulk_running -= 1


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
    with Sessions() as session:
        for n in range(30):
            session.enqueue(SyncJob(account_id=n % 3))
        session.commit()
    Worker(engine, SyncJob, sync, concurrency=8).run(until_idle=True)
    assert most == 1, most
    # --8<-- [start:queue-limits]
    from sqla_queue import set_queue_limits

    with Sessions() as session:
        set_queue_limits(session, SyncJob, "bulk", concurrency=2)  # this queue: 2, not 50
        session.commit()  # every claim from here on counts against it
    # --8<-- [end:queue-limits]
    with Sessions() as session:
        for _ in range(12):
            session.enqueue(SyncJob(account_id=None), queue="bulk")
        session.commit()
    Worker(engine, SyncJob, bulk_sync, concurrency=8).run(until_idle=True)
    assert 1 <= bulk_most <= 2, bulk_most
    with Sessions() as session:
        for _ in range(25):
            session.enqueue(WebhookJob(host="api.example.com"))
        session.commit()
    Worker(engine, WebhookJob, lambda job: None, concurrency=8).run(until_idle=True)
    with engine.connect() as conn:
        starts = sorted(conn.scalars(select(func.extract("epoch", WebhookJob.started_at))))
    assert all(starts[i + 10] - starts[i] >= 1.0 for i in range(len(starts) - 10)), starts  # 10 a second
    with Sessions() as session:
        for n in range(12):
            session.enqueue(LedgerJob(account_id=n % 2, entry=f"entry {n}"))
        session.commit()
    Worker(engine, LedgerJob, apply_entry, concurrency=8).run(until_idle=True)
    assert applied == {a: [f"entry {n}" for n in range(12) if n % 2 == a] for a in (0, 1)}, applied
    engine.dispose()
    print("paused queue left alone, then resumed; one sync per account at a time; two bulk syncs at a time; "
          "10 calls a second; ledgers in order")


if __name__ == "__main__":
    with database_url() as url:
        main(url)
