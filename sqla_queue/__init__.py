"""sqla_queue: a durable PostgreSQL job queue in a table you own, for SQLAlchemy.

    class EmailJob(Base, JobMixin):          # your model, your columns
        __tablename__ = "email_jobs"

    session.enqueue(EmailJob(...))           # commits with your business writes
    session.enqueue(EmailJob(...), unique_key="invoice:42")  # or skipped: one job per key
    session.enqueue_many(EmailJob, rows)     # thousands at once, by COPY
    await enqueue_many(async_session, EmailJob, rows)   # the same from asyncio
    Worker(engine, EmailJob, handler).run()  # leases, retries, dead letter
    await AsyncWorker(async_engine, EmailJob, async_handler).run()  # the same on asyncio

Statement builders for every transition live in :mod:`sqla_queue.sql`.
"""

from .activity import activity_table
from .cancel import cancel
from .current import JobContext, JobLogFilter, current_job
from .enqueue import (
    AsyncQueueSession,
    Enqueued,
    EnqueuedMany,
    QueueSession,
    Workflow,
    enqueue,
    enqueue_many,
    enqueue_values,
    enqueue_workflow,
    notify_on_commit,
)
from .enqueue import waker as waker  # kept: ``sqla_queue.waker.flush()``, as documented before the move
from .errors import (
    BulkRowError,
    DeadLetter,
    EnqueueError,
    InvalidPayload,
    JobCancelled,
    JobCancelledError,
    JobFailedError,
    JobNotDoneError,
    LeaseLost,
    NoSuchJob,
    NotAQueueModel,
    QueuesTableNotDeclared,
    ResultNotReady,
    ResultNotStorable,
    ResultTimeout,
    RetryLater,
    Snooze,
    SqlaQueueError,
    TaskArgumentError,
    UnknownTask,
)
from .flow import queues_table
from .group import AsyncWorkers, Workers
from .model import (
    FINISHED_STATUSES,
    UNIQUE_ACTIVE,
    UNIQUE_EVER,
    HistoryMixin,
    IdempotencyKeyMixin,
    JobMixin,
    JobStatus,
    ResultMixin,
    TaskMixin,
    UniqueJobs,
    WorkflowMixin,
    archive_table,
    queue_table,
)
from .pause import pause, resume, set_queue_limits
from .periodic import Schedule, schedules_table
from .registry import workers_table
from .results import parent_counts, parent_results, result, wait_for_result
from .rules import Concurrency, InOrder, RateLimit
from .sql import Backoff, ClaimToken
from .task_functions import TaskFunction, Tasks
from .worker import JobEvent, JobOutcome, Worker, WorkerConfig, WorkerObserver, WorkerStartError, WorkerStats
from .worker.aio import AsyncWorker

__all__ = [
    "AsyncQueueSession",
    "AsyncWorker",
    "AsyncWorkers",
    "FINISHED_STATUSES",
    "Backoff",
    "BulkRowError",
    "ClaimToken",
    "Concurrency",
    "DeadLetter",
    "EnqueueError",
    "Enqueued",
    "EnqueuedMany",
    "HistoryMixin",
    "IdempotencyKeyMixin",
    "InOrder",
    "InvalidPayload",
    "JobCancelled",
    "JobCancelledError",
    "JobContext",
    "JobEvent",
    "JobFailedError",
    "JobLogFilter",
    "JobMixin",
    "JobNotDoneError",
    "JobOutcome",
    "JobStatus",
    "LeaseLost",
    "NoSuchJob",
    "NotAQueueModel",
    "QueueSession",
    "QueuesTableNotDeclared",
    "RateLimit",
    "ResultMixin",
    "Workflow",
    "WorkflowMixin",
    "ResultNotReady",
    "ResultNotStorable",
    "ResultTimeout",
    "RetryLater",
    "Snooze",
    "Schedule",
    "SqlaQueueError",
    "TaskArgumentError",
    "TaskFunction",
    "TaskMixin",
    "Tasks",
    "UNIQUE_ACTIVE",
    "UNIQUE_EVER",
    "UniqueJobs",
    "UnknownTask",
    "Worker",
    "WorkerConfig",
    "WorkerObserver",
    "WorkerStartError",
    "WorkerStats",
    "Workers",
    "activity_table",
    "archive_table",
    "cancel",
    "current_job",
    "enqueue",
    "enqueue_many",
    "enqueue_values",
    "enqueue_workflow",
    "parent_counts",
    "parent_results",
    "notify_on_commit",
    "pause",
    "queue_table",
    "queues_table",
    "result",
    "resume",
    "set_queue_limits",
    "schedules_table",
    "wait_for_result",
    "workers_table",
]

__version__ = "0.1.0"


def _prometheus_exporter(port: int, engine: object, model: object) -> object:
    """The exporter of a worker's ``metrics_port``: the Prometheus plugin's, imported only
    when a worker asks for it (the ``prometheus`` extra). Built here, above the worker,
    which takes its observer and knows no metrics library."""
    from .prometheus import worker_metrics

    return worker_metrics(port, engine, model)


Worker.metrics_exporter = _prometheus_exporter
