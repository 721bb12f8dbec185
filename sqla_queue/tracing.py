"""The trace context of the code that enqueues a job, stored on its row.

When OpenTelemetry is in use (its API imported and a span recording), every enqueue
path stores the current context (the W3C ``traceparent``, and ``tracestate`` or baggage
if any, as the global propagator writes them) in the job's ``trace_context`` column, so
the job's span (:mod:`sqla_queue.otel`) links to the request that enqueued it, in
whatever process runs it. Without OpenTelemetry it costs one dictionary look-up per call
(``sys.modules``): nothing is imported, nothing is written.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["TRACE_COLUMN", "current_trace_context"]

#: The column :class:`~sqla_queue.JobMixin` adds for it.
TRACE_COLUMN = "trace_context"


def current_trace_context() -> dict[str, str] | None:
    """The current OpenTelemetry context as a propagation carrier, or None when
    OpenTelemetry is not imported or no valid span is current."""
    trace: Any = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return None
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier or None
