"""Prometheus metrics of workers and queue tables (the ``prometheus`` extra).

Two sources, one registry:

- **job metrics**, from a worker's :class:`~sqla_queue.WorkerObserver` (so on its
  observer thread, never on an executor): ``sqla_queue_jobs_total`` by table, queue,
  task and outcome, and the histograms ``sqla_queue_job_run_seconds`` and
  ``sqla_queue_job_pickup_latency_seconds``;
- **queue gauges**, read from the database by :class:`QueueCollector` when scraped:
  ``sqla_queue_queue_jobs`` per table, queue and status, ``sqla_queue_oldest_runnable_seconds``
  per queue, ``sqla_queue_dead_tuples`` per table. One statement per table
  (:func:`sqla_queue.sql.queue_depth`), cached for ``interval`` seconds: however often
  and by however many scrapers, the database sees at most one per interval.

A worker option starts an exporter (``metrics_port=9100``, or ``--metrics-port``); or mount
the registry in your own app (``prometheus_client.make_wsgi_app(registry)``, or the
default registry's ``/metrics`` route you already serve) with :func:`metrics` and
:meth:`Metrics.watch`.

Label values never come from row data alone: a task or queue name read from a row is a
label only when a worker registered the task (its :class:`~sqla_queue.Tasks`) or declared
the queue (its ``queues``, its schedules', the default queue, or :meth:`Metrics.declare`);
any other is counted under ``unregistered``. Rows are written by whoever can enqueue: a
label per distinct name would let them grow the series without bound (2,000 jobs of
unknown tasks made 48,046 series and a 4.7 MB scrape).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Engine, create_engine
from sqlalchemy.pool import NullPool

from . import admin
from .model import DEFAULT_QUEUE
from .worker.hooks import JobEvent, WorkerObserver

__all__ = ["UNREGISTERED", "Metrics", "PrometheusObserver", "QueueCollector", "metrics", "worker_metrics"]

log = logging.getLogger("sqla_queue.prometheus")

#: Run time buckets (seconds): from a fast handler to a long report.
RUN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0)
#: Pickup latency buckets (seconds): a NOTIFY's few milliseconds to a backlog of an hour.
PICKUP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
#: The label value of every task not registered and every queue not declared.
UNREGISTERED = "unregistered"


class QueueCollector(Collector):
    """The queue gauges of the tables :meth:`watch` was given, read at most once per
    ``interval`` seconds per table whatever the number of scrapes (the last reading is
    served meanwhile). A reading that fails is logged and its table left out of that
    scrape (``sqla_queue_depth_up`` says 0), never an error of the scrape.

    ``queue_label`` maps a queue name read from the table to its label value (a
    :class:`Metrics` passes :meth:`Metrics.queue_label`: undeclared queues are summed
    under ``unregistered``); None keeps every name, which only suits a table whose
    writers are all trusted."""

    def __init__(self, interval: float = 15.0, queue_label: Callable[[str], str] | None = None) -> None:
        self.interval = interval
        self.queue_label = queue_label
        self._lock = threading.Lock()
        #: table key -> (engine, model, statuses, last reading or None, when read (monotonic))
        self._tables: dict[tuple[str, str], list[Any]] = {}

    def watch(self, engine: Any, model: Any, *, statuses: Any = None) -> None:
        """Report ``model``'s table read through ``engine`` (a sync Engine). ``statuses``:
        those counted (default ``pending`` and ``running``, which have partial indexes)."""
        from .model import queue_table

        key = (engine.url.render_as_string(hide_password=True), queue_table(model).table.fullname)
        with self._lock:
            if key not in self._tables:
                self._tables[key] = [engine, model, statuses, None, float("-inf")]

    def _readings(self) -> list[tuple[str, admin.QueueDepth | None]]:
        with self._lock:  # one reader at a time: concurrent scrapes share one query
            found: list[tuple[str, admin.QueueDepth | None]] = []
            now = time.monotonic()
            for (_, name), entry in self._tables.items():
                engine, model, statuses, last, read_at = entry
                if last is None or now - read_at >= self.interval:
                    try:
                        kw = {} if statuses is None else {"statuses": statuses}
                        last = admin.queue_depth(engine, model, **kw)
                    except Exception as exc:  # noqa: BLE001 - a scrape never fails for it
                        log.warning("queue gauges of %s: %s: %s", name, type(exc).__name__, exc)
                        last = None
                    entry[3], entry[4] = last, now
                found.append((name, last))
            return found

    def collect(self) -> Iterator[Metric]:
        jobs = GaugeMetricFamily("sqla_queue_queue_jobs", "Jobs in the queue table, by queue and status",
                                 labels=["table", "queue", "status"])
        oldest = GaugeMetricFamily("sqla_queue_oldest_runnable_seconds",
                                   "Age of the oldest job that could run now (0: none waits)",
                                   labels=["table", "queue"])
        dead = GaugeMetricFamily("sqla_queue_dead_tuples", "Dead tuples of the queue table (pg_stat_user_tables)",
                                 labels=["table"])
        up = GaugeMetricFamily("sqla_queue_depth_up", "Whether the last reading of the queue table succeeded",
                               labels=["table"])
        label = self.queue_label
        for name, reading in self._readings():
            up.add_metric([name], 0.0 if reading is None else 1.0)
            if reading is None:
                continue
            dead.add_metric([name], float(reading.dead_tuples))
            counts: dict[tuple[str, str], float] = {}
            ages: dict[str, float] = {}
            for c in reading.counts:
                queue = c.queue if label is None else label(c.queue)
                counts[(queue, c.status)] = counts.get((queue, c.status), 0.0) + float(c.jobs)
                if c.status == "pending":  # several queues under one label: the oldest of them
                    ages[queue] = max(ages.get(queue, 0.0), c.oldest_runnable_seconds or 0.0)
            for (queue, status), n in counts.items():
                jobs.add_metric([reading.table, queue, status], n)
            for queue, age in ages.items():
                oldest.add_metric([reading.table, queue], age)
        yield from (jobs, oldest, dead, up)


class Metrics:
    """The metrics of one registry: the job counters and histograms, and the queue
    collector. Get it with :func:`metrics` (one per registry: the names are registered once)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY, *, interval: float = 15.0) -> None:
        self.registry = registry
        self.jobs = Counter("sqla_queue_jobs", "Job attempts ended, by outcome",
                            ["table", "queue", "task", "outcome"], registry=registry)
        self.claimed = Counter("sqla_queue_jobs_claimed", "Jobs claimed", ["table", "queue", "task"],
                               registry=registry)
        self.run_seconds = Histogram("sqla_queue_job_run_seconds", "Handler run time",
                                     ["table", "queue", "task"], buckets=RUN_BUCKETS, registry=registry)
        self.pickup_seconds = Histogram("sqla_queue_job_pickup_latency_seconds",
                                        "From when a job could run (run_after, else its enqueue) to its start",
                                        ["table", "queue"], buckets=PICKUP_BUCKETS, registry=registry)
        self._lock = threading.Lock()
        #: Label values allowed (replaced whole under the lock, read without it).
        self._tasks: frozenset[str] = frozenset()
        self._queues: frozenset[str] = frozenset({DEFAULT_QUEUE})
        self.collector = QueueCollector(interval, self.queue_label)
        registry.register(self.collector)
        self.observer = PrometheusObserver(self)

    def watch(self, engine: Any, model: Any, *, statuses: Any = None) -> None:
        """Report the queue gauges of ``model``'s table (see :class:`QueueCollector`)."""
        self.collector.watch(engine, model, statuses=statuses)

    def declare(self, *, tasks: Iterable[str] = (), queues: Iterable[str] = ()) -> None:
        """Let these task and queue names be label values. A worker declares its registered
        tasks and its queues itself; declare here the queues a worker over every queue
        serves, or those of a table you only :meth:`watch`. Names are code's, never a
        row's: the series stay bounded whatever is enqueued."""
        tasks, queues = _names("tasks", tasks), _names("queues", queues)
        with self._lock:
            self._tasks = self._tasks | tasks
            self._queues = self._queues | queues

    def task_label(self, task: str | None) -> str:
        """The label value of ``task``: itself when registered, else ``unregistered``
        (empty for a table without tasks)."""
        if task is None:
            return ""
        return task if task in self._tasks else UNREGISTERED

    def queue_label(self, queue: str | None) -> str:
        """The label value of ``queue``: itself when declared, else ``unregistered``."""
        if queue is None:
            return ""
        return queue if queue in self._queues else UNREGISTERED


