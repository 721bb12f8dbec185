"""The workers guide's workers-table snippet: a queue table whose workers record
themselves, one listed while idle, and its row gone once it stopped."""

from __future__ import annotations

from _db import database_url

# isort: split
# --8<-- [start:declare]
from sqla_queue import workers_table

from shop_models import Task  # the guides' task table

workers_table(Task)  # beside the model: adds tasks_workers; every worker of tasks records itself
# --8<-- [end:declare]


def main(url: str) -> None:
    from sqlalchemy import create_engine

    from sqla_queue import Worker

    from shop_models import Base

    engine = create_engine(url)
    Base.metadata.create_all(engine)
    worker = Worker(engine, Task, lambda job: None, queues=("emails",))
    worker.start()
    try:
        # --8<-- [start:list]
        from sqla_queue import admin

        for row in admin.registered_workers(engine, Task):  # what `sqla-queue workers` prints
            print(row.name, row.host, row.pid, row.runtime, row.queues, row.running, f"{row.seen_ago:.1f}s ago")
        # --8<-- [end:list]
        (row,) = admin.registered_workers(engine, Task)
        assert row.name == worker.owner and row.queues == ["emails"] and row.running == 0, row
    finally:
        worker.stop()
    assert admin.registered_workers(engine, Task) == []
    engine.dispose()
    print("an idle worker recorded itself, and deleted its row when it stopped")


if __name__ == "__main__":
    with database_url() as url:
        main(url)
