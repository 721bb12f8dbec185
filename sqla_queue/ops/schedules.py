""":class:`ScheduleOps`: the statements of periodic jobs on one queue table (a tick claimed
by moving its watermark row, its job inserted in the same transaction)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy import Connection

from .. import sql as q
from ..driver import Driver, WorkerStartError
from ..model import translated_schema
from ..periodic import Schedule, schedules_table


class ScheduleOps:
    """The statements of periodic jobs on one queue table: claim a schedule's tick
    (advance its watermark row) and insert the tick's jobs, in one transaction on the
    SQLAlchemy connection the scheduler opened (:class:`~sqla_queue.worker.scheduler.
    Scheduler`).

    ``insert`` inserts a job's values: the enqueue side's
    :func:`~sqla_queue.enqueue_values`, handed in by the worker, so that a tick's job is
    checked and woken for as every enqueued job is, and the operations layer imports
    nothing of the enqueue side."""

    def __init__(self, model: Any, insert: Callable[..., Any]) -> None:
        self.model = model
        self._insert = insert
        self.table = schedules_table(model)
        self._claim = q.schedule_tick_template(model)

    def check_table(self, driver: Driver) -> None:
        """Fail fast (:class:`~sqla_queue.driver.WorkerStartError`) when the watermark
        table is missing from the database, or lacks a column (``paused_at``, which
        every claim reads, came later: a table made before it needs a migration)."""
        table = self.table
        conn = driver.connect("start-up check")
        try:
            with driver.deadline(conn, 30):
                name = _qualified(driver, table)
                rows = conn.query("SELECT to_regclass(%s) IS NOT NULL", (name,))
                columns = conn.query(
                    "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attnum > 0 "
                    "AND NOT attisdropped", (name,)
                ) if rows and rows[0][0] else []
        finally:
            conn.close()
        if not rows or not rows[0][0]:
            raise WorkerStartError(
                f"table {driver.table_name(table)!r} does not exist in that database: the schedules need it "
                f"(sqla_queue.schedules_table(model) adds it to the model's metadata: create it, or migrate)"
            )
        missing = sorted(set(table.c.keys()) - {row[0] for row in columns})
        if missing:
            raise WorkerStartError(
                f"table {driver.table_name(table)!r} has no column {', '.join(missing)}: migrate it "
                f"(alembic revision --autogenerate adds what sqla_queue.schedules_table(model) declares)"
            )

    def claim_tick(self, sa: Connection, name: str, tick: datetime) -> tuple[bool, datetime | None]:
        """Move the watermark of schedule ``name`` to ``tick`` in ``sa``'s transaction:
        (claimed, where the watermark stood: None for a schedule seen for the first
        time). Not claimed: another worker enqueued that tick (or a later one)."""
        row = sa.execute(self._claim, {q.SCHEDULE_PARAM: name, q.TICK_PARAM: tick}).first()
        if row is None:
            return False, None
        previous: datetime | None = row[0]
        return True, previous

    def enqueue_tick(self, sa: Connection, schedule: Schedule, tick: datetime) -> Any:
        """Insert the job of ``schedule``'s ``tick`` in ``sa``'s transaction, its
        ``run_after`` the tick, checked as ``enqueue_values()`` checks (with its NOTIFY,
        delivered on commit). Returns its key."""
        options = schedule.options
        return self._insert(
            sa, self.model, schedule.row(tick), run_at=tick, queue=options.queue, priority=options.priority,
            max_attempts=options.max_attempts,
        )


def _qualified(driver: Driver, table: Any) -> str:
    """``"schema"."name"`` of ``table`` under the engine's schema map, for ``to_regclass``."""
    from psycopg import sql as pgsql

    schema = translated_schema(table, driver.schema_translate_map)
    return pgsql.Identifier(*([schema, table.name] if schema else [table.name])).as_string(None)
