"""The periodic-jobs guide's snippets: schedules on a task registry and on a typed table,
the watermark table, retention, and two workers enqueueing each tick once."""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import DateTime, create_engine, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from _db import database_url

# isort: split
# --8<-- [start:models]
from sqla_queue import JobMixin, TaskMixin, schedules_table


class Base(DeclarativeBase):
    pass


class Task(Base, TaskMixin):
    __tablename__ = "periodic_tasks"


class ReportJob(Base, JobMixin):
    __tablename__ = "report_jobs"
    period_start: Mapped[datetime] = mapped_column(DateTime(timezone=True))


schedules_table(Task)  # "periodic_tasks_schedules": one watermark row per schedule
schedules_table(ReportJob)  # in the same metadata: create_all and Alembic see them
# --8<-- [end:models]

# --8<-- [start:tasks]
from sqla_queue import Tasks

tasks = Tasks()


@tasks.periodic("*/5 * * * *", timezone="Europe/Paris")
def refresh_rates(job: Task) -> None:
    ...  # every five minutes


@tasks.periodic("0 3 * * *", timezone="Europe/Paris", payload={"kind": "daily"}, backfill=2)
def nightly_report(job: Task) -> None:
    ...  # 03:00 in Paris; after an outage, up to 3 missed nights run


# --8<-- [end:tasks]

# --8<-- [start:typed]
from sqla_queue import Schedule, Worker

hourly = Schedule(
    "hourly-report",
    "0 * * * *",
    values=lambda tick: {"period_start": tick - timedelta(hours=1)},  # the job's own columns
    queue="reports",
)


def build_report(job: ReportJob) -> None:
    ...  # the hour from job.period_start; job.run_after is the tick


# --8<-- [end:typed]

# --8<-- [start:retention]
def make_worker(engine: Any) -> Worker:
    return Worker(
        engine,
        Task,
        tasks,  # its @tasks.periodic schedules run on every worker of the registry
        retention={"done": timedelta(days=7), "cancelled": timedelta(days=7), "failed": timedelta(days=90)},
    )
# --8<-- [end:retention]


def main() -> None:
    with database_url() as url:
        engine = create_engine(url)
        Base.metadata.create_all(engine)
        try:
            typed = Worker(engine, ReportJob, build_report, schedules=[hourly])
            assert [s.name for s in typed.schedules] == ["hourly-report"]
            assert make_worker(engine).pruner is not None
            # --8<-- [start:every]
            beats = Tasks()

            @beats.periodic(every=1)
            def beat(job: Task) -> None:
                print("tick", job.run_after.isoformat())

            workers = [Worker(engine, Task, beats, poll_interval=0.5) for _ in range(2)]
            for worker in workers:
                worker.start()  # two workers, no leader: each second is enqueued once
            # --8<-- [end:every]
            deadline = time.monotonic() + 20
            done = 0
            while done < 3 and time.monotonic() < deadline:
                time.sleep(0.1)
                with engine.connect() as conn:
                    done = conn.scalar(select(func.count()).where(Task.status == "done")) or 0
            for worker in workers:
                worker.stop(grace=1)
            with engine.connect() as conn:
                ticks = list(conn.scalars(select(Task.run_after)))
            assert done >= 3, done
            assert len(ticks) == len(set(ticks)), ticks  # never twice
            print(f"checked: {len(ticks)} ticks, each enqueued once by two workers")
        finally:
            Base.metadata.drop_all(engine)
            engine.dispose()


if __name__ == "__main__":
    main()