class PrometheusObserver(WorkerObserver):
    """Counts and times jobs into a :class:`Metrics`: pass ``metrics().observer`` to a
    worker's ``observers=``."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def declare_labels(self, *, tasks: Iterable[str] = (), queues: Iterable[str] = ()) -> None:
        """A worker's registered tasks and its queues, told by the worker it observes:
        label values from now on (see :meth:`Metrics.declare`)."""
        self.metrics.declare(tasks=tasks, queues=queues)

    def claimed(self, event: JobEvent) -> None:
        m = self.metrics
        m.claimed.labels(event.table, m.queue_label(event.queue), m.task_label(event.task)).inc()

    def finished(self, event: JobEvent) -> None:
        m = self.metrics
        queue, task = m.queue_label(event.queue), m.task_label(event.task)
        outcome = event.outcome.value if event.outcome is not None else "lost"
        m.jobs.labels(event.table, queue, task, outcome).inc()
        if event.run_time is not None:
            m.run_seconds.labels(event.table, queue, task).observe(event.run_time)
        latency = event.pickup_latency
        if latency is not None:
            m.pickup_seconds.labels(event.table, queue).observe(max(latency, 0.0))


_lock = threading.Lock()
_by_registry: dict[int, Metrics] = {}
_exporters: dict[int, Any] = {}


def _names(what: str, names: Iterable[str]) -> frozenset[str]:
    if isinstance(names, str):
        raise TypeError(f"{what} must be a collection of names, not a single string")
    found = frozenset(names)
    for name in found:
        if not isinstance(name, str):
            raise TypeError(f"{what} must be names (str), got {name!r}")
    return found


def metrics(registry: CollectorRegistry | None = None) -> Metrics:
    """The :class:`Metrics` of ``registry`` (default: prometheus_client's global one),
    made on first use."""
    registry = REGISTRY if registry is None else registry
    with _lock:
        found = _by_registry.get(id(registry))
        if found is None or found.registry is not registry:
            found = _by_registry[id(registry)] = Metrics(registry)
        return found


class WorkerMetrics:
    """What a worker's ``metrics_port`` sets up: the default registry's metrics, its
    table watched, an exporter on the port (one per port in the process)."""

    def __init__(self, port: int, engine: Any, model: Any) -> None:
        self.port = port
        self.metrics = metrics()
        self.observer = self.metrics.observer
        self._engine, self._model = engine, model

    def start(self) -> None:
        self.metrics.watch(_sync_engine(self._engine), self._model)
        with _lock:
            if self.port not in _exporters:
                _exporters[self.port] = start_http_server(self.port, registry=self.metrics.registry)
                log.info("serving Prometheus metrics on port %d", self.port)


def _sync_engine(engine: Any) -> Engine:
    """A sync engine for the gauges: ``engine`` itself, or for an ``AsyncEngine`` one on its
    URL with psycopg (the scrape runs on the exporter's thread, outside any event loop),
    with the same execution options; it connects once per reading."""
    if isinstance(engine, Engine):
        return engine
    url = engine.url
    if url.get_backend_name() == "postgresql" and url.get_driver_name() != "psycopg":
        url = url.set(drivername="postgresql+psycopg")
    made = create_engine(url, poolclass=NullPool)
    options = engine.get_execution_options()
    return made.execution_options(**options) if options else made


def worker_metrics(port: int, engine: Any, model: Any) -> WorkerMetrics:
    """The metrics a worker with ``metrics_port=port`` reports (started with the worker)."""
    return WorkerMetrics(port, engine, model)
