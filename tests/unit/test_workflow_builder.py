"""The workflow builder's checks: each refuses before anything is added or written."""

from __future__ import annotations

import uuid

import pytest

from sqla_queue import EnqueueError, NotAQueueModel, Workflow
from tests.models import Order, StepJob, StepTask, Task


def test_a_workflow_id_can_be_chosen_and_is_checked() -> None:
    chosen = uuid.uuid4()
    assert Workflow(id=chosen).id == chosen
    assert Workflow().id != Workflow().id
    with pytest.raises(EnqueueError, match="uuid"):
        Workflow(id="x")  # type: ignore[arg-type]
    with pytest.raises(EnqueueError, match="on_parent_failure"):
        Workflow(on_parent_failure="retry")


def test_a_job_waits_only_for_jobs_added_before_it_in_the_same_workflow() -> None:
    flow, other = Workflow(), Workflow()
    stranger = other.add(StepTask(task="t"))
    with pytest.raises(EnqueueError, match="not in this workflow"):
        flow.add(StepTask(task="t"), after=[stranger])
    with pytest.raises(EnqueueError, match="not in this workflow"):
        flow.add(StepTask(task="t"), after=[StepTask(task="later")])
    assert len(flow) == 0
    parent = flow.add(StepTask(task="t"))
    child = flow.add(StepTask(task="t"), after=[parent, parent])  # one edge, however often named
    assert flow.parents(child) == [parent]
    with pytest.raises(EnqueueError, match="already"):
        flow.add(parent)
    with pytest.raises(TypeError, match="collection"):
        flow.add(StepTask(task="t"), after="parent")


def test_a_workflow_is_one_table_that_keeps_workflows() -> None:
    flow = Workflow()
    with pytest.raises(EnqueueError, match="WorkflowMixin"):
        flow.add(Task(task="t"))
    with pytest.raises(NotAQueueModel):
        flow.add(Order())
    flow.add(StepTask(task="t"))
    with pytest.raises(EnqueueError, match="one table"):
        flow.add(StepJob())


def test_options_are_checked_as_added_and_a_waiting_job_takes_no_delay() -> None:
    flow = Workflow()
    parent = flow.add(StepTask(task="t"), delay=5, queue="first")
    with pytest.raises(EnqueueError):
        flow.add(StepTask(task="t"), priority="high")  # type: ignore[arg-type]
    with pytest.raises(EnqueueError, match="no delay or run_at"):
        flow.add(StepTask(task="t"), after=[parent], delay=1)
    edges = flow.edges()
    assert [(parents, children) for _, parents, children, _ in edges] == [((), [])]


def test_a_batch_needs_members_and_waits_for_all_of_them_whatever_they_end_as() -> None:
    members = [StepTask(task="m") for _ in range(3)]
    callback = StepTask(task="cb")
    batch = Workflow.batch(members, callback=callback, queue="callbacks")
    assert batch.on_parent_failure == "run"
    assert batch.parents(callback) == members
    with pytest.raises(EnqueueError, match="at least one member"):
        Workflow.batch([], callback=StepTask(task="cb"))
