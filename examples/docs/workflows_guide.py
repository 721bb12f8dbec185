"""The workflows guide's snippets: a task table whose jobs may wait for others, a graph
enqueued in one transaction, a child that reads its parents' results, a batch with its
callback, and the cancel of a whole workflow."""

from __future__ import annotations

from _db import database_url

# isort: split
# --8<-- [start:declare]
from sqlalchemy.orm import Session

from sqla_queue import ResultMixin, TaskMixin, Tasks, WorkflowMixin, parent_counts, parent_results

from shop_models import Base  # the guides' declarative base


class Step(Base, TaskMixin, ResultMixin, WorkflowMixin):  # results, and jobs that wait
    __tablename__ = "steps"


tasks = Tasks()


@tasks.task
def fetch(job: Step) -> dict[str, int]:
    return {"rows": len(job.payload["url"])}  # a stand-in for a download


@tasks.task
def merge(job: Step, session: Session) -> int:
    # Runs once every fetch ended done, in the transaction that will complete it.
    fetched = parent_results(session, Step, job.id)  # {parent id: its result}
    return sum(value["rows"] for value in fetched.values())


@tasks.task
def report(job: Step, session: Session) -> dict[str, int]:
    return parent_counts(session, Step, job.id)  # {"done": 3, "failed": 1, ...}
# --8<-- [end:declare]


def main(url: str) -> None:
    from sqlalchemy import create_engine, select
    from sqlalchemy.orm import sessionmaker

    from sqla_queue import QueueSession, Worker, Workflow, cancel, result

    engine = create_engine(url)
    Base.metadata.create_all(engine)
    Sessions = sessionmaker(engine, class_=QueueSession, expire_on_commit=False)
    try:
        # --8<-- [start:graph]
        flow = Workflow()  # on_parent_failure="cancel": a failure cancels what is below it
        fetches = [flow.add(Step(task="fetch", payload={"url": url})) for url in ("a.csv", "bb.csv")]
        merged = flow.add(Step(task="merge", payload={}), after=fetches)
        with Sessions() as session:
            session.enqueue_workflow(flow)  # every job, in this transaction
            session.commit()  # the fetches can run now; the merge waits for both
        # --8<-- [end:graph]

        # --8<-- [start:batch]
        members = [Step(task="fetch", payload={"url": name}) for name in ("x", "yy", "zzz")]
        batch = Workflow.batch(members, callback=Step(task="report", payload={}))
        with Sessions() as session:
            session.enqueue_workflow(batch)
            session.commit()
        # --8<-- [end:batch]

        Worker(engine, Step, tasks).run(until_idle=True)
        with Sessions() as session:
            assert result(session, Step, merged.id) == len("a.csv") + len("bb.csv")
            counts = result(session, Step, batch.jobs[-1].id)
            assert counts["done"] == 3 and counts["failed"] == 0, counts

        # --8<-- [start:cancel]
        flow = Workflow()
        first = flow.add(Step(task="fetch", payload={"url": "c.csv"}))
        flow.add(Step(task="merge", payload={}), after=[first])
        with Sessions() as session:
            session.enqueue_workflow(flow)
            session.commit()

        with Sessions() as session:
            cancelled = cancel(session, Step, workflow=flow.id)  # every unfinished job of it
            session.commit()
        # --8<-- [end:cancel]
        assert len(cancelled) == 2
        with engine.connect() as conn:
            statuses = conn.scalars(select(Step.status).where(Step.workflow_id == flow.id)).all()
        assert set(statuses) == {"cancelled"}, statuses
    finally:
        engine.dispose()
    print("a graph run in order, a child reading its parents' results, a batch's counts, a workflow cancelled")


if __name__ == "__main__":
    with database_url() as url:
        main(url)
