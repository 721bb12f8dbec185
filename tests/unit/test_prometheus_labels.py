"""Prometheus label values come from code (registered tasks, declared queues), never from
a row alone: whatever names are enqueued, the series stay bounded."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from sqla_queue import JobEvent, JobOutcome
from sqla_queue.prometheus import UNREGISTERED, Metrics


def _event(task: str | None, queue: str, outcome: JobOutcome | None = JobOutcome.DONE) -> JobEvent:
    return JobEvent("jobs", queue, task, 1, 1, outcome, run_time=0.01, started_at=1.0)


def _series(registry: CollectorRegistry) -> list[str]:
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if line.startswith("sqla_queue_") and "{" in line]


def test_unknown_task_and_queue_names_are_counted_under_one_label() -> None:
    registry = CollectorRegistry()
    m = Metrics(registry)
    m.declare(tasks=["send"], queues=["mail"])
    for n in range(2000):
        m.observer.claimed(_event(f"task{n}", f"queue{n}", None))
        m.observer.finished(_event(f"task{n}", f"queue{n}", JobOutcome.FAILED))
    m.observer.finished(_event("send", "mail"))
    m.observer.finished(_event("send", "default"))  # the default queue needs no declaring
    series = _series(registry)
    assert not [line for line in series if "task1" in line or "queue1" in line]
    jobs = m.jobs.labels("jobs", UNREGISTERED, UNREGISTERED, "failed")._value.get()
    assert jobs == 2000
    assert m.claimed.labels("jobs", UNREGISTERED, UNREGISTERED)._value.get() == 2000
    assert m.jobs.labels("jobs", "mail", "send", "done")._value.get() == 1
    assert m.jobs.labels("jobs", "default", "send", "done")._value.get() == 1
    # Every series of the whole scrape: a bounded handful, not one per name read.
    assert len(series) < 150, len(series)


def test_a_table_without_tasks_keeps_an_empty_task_label() -> None:
    m = Metrics(CollectorRegistry())
    assert (m.task_label(None), m.queue_label("default"), m.queue_label("other")) == ("", "default", UNREGISTERED)


def test_declarations_add_up_and_are_checked() -> None:
    m = Metrics(CollectorRegistry())
    m.declare(tasks=["a"])
    m.declare(tasks=["b"], queues=("q",))
    assert [m.task_label(t) for t in ("a", "b", "c")] == ["a", "b", UNREGISTERED]
    assert m.queue_label("q") == "q"
    with pytest.raises(TypeError, match="not a single string"):
        m.declare(queues="mail")
    with pytest.raises(TypeError, match="names"):
        m.declare(tasks=[1])  # type: ignore[list-item]
