"""Error reporting to Sentry: a worker observer (the ``sentry`` extra,
``pip install 'sqla-queue[sentry]'``).

:class:`SentryObserver` reports each failed attempt of a job (retried, timed out, or its
last) as a Sentry event with the job's table, id, task, attempt and queue, and each dead
letter as an event of its own, at level ``error``. Pass it to a worker
(``observers=[SentryObserver()]``) in a process where ``sentry_sdk.init(...)`` ran: it
reports through the current Sentry client, and reports nothing without one.

It runs on the worker's observer thread, as every observer does: Sentry's client queues
what it sends and sends it from a thread of its own, so a Sentry that is slow or
unreachable never delays a job, and an error of the observer is counted and logged by the
worker, never seen by job processing.
"""

from __future__ import annotations

from typing import Any, Final

import sentry_sdk

from .worker.hooks import JobEvent, JobOutcome, WorkerObserver

__all__ = ["SentryObserver"]

#: The most characters of a job's error an event carries (the message is its first line).
ERROR_TEXT: Final = 4000


class SentryObserver(WorkerObserver):
    """Reports failed attempts and dead letters to Sentry (see the module's docstring).

    ``attempts``: also report attempts that will be retried (default True); False reports
    only the last attempt of each dead letter and the dead letter itself. Events are
    grouped by table, task (or queue) and exception type, whatever the message says.
    """

    def __init__(self, *, attempts: bool = True) -> None:
        self.attempts = attempts

    def finished(self, event: JobEvent) -> None:
        outcome = event.outcome
        if outcome is JobOutcome.FAILED:
            self._report(event, "attempt", "error")
            self._report(event, "dead letter", "error")
        elif outcome is JobOutcome.RETRIED and self.attempts:
            self._report(event, "attempt", "warning")

    def close(self) -> None:
        sentry_sdk.flush(timeout=2.0)

    def _report(self, event: JobEvent, kind: str, level: str) -> None:
        what = event.task or event.queue or event.table
        error = event.error or "no error text"
        kind_of_error = error.split(":", 1)[0]
        with sentry_sdk.new_scope() as scope:
            scope.set_tag("sqla_queue.table", event.table)
            scope.set_tag("sqla_queue.queue", event.queue or "")
            if event.task is not None:
                scope.set_tag("sqla_queue.task", event.task)
            scope.set_tag("sqla_queue.event", kind)
            scope.set_context("sqla_queue job", _job(event))
            if event.detail:
                scope.set_context("sqla_queue error", {"text": event.detail[:ERROR_TEXT]})
            if kind == "dead letter":
                scope.fingerprint = ["sqla_queue", "dead letter", event.table, what]
                message = f"job {event.job_id} of {event.table} dead-lettered ({what}): {error}"
            else:
                scope.fingerprint = ["sqla_queue", "attempt", event.table, what, kind_of_error]
                message = f"{what}: {error}"
            sentry_sdk.capture_message(message, level=level)  # type: ignore[arg-type]


def _job(event: JobEvent) -> dict[str, Any]:
    return {
        "table": event.table,
        "id": str(event.job_id),
        "task": event.task,
        "queue": event.queue,
        "attempt": event.attempt,
        "outcome": event.outcome.value if event.outcome is not None else None,
        "worker": event.worker,
        "run_time": event.run_time,
        "retry_in": event.delay,
    }
