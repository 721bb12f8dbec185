"""The monitoring guide's Sentry snippet: failed attempts and dead letters reported by an
observer, here to an in-memory transport (yours: a DSN)."""

from __future__ import annotations

from typing import Any

from _db import database_url


def main(url: str) -> None:
    from sqlalchemy import create_engine
    from sqlalchemy.orm import sessionmaker

    from sqla_queue import Backoff, QueueSession, Tasks, Worker

    from shop_models import Base, Task

    engine = create_engine(url)
    sent: list[dict[str, Any]] = []
    # --8<-- [start:sentry]
    import sentry_sdk
    from sentry_sdk.transport import Transport

    from sqla_queue.sentry import SentryObserver

    class Kept(Transport):  # a stand-in for Sentry's servers in this guide
        def capture_envelope(self, envelope: Any) -> None:
            sent.extend(item.payload.json for item in envelope.items if item.payload.json)

    sentry_sdk.init(dsn="https://key@sentry.example.com/1", transport=Kept)  # yours: your project's DSN

    tasks = Tasks()

    @tasks.task
    def charge(job: Task) -> None:
        raise ConnectionError("the payment provider did not answer")

    worker = Worker(engine, Task, tasks, observers=[SentryObserver()], backoff=Backoff(base=0.05, jitter=0))
    # --8<-- [end:sentry]
    Base.metadata.create_all(engine)
    with sessionmaker(engine, class_=QueueSession)() as session:
        session.enqueue(Task(task="charge", payload={}), max_attempts=2)
        session.commit()
    for _ in range(100):  # the second attempt is due after the backoff: run until it ended
        worker.run(until_idle=True, install_signal_handlers=False)
        if len(sent) >= 3:
            break
    sentry_sdk.flush()
    messages = sorted((e["level"], e["tags"]["sqla_queue.event"], e["message"].split(":")[0]) for e in sent)
    assert messages == [
        ("error", "attempt", "charge"), ("error", "dead letter", "job 1 of tasks dead-lettered (charge)"),
        ("warning", "attempt", "charge"),
    ], messages
    engine.dispose()
    print("two failed attempts and a dead letter reported to Sentry, with the job's table, id, task and attempt")


if __name__ == "__main__":
    with database_url() as url:
        main(url)
