"""The monitoring guide's snippets: an observer, Prometheus (the worker's exporter and a
registry mounted in an app), OpenTelemetry spans linked to the enqueuing request, the
per-job log lines, and the queries behind the gauges."""

from __future__ import annotations

import json
import logging
import threading
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, insert, text
from sqlalchemy.orm import sessionmaker

from sqla_queue import QueueSession

from _db import database_url
from shop_models import Base, Task


def charge(job: Task) -> None:
    if job.payload.get("card") == "declined":
        raise RuntimeError("card declined")


# --8<-- [start:observer]
from sqla_queue import JobEvent, JobOutcome, Tasks, Worker, WorkerObserver


class SlowJobs(WorkerObserver):
    """Runs on the worker's observer thread: a slow or failing method never holds up a job."""

    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()

    def finished(self, event: JobEvent) -> None:
        self.outcomes[event.outcome.value if event.outcome else "?"] += 1
        if event.outcome is JobOutcome.DONE and (event.run_time or 0) > 10:
            print(f"slow: {event.task} job {event.job_id} took {event.run_time:.1f}s, "
                  f"waited {event.pickup_latency:.1f}s for a worker")


tasks = Tasks()
tasks.register("charge", charge)
# worker = Worker(engine, Task, tasks, observers=[SlowJobs()])
# --8<-- [end:observer]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def main(url: str) -> None:
    engine = create_engine(url)
    Base.metadata.create_all(engine)
    Sessions = sessionmaker(engine, class_=QueueSession)
    try:
        # --8<-- [start:otel]
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        from sqla_queue.otel import TracingObserver

        provider = TracerProvider()  # yours: with an OTLP exporter, say
        exporter = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        tracer = provider.get_tracer("shop")

        with tracer.start_as_current_span("POST /checkout"), Sessions() as session:
            session.enqueue(Task(task="charge", payload={"card": "ok"}))  # stores the span's context
            session.commit()
        # --8<-- [end:otel]
        with Sessions() as session:
            session.enqueue(Task(task="charge", payload={"card": "declined"}), max_attempts=1)
            session.commit()

        port = free_port()
        observer = SlowJobs()
        # --8<-- [start:prometheus-worker]
        worker = Worker(
            engine, Task, tasks,
            observers=[observer, TracingObserver(provider)],  # one span per job run
            metrics_port=port,  # Prometheus scrapes http://host:port/metrics
        )
        # --8<-- [end:prometheus-worker]
        worker.run(until_idle=True, install_signal_handlers=False)

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            body = answer.read().decode()
        wanted = 'sqla_queue_jobs_total{outcome="done",queue="default",table="tasks",task="charge"} 1.0'
        assert wanted in body, body
        assert 'sqla_queue_jobs_total{outcome="failed",queue="default",table="tasks",task="charge"} 1.0' in body
        assert "sqla_queue_job_run_seconds_bucket" in body and 'sqla_queue_depth_up{table="tasks"} 1.0' in body
        assert observer.outcomes == {"done": 1, "failed": 1}, observer.outcomes
        spans = [s for s in exporter.get_finished_spans() if s.name.startswith("sqla_queue.job")]
        [span, _] = sorted(spans, key=lambda s: len(s.links), reverse=True)
        assert span.name == "sqla_queue.job charge" and len(span.links) == 1
        assert trace.get_current_span() is trace.INVALID_SPAN
        print(f"prometheus: {wanted}; span {span.name!r} linked to its request; outcomes {dict(observer.outcomes)}")

        mounted(engine)
        logs(engine, Sessions)
        depth(engine)
        autovacuum(engine)
    finally:
        Base.metadata.drop_all(engine)
        engine.dispose()


