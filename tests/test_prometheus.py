"""Prometheus metrics: a worker's exporter scraped over HTTP, and the queue gauges read at
most once per interval whatever the number of scrapes. Both runtimes, real PostgreSQL."""

from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, event, insert, text
from sqlalchemy.orm import sessionmaker

from sqla_queue import QueueSession, Worker
from sqla_queue.prometheus import Metrics, metrics

from .helpers import table_of, wait_for
from .models import Task
from .standby import free_port
from .workers import add

TASKS = table_of(Task)


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample the exporter on ``port`` serves: (name, labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        body = answer.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


def sample(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def test_a_worker_option_serves_job_metrics_over_http(
    engine: Engine, Sessions: sessionmaker[QueueSession], start_worker: Callable[..., Any]
) -> None:
    queue = f"q{uuid.uuid4().hex[:8]}"  # the default registry lives as long as the process
    add(Sessions, "work", 2, queue=queue)
    add(Sessions, "flaky", succeed_on=2, queue=queue)
    add(Sessions, "poison", queue=queue)
    port = free_port()
    start_worker(queues=[queue], metrics_port=port)

    def ended() -> Any:
        samples = scrape(port)
        jobs = {o: sample(samples, "sqla_queue_jobs_total", table="tasks", queue=queue, task=t, outcome=o)
                for t, o in (("work", "done"), ("flaky", "retried"), ("poison", "failed"))}
        flaky_done = sample(samples, "sqla_queue_jobs_total", table="tasks", queue=queue, task="flaky", outcome="done")
        return samples if jobs == {"done": 2.0, "retried": 1.0, "failed": 1.0} and flaky_done == 1.0 else None

    samples = wait_for(ended, what="the counters of every end")
    runs = sample(samples, "sqla_queue_job_run_seconds_count", table="tasks", queue=queue, task="work")
    assert runs == 2.0
    picked = sample(samples, "sqla_queue_job_pickup_latency_seconds_count", table="tasks", queue=queue)
    assert picked == 5.0  # every attempt that ran: 2 work, 2 flaky, 1 poison
    claimed = sample(samples, "sqla_queue_jobs_claimed_total", table="tasks", queue=queue, task="flaky")
    assert claimed == 2.0
    # The queue gauges of the worker's table, from the same exporter.
    assert sample(samples, "sqla_queue_depth_up", table="tasks") == 1.0
    assert sample(samples, "sqla_queue_dead_tuples", table="tasks") is not None


def test_the_metrics_port_is_checked(engine: Engine) -> None:
    with pytest.raises(ValueError, match="metrics_port"):
        Worker(engine, Task, lambda job: None, metrics_port=70000)
    with pytest.raises(TypeError, match="metrics_port"):
        Worker(engine, Task, lambda job: None, metrics_port="9100")


@pytest.fixture
def served() -> Iterator[Callable[[CollectorRegistry], int]]:
    """``serve(registry)``: an exporter of the test's own on a free port, shut after it."""
    servers: list[Any] = []

    def serve(registry: CollectorRegistry) -> int:
        port = free_port()
        servers.append(start_http_server(port, addr="127.0.0.1", registry=registry))
        return port

    yield serve
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_the_gauges_cost_one_query_per_interval(
    engine: Engine, served: Callable[[CollectorRegistry], int]
) -> None:
    """Scraped three times within the interval: one reading; after it, a new one. The
    values: pending and running per queue, the oldest runnable age, dead tuples."""
    with engine.begin() as conn:
        conn.execute(insert(TASKS), [{"task": "work", "queue": "a"}] * 3 + [{"task": "work", "queue": "b"}])
        conn.execute(text("UPDATE tasks SET run_after = now() - interval '90 seconds' WHERE queue = 'a'"))
        conn.execute(insert(TASKS).values(task="work", queue="b", status="running", lease_owner="w", attempts=1,
                                          lease_expires_at=text("now() + interval '1 minute'")))
        conn.execute(insert(TASKS).values(task="work", queue="b", run_after=text("now() + interval '1 hour'")))
        # Queues no one declared: one label for them all, whatever their number.
        conn.execute(insert(TASKS), [{"task": "work", "queue": f"x{n}"} for n in range(300)])
        conn.execute(text("UPDATE tasks SET run_after = now() - interval '30 seconds' WHERE queue = 'x7'"))
    readings: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "pg_stat_user_tables" in statement:
            readings.append(statement)

    event.listen(engine, "before_cursor_execute", count)
    try:
        registry = CollectorRegistry()
        m = Metrics(registry, interval=60)
        m.declare(queues=["a", "b"])
        m.watch(engine, Task)
        port = served(registry)
        samples = [scrape(port) for _ in range(3)]
        assert len(readings) == 1
        s = samples[-1]
        assert sample(s, "sqla_queue_queue_jobs", table="tasks", queue="a", status="pending") == 3.0
        assert sample(s, "sqla_queue_queue_jobs", table="tasks", queue="b", status="pending") == 2.0
        assert sample(s, "sqla_queue_queue_jobs", table="tasks", queue="b", status="running") == 1.0
        age = sample(s, "sqla_queue_oldest_runnable_seconds", table="tasks", queue="a")
        assert age is not None and 89 < age < 150
        later = sample(s, "sqla_queue_oldest_runnable_seconds", table="tasks", queue="b")
        assert later is not None and 0 <= later < 60  # the delayed job is not runnable
        assert sample(s, "sqla_queue_dead_tuples", table="tasks") is not None
        assert sample(s, "sqla_queue_queue_jobs", table="tasks", queue="unregistered", status="pending") == 300.0
        unregistered_age = sample(s, "sqla_queue_oldest_runnable_seconds", table="tasks", queue="unregistered")
        assert unregistered_age is not None and 29 < unregistered_age < 90  # the oldest of them
        assert not [k for k in s if dict(k[1]).get("queue", "").startswith("x")]
        m.collector.interval = 0.0  # the interval is over: the next scrape reads again
        scrape(port)
        assert len(readings) == 2
    finally:
        event.remove(engine, "before_cursor_execute", count)


def test_a_reading_that_fails_is_no_failed_scrape(served: Callable[[CollectorRegistry], int]) -> None:
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    nowhere = create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none", poolclass=NullPool)
    registry = CollectorRegistry()
    Metrics(registry).watch(nowhere, Task)
    samples = scrape(served(registry))
    assert sample(samples, "sqla_queue_depth_up", table="tasks") == 0.0


def test_one_metrics_per_registry() -> None:
    registry = CollectorRegistry()
    assert metrics(registry) is metrics(registry)
    assert metrics() is metrics()


def test_the_command_line_flag_starts_the_exporter_of_a_worker_process(
    engine: Engine, Sessions: sessionmaker[QueueSession], worker_processes: Callable[..., Any]
) -> None:
    """``sqla-queue worker --metrics-port N`` in a process of its own (either runtime):
    scraped from here, it counts the jobs it ran."""
    queue = f"q{uuid.uuid4().hex[:8]}"
    add(Sessions, "work", 3, queue=queue)
    _add_unknown(Sessions, 40, queue)
    port = free_port()
    worker = worker_processes("--metrics-port", str(port), "--queue", queue, "--poll-interval", "0.5s")

    def counted() -> Any:
        try:
            samples = scrape(port)
        except OSError:
            return None  # not listening yet
        done = sample(samples, "sqla_queue_jobs_total", table="tasks", queue=queue, task="work", outcome="done")
        failed = sample(samples, "sqla_queue_jobs_total", table="tasks", queue=queue, task="unregistered",
                        outcome="failed")
        return samples if done == 3.0 and failed == 40.0 else None

    samples = wait_for(counted, timeout=30, what=f"3 done jobs on the exporter\n{worker.log_path}")
    assert sample(samples, "sqla_queue_depth_up", table="tasks") == 1.0
    assert not _labelled_by_rows(samples)


def _add_unknown(Sessions: sessionmaker[QueueSession], n: int, queue: str) -> None:
    """``n`` jobs of as many task names no worker registered (they fail: unknown task)."""
    with Sessions() as session:
        for i in range(n):
            session.enqueue(Task(task=f"ghost{i}", payload={}), queue=queue, max_attempts=1)
        session.commit()


def _labelled_by_rows(samples: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> list[Any]:
    return [key for key in samples if dict(key[1]).get("task", "").startswith("ghost")]


def test_task_names_no_worker_registered_are_one_label(
    engine: Engine, Sessions: sessionmaker[QueueSession], start_worker: Callable[..., Any],
    served: Callable[[CollectorRegistry], int],
) -> None:
    """Jobs of 60 task names the worker does not know, and of its own ``work``: the
    scrape shows ``work`` and ``unregistered``, not one series per name read."""
    queue = f"q{uuid.uuid4().hex[:8]}"
    registry = CollectorRegistry()
    m = Metrics(registry)
    port = served(registry)
    add(Sessions, "work", 2, queue=queue)
    _add_unknown(Sessions, 60, queue)
    start_worker(queues=[queue], observers=[m.observer])

    def counted() -> Any:
        samples = scrape(port)
        done = sample(samples, "sqla_queue_jobs_total", table="tasks", queue=queue, task="work", outcome="done")
        failed = sample(samples, "sqla_queue_jobs_total", table="tasks", queue=queue, task="unregistered",
                        outcome="failed")
        return samples if done == 2.0 and failed == 60.0 else None

    samples = wait_for(counted, what="the counters of the known and unknown tasks")
    assert sample(samples, "sqla_queue_jobs_claimed_total", table="tasks", queue=queue, task="unregistered") == 60.0
    assert sample(samples, "sqla_queue_job_run_seconds_count", table="tasks", queue=queue,
                  task="unregistered") == 60.0
    assert not _labelled_by_rows(samples)
