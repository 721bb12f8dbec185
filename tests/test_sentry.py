"""``SentryObserver``: failed attempts and dead letters reported to Sentry with the job's
table, id, task, attempt and queue, through Sentry's own client with its transport
replaced by an in-memory one; and a Sentry that never answers delays no job."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sentry_sdk
from sentry_sdk.transport import Transport
from sqlalchemy import Engine, insert

from sqla_queue import Tasks
from sqla_queue.sentry import SentryObserver

from .helpers import table_of, wait_for, wait_for_counts
from .models import Task

TASKS = table_of(Task)
tasks = Tasks()


@tasks.task
def once(job: Any) -> None:
    if job.attempts == 1:
        raise ValueError(f"first attempt of {job.payload['n']}")


@tasks.task
def never(job: Any) -> None:
    raise KeyError("no such account")


@tasks.task
def fine(job: Any) -> None:
    return None


class Kept(Transport):
    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self.events: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def capture_envelope(self, envelope: Any) -> None:
        with self.lock:
            self.events.extend(item.payload.json for item in envelope.items if item.payload.json)


@pytest.fixture
def kept() -> Iterator[Kept]:
    transport = Kept()
    sentry_sdk.init(dsn="https://key@sentry.example.com/1", transport=transport, default_integrations=False,
                    release="tests")  # a release given: no `git` process to find one
    try:
        yield transport
    finally:
        sentry_sdk.get_client().close()
        sentry_sdk.init(default_integrations=False)  # no DSN: a client that sends nothing


def add(engine: Engine, *rows: dict[str, Any]) -> list[int]:
    with engine.begin() as conn:
        return list(conn.scalars(insert(TASKS).returning(TASKS.c.id, sort_by_parameter_order=True), list(rows)))


def test_failed_attempts_and_dead_letters_are_events_with_the_job(
    engine: Engine, start_worker: Callable[..., Any], kept: Kept
) -> None:
    retried, dead, _ = add(engine, {"task": "once", "payload": {"n": 1}, "queue": "q1", "max_attempts": 3},
                           {"task": "never", "payload": {}, "queue": "q2", "max_attempts": 1},
                           {"task": "fine", "payload": {}, "queue": "q3", "max_attempts": 3})
    worker = start_worker(tasks, Task, observers=[SentryObserver()])
    wait_for_counts(worker, done=2, retried=1, failed=1)
    wait_for(lambda: len(kept.events) == 3, timeout=20)
    by = {(e["tags"]["sqla_queue.event"], e["contexts"]["sqla_queue job"]["id"]): e for e in kept.events}
    assert set(by) == {("attempt", str(retried)), ("attempt", str(dead)), ("dead letter", str(dead))}
    first = by["attempt", str(retried)]
    assert first["level"] == "warning" and first["message"] == "once: builtins.ValueError: first attempt of 1"
    assert first["contexts"]["sqla_queue job"] | {"worker": "", "run_time": 0} == {
        "table": "tasks", "id": str(retried), "task": "once", "queue": "q1", "attempt": 1, "outcome": "retried",
        "worker": "", "run_time": 0, "retry_in": first["contexts"]["sqla_queue job"]["retry_in"]}
    assert first["tags"] == {"sqla_queue.table": "tasks", "sqla_queue.queue": "q1", "sqla_queue.task": "once",
                             "sqla_queue.event": "attempt"}
    assert first["fingerprint"] == ["sqla_queue", "attempt", "tasks", "once", "builtins.ValueError"]
    assert "Traceback" in first["contexts"]["sqla_queue error"]["text"]
    letter = by["dead letter", str(dead)]
    assert letter["level"] == "error" and letter["message"].startswith(f"job {dead} of tasks dead-lettered (never): ")
    assert letter["fingerprint"] == ["sqla_queue", "dead letter", "tasks", "never"]
    assert by["attempt", str(dead)]["level"] == "error"


def test_attempts_false_reports_only_dead_letters_and_their_last_attempt(
    engine: Engine, start_worker: Callable[..., Any], kept: Kept
) -> None:
    add(engine, {"task": "once", "payload": {"n": 1}, "max_attempts": 3},
        {"task": "never", "payload": {}, "max_attempts": 1})
    worker = start_worker(tasks, Task, observers=[SentryObserver(attempts=False)])
    wait_for_counts(worker, done=1, retried=1, failed=1)
    wait_for(lambda: len(kept.events) == 2, timeout=20)
    assert sorted(e["tags"]["sqla_queue.event"] for e in kept.events) == ["attempt", "dead letter"]
    assert {e["tags"]["sqla_queue.task"] for e in kept.events} == {"never"}


@pytest.fixture
def black_hole() -> Iterator[int]:
    """A port that accepts connections and never answers: Sentry's servers, unreachable."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1000)
    try:
        yield server.getsockname()[1]
    finally:
        server.close()


@pytest.mark.system  # Sentry's HTTP transport, on its first use, may start a process (ldconfig)
def test_a_sentry_that_never_answers_delays_no_job(
    engine: Engine, start_worker: Callable[..., Any], black_hole: int
) -> None:
    """Each event to a server that never answers would hold a sender for its timeout:
    200 dead letters report 400 events, and the worker records them all the same, at once."""
    sentry_sdk.init(dsn=f"http://key@127.0.0.1:{black_hole}/1", default_integrations=False, release="tests")
    try:
        add(engine, *({"task": "never", "payload": {}, "max_attempts": 1} for _ in range(200)))
        began = time.monotonic()
        worker = start_worker(tasks, Task, observers=[SentryObserver()])
        wait_for_counts(worker, failed=200, timeout=60)
        assert worker.stats.hook_errors == 0
        stopping = time.monotonic()
        worker.stop(grace=1)
        # The observer's close flushes Sentry for 2 s at most; the drain is bounded too.
        assert time.monotonic() - stopping < 15, "stop waited on Sentry"
        assert time.monotonic() - began < 60
    finally:
        sentry_sdk.get_client().close(timeout=0)
        sentry_sdk.init(default_integrations=False)