def mounted(engine: Any) -> None:
    """The registry served by the user's own WSGI app instead of the worker's exporter."""
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    # --8<-- [start:prometheus-mount]
    from prometheus_client import CollectorRegistry, make_wsgi_app

    from sqla_queue.prometheus import metrics

    registry = CollectorRegistry()  # or leave it out: prometheus_client's default one
    m = metrics(registry)
    m.watch(engine, Task)  # queue gauges of this table, read at most every 15 s
    # Worker(engine, Task, tasks, observers=[m.observer])  # the job counters and histograms
    app = make_wsgi_app(registry)  # mount it at /metrics in your app
    # --8<-- [end:prometheus-mount]

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = make_server("127.0.0.1", 0, app, handler_class=Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/", timeout=10) as answer:
            body = answer.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert 'sqla_queue_depth_up{table="tasks"} 1.0' in body, body
    print("mounted: the queue gauges served by the app's own WSGI route")


def logs(engine: Any, Sessions: Any) -> None:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    # --8<-- [start:logs]
    class JsonLines(logging.Formatter):
        """One JSON object per line, with the job's fields (given in ``extra=``)."""

        FIELDS = ("job_id", "table", "queue", "task", "attempt", "outcome", "run_time", "pickup_latency", "error")

        def format(self, record: logging.LogRecord) -> str:
            fields = {k: getattr(record, k) for k in self.FIELDS if hasattr(record, k)}
            return json.dumps({"level": record.levelname, "message": record.getMessage(), **fields}, default=str)

    jobs_log = logging.getLogger("sqla_queue.worker.jobs")  # one line per finished job
    jobs_log.setLevel(logging.DEBUG)  # done jobs log at DEBUG; retries WARNING, dead letters ERROR
    # --8<-- [end:logs]
    keep = Keep()
    keep.setFormatter(JsonLines())
    jobs_log.addHandler(keep)
    try:
        with Sessions() as session:
            session.enqueue(Task(task="charge", payload={"card": "ok"}))
            session.commit()
        Worker(engine, Task, tasks).run(until_idle=True, install_signal_handlers=False)
    finally:
        jobs_log.removeHandler(keep)
        jobs_log.setLevel(logging.NOTSET)
    [line] = [json.loads(keep.format(r)) for r in records]
    assert line["outcome"] == "done" and line["task"] == "charge" and line["level"] == "DEBUG", line
    print(f"logs: {line['message']!r} with fields {sorted(line)}")


def depth(engine: Any) -> None:
    # --8<-- [start:depth]
    from sqla_queue import sql
    from sqla_queue.admin import queue_depth

    reading = queue_depth(engine, Task)  # one statement: counts, oldest runnable age, dead tuples
    for count in reading.counts:
        print(count.queue, count.status, count.jobs, count.oldest_runnable_seconds)
    statement = sql.queue_depth(Task)  # the same as a Core statement, for your own exporter or Grafana
    # --8<-- [end:depth]
    with engine.connect() as conn:
        rows = conn.execute(statement).all()
        assert conn.scalar(text("SELECT count(*) FROM tasks WHERE status = 'done'")) == 2
    assert reading.table == "tasks" and reading.dead_tuples >= 0
    print(f"depth: {reading.as_dict()}; {len(rows)} row(s) from the builder")
    # The page's SQL for Grafana, grafana_queries.sql, as written there.
    queries = Path(__file__).with_name("grafana_queries.sql").read_text()
    with engine.connect() as conn:  # one pending job, rolled back afterwards
        conn.execute(insert(Task).values(task="charge", payload={}, queue="grafana"))
        pending, vacuum = (conn.exec_driver_sql(q).all() for q in queries.split(";") if q.strip(" \n"))
        conn.rollback()
    assert [(row.queue, row.pending) for row in pending] == [("grafana", 1)], pending
    assert pending[0].oldest_runnable_seconds >= 0 and len(vacuum) == 1, (pending, vacuum)
    print(f"grafana queries: {[tuple(row) for row in pending]}, {vacuum[0].n_dead_tup} dead tuples")


def autovacuum(engine: Any) -> None:
    # --8<-- [start:autovacuum]
    # Vacuum the queue table after 10,000 dead rows, not after a fifth of the table, and
    # without the cost pauses (in an Alembic migration: op.execute() of the same text).
    with engine.begin() as conn:
        conn.execute(text(
            "ALTER TABLE tasks SET (autovacuum_vacuum_scale_factor = 0, "
            "autovacuum_vacuum_threshold = 10000, autovacuum_vacuum_cost_delay = 0)"
        ))
    # --8<-- [end:autovacuum]
    with engine.connect() as conn:
        options = conn.scalar(text("SELECT reloptions FROM pg_class WHERE oid = 'tasks'::regclass"))
    assert "autovacuum_vacuum_threshold=10000" in options, options
    print(f"autovacuum: {options}")


if __name__ == "__main__":
    with database_url() as url:
        main(url)
