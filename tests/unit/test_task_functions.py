"""What ``@tasks.task`` and ``@tasks.periodic`` return: the function, callable as
before, that can also enqueue; and the checks made when it is registered. Pure Python."""

from __future__ import annotations

import asyncio
import inspect
import sys
from typing import Any

import pytest
from sqlalchemy.orm import Session

from sqla_queue import TaskArgumentError, TaskFunction, Tasks
from sqla_queue.task_functions import PlainTaskFunction, TransactionalTaskFunction

from ..models import Task


def test_the_decorated_name_is_still_the_function() -> None:
    tasks = Tasks(Task)

    @tasks.task
    def send(job: Any, *, to: str) -> str:
        """Send one mail."""
        return f"{job} to {to}"

    @tasks.task(name="billing.charge")
    def charge(job: Any, session: Any, *, amount: int) -> int:
        return amount

    @tasks.task
    async def ping(job: Any) -> str:
        return f"pong {job}"

    assert send("j", to="ada") == "j to ada" and charge("j", None, amount=3) == 3
    assert asyncio.run(ping("j")) == "pong j"
    assert isinstance(send, PlainTaskFunction) and isinstance(charge, TransactionalTaskFunction)
    assert isinstance(send, TaskFunction) and (send.name, charge.name) == ("send", "billing.charge")
    assert (send.__name__, send.__doc__) == ("send", "Send one mail.")
    assert str(inspect.signature(send)) == "(job: 'Any', *, to: 'str') -> 'str'"
    if sys.version_info >= (3, 12):  # inspect.markcoroutinefunction
        assert inspect.iscoroutinefunction(ping)
    # The registry holds the function itself: the worker calls no wrapper of ours.
    assert tasks.lookup("billing.charge").function is charge.fn and tasks.lookup("ping").fn is ping.fn


def test_a_task_function_registered_again_is_its_function() -> None:
    first, second = Tasks(Task), Tasks()

    @first.task
    def work(job: Any) -> None: ...

    again = second.task(name="work.again")(work)
    assert again.registry is second and again.fn is work.fn and second.lookup("work.again").function is work.fn
    stacked = first.periodic("0 3 * * *")(work)  # the task registered already: kept
    assert stacked is work and [s.name for s in first.schedules] == ["work"]


def test_a_schedule_s_payload_is_checked_against_the_function() -> None:
    tasks = Tasks(Task)

    def report(job: Any, *, day: str) -> None: ...

    with pytest.raises(TaskArgumentError, match="missing a required argument: 'day'"):
        tasks.periodic("0 3 * * *")(report)
    assert "report" not in tasks and not tasks.schedules  # nothing registered
    tasks.periodic("0 3 * * *", payload={"day": "today"})(report)

    def legacy(job: Any) -> None:
        """Reads job.payload itself: a schedule's payload stays unchecked, as before."""

    tasks.periodic("0 4 * * *", payload={"anything": 1})(legacy)
    assert [s.name for s in tasks.schedules] == ["legacy", "report"]


def test_a_registry_without_a_model_registers_but_cannot_enqueue() -> None:
    tasks = Tasks()

    @tasks.task
    def work(job: Any) -> None: ...

    with pytest.raises(TypeError, match=r"give it the task table, tasks = Tasks\(MyTask\)"):
        work.enqueue(Session())
    assert work.payload() == {} and tasks.model is None
