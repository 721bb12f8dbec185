"""A registered task enqueued from its own function: ``send.enqueue(session, to=...)``,
its arguments checked against the function's signature before anything is written, on
a ``Session``, a ``QueueSession`` and an ``AsyncQueueSession``, then run by a worker
that passes the payload back as the same keywords. Against real PostgreSQL.

The wrong calls carry ``# type: ignore[...]``: mypy (strict, with unused ignores
reported) refuses each of them at the call site, which these ignores prove.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker

from sqla_queue import (
    AsyncQueueSession,
    EnqueueError,
    InvalidPayload,
    NotAQueueModel,
    QueueSession,
    TaskArgumentError,
    Tasks,
    Worker,
)
from sqla_queue.testing import arun_until_idle, run_until_idle

from .helpers import Server
from .models import Effect, EmailJob, Order, ResultTask, Task

tasks = Tasks(Task)


@tasks.task
def send(job: Task, *, to: str, subject: str = "(none)") -> None:
    """Takes its payload as keywords: the worker passes them."""
    assert job.payload["to"] == to


@tasks.task(name="billing.charge")
def charge(job: Task, session: Session, *, order_id: int, amount: int) -> None:
    """Transactional, with payload keywords after the session."""
    session.add(Effect(job_id=job.id, worker="charge", note=f"order {order_id}: {amount}"))


@tasks.task
def flexible(job: Task, session: Session, /, **payload: Any) -> None:
    """``**payload``: any keyword is a payload key, ``job`` too (the job is positional-only)."""
    session.add(Effect(job_id=job.id, worker="flexible", note=",".join(f"{k}={v}" for k, v in sorted(payload.items()))))


def _loose(job: Task, **payload: Any) -> None:
    """A payload key ``job`` would reach its job parameter too."""


# mypy refuses it (a payload keyword could name the job), and enqueue() the clashing key.
loose: Any = tasks.task(_loose)  # type: ignore[arg-type]


@tasks.task
def classic(job: Task) -> None:
    """Reads ``job.payload`` itself: it takes no payload keywords."""


@tasks.task
def routed(job: Task, session: Session, *, queue: str, priority: int) -> None:
    """Payload keys named as enqueue options: the options live apart."""
    session.add(Effect(job_id=job.id, worker="routed", note=f"{queue} {priority}"))


async_tasks = Tasks(Task)


@async_tasks.task(name="send")
async def send_async(job: Task, session: AsyncSession, *, to: str, subject: str = "(none)") -> None:
    session.add(Effect(job_id=job.id, worker="send_async", note=f"{to} {subject}"))


def jobs(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(Task).order_by(Task.id)).all())


def effects(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return sorted(conn.scalars(select(Effect.note)))


def count(engine: Engine, model: Any) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(model)) or 0)


@pytest.mark.parametrize("kind", [Session, QueueSession])
def test_enqueued_from_its_function_and_run_with_its_payload_as_keywords(engine: Engine, kind: type[Session]) -> None:
    with sessionmaker(engine, class_=kind, expire_on_commit=False)() as session:
        order = Order(customer="ada")
        session.add(order)
        session.flush()
        job = send.enqueue(session, to="ada@example.com")
        assert isinstance(job, Task) and job in session.new  # added, not yet written
        charge.enqueue(session, order_id=order.id, amount=30)
        flexible.enqueue(session, a=1, b="two", job="j")
        session.commit()
        assert (job.task, job.payload, job.queue) == ("send", {"to": "ada@example.com"}, "default")
    # Only the keywords given are stored: the default applies when it runs.
    assert [(row.task, row.payload) for row in jobs(engine)] == [
        ("send", {"to": "ada@example.com"}),
        ("billing.charge", {"order_id": order.id, "amount": 30}),
        ("flexible", {"a": 1, "b": "two", "job": "j"}),
    ]
    stats = run_until_idle(engine, Task, tasks)
    assert (stats.done, stats.failed, stats.retried) == (3, 0, 0)
    assert effects(engine) == ["a=1,b=two,job=j", f"order {order.id}: 30"]


def refused_calls() -> list[tuple[str, Callable[[Session], Any], type[Exception], str]]:
    return [
        ("missing", lambda s: send.enqueue(s), TaskArgumentError,  # type: ignore[call-overload]
         "missing a required argument: 'to'"),
        ("extra", lambda s: send.enqueue(s, to="a@example.com", cc="b@example.com"),  # type: ignore[call-overload]
         TaskArgumentError, "unexpected keyword argument 'cc'"),
        ("positional", lambda s: send.enqueue(s, "a@example.com"),  # type: ignore[call-overload]
         TaskArgumentError, "given by keyword"),
        ("none declared", lambda s: classic.enqueue(s, w=640),  # type: ignore[call-overload]
         TaskArgumentError, "takes no payload arguments"),
        ("the job twice", lambda s: loose.enqueue(s, job=1), TaskArgumentError,
         "'job' names a positional parameter"),
        ("not JSON", lambda s: send.enqueue(s, to=b"bytes"),  # type: ignore[call-overload]
         InvalidPayload, "payload"),
        ("bad option", lambda s: send.with_options(priority=2**40).enqueue(s, to="a@example.com"),
         EnqueueError, "priority"),
        ("both times", lambda s: send.with_options(delay=5, run_at=None, max_attempts=0).enqueue(s, to="x"),
         EnqueueError, "max_attempts"),
        ("no model", lambda s: Tasks().task(classic.fn).enqueue(s), NotAQueueModel, r"Tasks\(MyTask\)"),
    ]


@pytest.mark.parametrize(("why", "call", "error", "message"), refused_calls(),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_a_refused_call_leaves_the_session_untouched(
    engine: Engine, why: str, call: Callable[[Session], Any], error: type[Exception], message: str
) -> None:
    with sessionmaker(engine, class_=QueueSession, expire_on_commit=False)() as session:
        session.add(Order(customer="ada"))
        session.flush()
        before = (set(session.new), set(session.dirty))
        with pytest.raises(error, match=message) as raised:
            call(session)
        assert (set(session.new), set(session.dirty)) == before
        session.commit()  # the caller's transaction goes on
    if error is TaskArgumentError:
        assert isinstance(raised.value, TypeError) and isinstance(raised.value, EnqueueError)
    assert (count(engine, Order), count(engine, Task)) == (1, 0)


def test_options_are_given_apart_from_the_payload(engine: Engine) -> None:
    urgent = routed.with_options(queue="fast", priority=9, max_attempts=2, timeout=timedelta(seconds=30))
    with sessionmaker(engine, class_=QueueSession, expire_on_commit=False)() as session:
        job = urgent.enqueue(session, queue="payload queue", priority=1)
        later = routed.with_options(delay=3600).enqueue(session, queue="q", priority=0)
        first = send.with_options(unique_key="mail:ada").enqueue(session, to="ada@example.com")
        again = send.with_options(unique_key="mail:ada").enqueue(session, to="ada@example.com")
        session.commit()
        assert (job.queue, job.priority, job.max_attempts, job.timeout) == ("fast", 9, 2, 30.0)
        assert job.payload == {"queue": "payload queue", "priority": 1}
        assert later.run_after > job.run_after + timedelta(minutes=59)
    assert first.inserted and first.job is not None and first.job.task == "send"
    assert again.skipped and again.job_id == first.job_id
    assert count(engine, Task) == 3
    stats = run_until_idle(engine, Task, tasks, queues=("fast",))
    assert stats.done == 1 and effects(engine) == ["payload queue 1"]


def test_an_async_session_awaits_it_and_an_async_worker_runs_it(engine: Engine, server: Server) -> None:
    async def body() -> tuple[Any, Any, Any]:
        async_engine = create_async_engine(server.url.set(drivername="postgresql+psycopg"))
        try:
            async with async_sessionmaker(async_engine, class_=AsyncQueueSession, expire_on_commit=False)() as session:
                job = await send_async.enqueue(session, to="ada@example.com", subject="hi")
                added = send_async.enqueue(session, to="bo@example.com")  # added at once: the await hands it back
                with pytest.raises(TaskArgumentError, match="missing a required argument: 'to'"):
                    send_async.enqueue(session, subject="no one")  # type: ignore[call-overload]
                keyed = send_async.with_options(unique_key="k", queue="mail")
                first = await keyed.enqueue(session, to="cy@example.com")
                again = await keyed.enqueue(session, to="cy@example.com")
                assert (await added).payload == {"to": "bo@example.com"}
                await session.commit()
            await arun_until_idle(async_engine, Task, async_tasks)
            return job, first, again
        finally:
            await async_engine.dispose()

    job, first, again = asyncio.run(body())
    assert job.payload == {"to": "ada@example.com", "subject": "hi"} and job.id is not None
    assert first.inserted and again.skipped and again.job_id == first.job_id and first.job.queue == "mail"
    assert [row.status for row in jobs(engine)] == ["done", "done", "done"]
    assert effects(engine) == ["ada@example.com hi", "bo@example.com (none)", "cy@example.com (none)"]


def test_a_payload_that_is_not_an_object_fails_the_job_saying_so(engine: Engine) -> None:
    with sessionmaker(engine, class_=QueueSession, expire_on_commit=False)() as session:
        session.enqueue(Task(task="send", payload=["ada@example.com"]), max_attempts=1)
        session.enqueue(Task(task="send", payload={"to": "ada@example.com", "bcc": "x"}), max_attempts=1)
        session.commit()
    stats = run_until_idle(engine, Task, tasks)
    assert stats.failed == 2
    errors = [row.last_error for row in jobs(engine)]
    assert "takes its payload as keyword arguments" in errors[0] and "not a JSON object: list" in errors[0]
    assert "unexpected keyword argument 'bcc'" in errors[1]


def test_a_worker_serves_the_table_its_registry_enqueues_into(engine: Engine) -> None:
    with pytest.raises(ValueError, match="enqueues into 'tasks', not into 'result_tasks'"):
        Worker(engine, ResultTask, tasks)
    with pytest.raises(NotAQueueModel, match="TaskMixin"):
        Tasks(EmailJob)
    Worker(engine, ResultTask, Tasks())  # a registry without a model serves any task table
