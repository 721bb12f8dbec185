"""Keyed ``enqueue_many`` (unique jobs) against a hand-written ``INSERT … ON CONFLICT DO
NOTHING`` of the same rows.

    DATABASE_URL=postgresql://user@host/db python benchmarks/unique_enqueue.py [--rows 5000]
        [--runs 15] [--quick]

Creates a scratch database beside the one in ``DATABASE_URL`` (default: the local test
server, dropped at the end) with a task table holding ``--rows`` pending keyed jobs, then
times, interleaved, each in a fresh transaction that is rolled back (so the table stays
the same):

- ``session.enqueue_many(Task, rows)``: ``--rows`` rows with a ``unique_key``, a quarter
  of them held by a job already there and a quarter repeating an earlier row of the call
  (both skipped), checked, filled with the options and the defaults the server does not
  repeat, and written by psycopg's pipelined executemany of ``INSERT … ON CONFLICT DO
  NOTHING`` (``DEFAULT`` for the rest), in key order;
- the baseline: the same rows as tuples, by psycopg's ``executemany`` (pipelined) of
  ``INSERT INTO tasks (task, payload, unique_key) VALUES (…) ON CONFLICT (unique_key)
  WHERE … DO NOTHING`` on the same connection, no checks, server defaults for the rest.

Prints rows per second of each (median) and the ratio; the target is at least 0.8x.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from typing import Any

from sqlalchemy import create_engine, make_url, text
from sqlalchemy.orm import DeclarativeBase, Session

from sqla_queue import TaskMixin, enqueue_many


class Base(DeclarativeBase):
    pass


class Task(Base, TaskMixin):
    __tablename__ = "tasks"


BASELINE = (
    "INSERT INTO tasks (task, payload, unique_key) VALUES (%s, %s::jsonb, %s) "
    "ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL AND (status = 'pending' OR status = 'running') "
    "DO NOTHING"
)


def make_rows(n: int) -> list[dict[str, Any]]:
    """n keyed rows: of each four, one held by a job already there, two new, and one
    repeating the row before it; so half are inserted and half skipped."""
    rows = []
    for i in range(n):
        key = (f"held-{i}", f"new-{i}", f"dup-{i}", f"dup-{i - 1}")[i % 4]
        rows.append({"task": "sync", "payload": {"account": i, "tags": ["a", "b"]}, "unique_key": key})
    return rows


def time_ours(engine: Any, rows: list[dict[str, Any]]) -> tuple[float, Any]:
    with Session(engine) as session:
        session.execute(text("SELECT 1"))  # the transaction and connection exist already
        start = time.perf_counter()
        written = enqueue_many(session, Task, rows)
        elapsed = time.perf_counter() - start
        session.rollback()
    return elapsed, written


def time_baseline(engine: Any, rows: list[dict[str, Any]]) -> float:
    with Session(engine) as session:
        session.execute(text("SELECT 1"))
        driver: Any = session.connection().connection.driver_connection
        start = time.perf_counter()
        tuples = [(r["task"], json.dumps(r["payload"]), r["unique_key"]) for r in rows]
        with driver.cursor() as cursor:
            cursor.executemany(BASELINE, tuples)
        elapsed = time.perf_counter() - start
        session.rollback()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=5000)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the harness only")
    args = parser.parse_args()
    n, runs = (200, 3) if args.quick else (args.rows, args.runs)
    admin = make_url(os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test"))
    admin = admin.set(drivername="postgresql+psycopg")
    name = f"sqla_queue_bench_{uuid.uuid4().hex[:8]}"
    admin_engine = create_engine(admin, isolation_level="AUTOCOMMIT")
    with admin_engine.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    engine = create_engine(admin.set(database=name))
    try:
        Base.metadata.create_all(engine)
        rows = make_rows(n)
        with Session(engine) as session:
            enqueue_many(session, Task, [{"task": "sync", "unique_key": f"held-{i}"} for i in range(0, n, 4)])
            session.commit()
        for _ in range(2):  # warm up connections, caches, prepared statements
            time_ours(engine, rows)
            time_baseline(engine, rows)
        ours: list[float] = []
        base: list[float] = []
        written: Any = None
        for _ in range(runs):
            elapsed, written = time_ours(engine, rows)
            ours.append(elapsed)
            base.append(time_baseline(engine, rows))
        o, b = n / statistics.median(ours), n / statistics.median(base)
        print(f"{n} keyed rows, {written.inserted} inserted, {written.skipped} skipped; median of {runs} runs")
        print(f"enqueue_many (keyed):                    {o:>10,.0f} rows/s")
        print(f"hand-written INSERT … ON CONFLICT (psycopg executemany): {b:>10,.0f} rows/s")
        print(f"ratio: {o / b:.2f}x (target >= 0.8x)")
    finally:
        engine.dispose()
        with admin_engine.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin_engine.dispose()


if __name__ == "__main__":
    main()
