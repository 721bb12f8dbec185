"""OpenTelemetry tracing of job runs (the ``otel`` extra).

Enqueuing needs nothing of this module: when a span is recording, every enqueue path
stores its context on the job's row (``trace_context``, see :mod:`sqla_queue.tracing`).
On the worker side, :class:`TracingObserver` makes one span per run of a handler, named
``sqla_queue.job <task or table>``, of kind CONSUMER, from the handler's start to its end,
with the job's table, queue, task, id, attempt, outcome and pickup latency as attributes,
and a link to the enqueuing span when the row carries its context: in whatever process
the job was enqueued, the trace of the request shows the job it queued, and the job's
span the request that queued it.

The span is recorded after the run, on the worker's observer thread (a tracing backend
that is slow or down never slows the jobs), with the run's real start and end times. So
it is not the current span while the handler runs: to make the handler's own spans its
children, start one in ``job_context=`` instead, or use the link.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode, TracerProvider

from .worker.hooks import JobEvent, JobOutcome, WorkerObserver

__all__ = ["TracingObserver"]

#: The outcomes whose span is marked as an error.
_ERRORS = frozenset({JobOutcome.RETRIED, JobOutcome.FAILED, JobOutcome.LOST})


class TracingObserver(WorkerObserver):
    """One span per job run; pass it in a worker's ``observers=``. ``tracer_provider``:
    default, the global one (``opentelemetry.trace.set_tracer_provider``)."""

    def __init__(self, tracer_provider: TracerProvider | None = None) -> None:
        from . import __version__

        self.tracer = trace.get_tracer("sqla_queue", __version__, tracer_provider=tracer_provider)

    def finished(self, event: JobEvent) -> None:
        started, run_time = event.started_at, event.run_time
        if started is None or run_time is None or event.outcome is None:
            return  # never ran here (a sweep of another worker's job, a hand-back of an unstarted one)
        outcome = event.outcome
        attributes: dict[str, Any] = {
            "messaging.system": "sqla_queue",
            "messaging.operation.type": "process",
            "messaging.destination.name": event.queue or "",
            "sqla_queue.table": event.table,
            "sqla_queue.queue": event.queue or "",
            "sqla_queue.job_id": str(event.job_id),
            "sqla_queue.attempt": event.attempt or 0,
            "sqla_queue.outcome": outcome.value,
        }
        if event.task is not None:
            attributes["sqla_queue.task"] = event.task
        latency = event.pickup_latency
        if latency is not None:
            attributes["sqla_queue.pickup_latency"] = latency
        links = _links(event.trace_context)
        start_ns = int(started * 1e9)
        span = self.tracer.start_span(
            f"sqla_queue.job {event.task or event.table}", kind=SpanKind.CONSUMER, start_time=start_ns,
            attributes=attributes, links=links,
        )
        if outcome in _ERRORS:
            span.set_status(Status(StatusCode.ERROR, event.error or outcome.value))
        span.end(end_time=start_ns + int(run_time * 1e9))


def _links(carrier: Any) -> list[Link]:
    """A link to the span whose context ``carrier`` (the row's ``trace_context``) holds."""
    if not isinstance(carrier, dict) or not carrier:
        return []
    context = trace.get_current_span(propagate.extract(carrier)).get_span_context()
    return [Link(context)] if context.is_valid else []
