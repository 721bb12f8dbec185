"""Workflows: jobs that wait for others, enqueued together in the caller's transaction.

A :class:`Workflow` is a graph built in Python (each job added after the jobs it waits
for, so it has no cycle), checked as it is built, and enqueued by
:func:`~sqla_queue.enqueue_workflow` (:mod:`.session`) in one transaction:
every job through :func:`~sqla_queue.enqueue` (its checks and options, its wake-up at
commit), a job with parents ``pending`` but not due (``run_after`` at
:data:`WAITING_RUN_AFTER`) with ``waiting_on`` its number of parents, and after one
flush the edges written on both ends (``parent_ids``, ``child_ids``). Nothing runs
before the commit, and a rollback takes the whole graph. The statement that ends a
parent releases its children (:mod:`sqla_queue.sql._workflows`).

All of a workflow's jobs are new and in one table: no job outside it can gain a child
while it runs, which is what lets a parent's ``child_ids`` be read once, at its end.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, TypeVar

from sqlalchemy.orm import attributes as orm_attributes
from typing_extensions import Unpack

from ..errors import EnqueueError, NotAQueueModel
from ..model import ON_PARENT_FAILURE, QueueTable, has_workflows
from .options import EnqueueKwargs, enqueue_options
from .rows import queue_table_of

__all__ = ["WAITING_RUN_AFTER", "Workflow"]

J = TypeVar("J")

#: ``run_after`` of a job waiting for its parents: never due, and still a ``datetime``
#: Python reads (``'infinity'`` is not), so the row loads anywhere. Its release sets it.
WAITING_RUN_AFTER: Final = datetime(9999, 12, 30, tzinfo=UTC)


@dataclass(slots=True)
class _Node:
    job: Any
    parents: tuple[int, ...]
    options: EnqueueKwargs


class Workflow:
    """Jobs that wait for other jobs, enqueued together (:func:`enqueue_workflow`)::

        flow = Workflow()
        fetch = flow.add(Step(task="fetch", payload={"url": url}))
        parse = flow.add(Step(task="parse"), after=[fetch])
        flow.add(Step(task="report"), after=[parse, fetch])
        session.enqueue_workflow(flow)      # or enqueue_workflow(session, flow)

    A job runs once every job it waits for has ended ``done``, released by the
    statement that ends the last of them, in that statement's transaction: so only if
    that parent's own writes commit, and exactly once. ``on_parent_failure`` says what a
    job does when a parent ends ``failed`` (dead-lettered) or ``cancelled``:
    ``"cancel"`` (the default: it and every job below it are cancelled), ``"hold"`` (it
    waits; requeue the parent, and when that ends ``done`` it counts), or ``"run"``
    (the parent counts as ended; a batch's callback, see :meth:`batch`).
    """

    def __init__(self, *, on_parent_failure: str = "cancel", id: uuid.UUID | None = None) -> None:
        if on_parent_failure not in ON_PARENT_FAILURE:
            raise EnqueueError(
                f"on_parent_failure must be one of {', '.join(map(repr, ON_PARENT_FAILURE))}, got {on_parent_failure!r}"
            )
        if id is not None and not isinstance(id, uuid.UUID):
            raise EnqueueError(f"a workflow's id is a uuid.UUID, got {type(id).__qualname__}")
        self.id: uuid.UUID = id or uuid.uuid4()
        self.on_parent_failure = on_parent_failure
        self._nodes: list[_Node] = []
        self._index: dict[int, int] = {}
        self._table: QueueTable | None = None
        self.enqueued = False

    @classmethod
    def batch(cls, members: Iterable[Any], *, callback: Any, **options: Unpack[EnqueueKwargs]) -> Workflow:
        """A batch: ``members``, and ``callback``, a job that runs once when the last of
        them has ended, whichever way (``done``, ``failed`` or ``cancelled``; the policy
        is ``"run"``). Its handler reads the counts with
        :func:`sqla_queue.parent_counts`. ``options`` are the callback's."""
        flow = cls(on_parent_failure="run")
        added = [flow.add(member) for member in members]
        if not added:
            raise EnqueueError("a batch needs at least one member")
        flow.add(callback, after=added, **options)
        return flow

    @property
    def jobs(self) -> list[Any]:
        """The jobs, in the order they were added."""
        return [node.job for node in self._nodes]

    def parents(self, job: Any) -> list[Any]:
        """The jobs ``job`` waits for."""
        return [self._nodes[i].job for i in self._nodes[self._position(job, "job")].parents]

    def add(self, job: J, *, after: Iterable[Any] = (), **options: Unpack[EnqueueKwargs]) -> J:
        """Add ``job``, to run after every job of ``after`` (jobs added before) has
        ended; returns ``job``. ``options`` are :func:`~sqla_queue.enqueue`'s, checked
        here; a job that waits takes no ``delay`` or ``run_at`` (it runs when released)."""
        if self.enqueued:
            raise EnqueueError("this workflow is enqueued already: build a new one")
        qt = queue_table_of(job)
        if qt is None:
            raise NotAQueueModel(f"cannot add {type(job).__qualname__}: not a model using sqla_queue.JobMixin")
        if not has_workflows(qt.table):
            raise EnqueueError(
                f"table {qt.table.name!r} keeps no workflows: mix sqla_queue.WorkflowMixin into its model"
            )
        if self._table is not None and self._table.table is not qt.table:
            raise EnqueueError(
                f"a workflow's jobs share one table: {qt.table.name!r} is not {self._table.table.name!r}"
            )
        if id(job) in self._index:
            raise EnqueueError(f"{type(job).__qualname__} job is in this workflow already")
        if orm_attributes.instance_state(job).key is not None:
            raise EnqueueError(f"{type(job).__qualname__} job is already persistent; add a new object")
        if isinstance(after, str | bytes):
            raise TypeError("after must be a collection of jobs of this workflow")
        parents: list[int] = []
        for parent in after:
            position = self._position(parent, "after")
            if position not in parents:
                parents.append(position)
        checked = enqueue_options(options, None)
        if parents and (checked.delay_seconds is not None or checked.values.get("run_after") is not None):
            raise EnqueueError("a job that waits for others runs when they end: it takes no delay or run_at")
        self._table = qt
        self._index[id(job)] = len(self._nodes)
        self._nodes.append(_Node(job, tuple(parents), options))
        return job

    def _position(self, job: Any, what: str) -> int:
        position = self._index.get(id(job))
        if position is None:
            raise EnqueueError(
                f"{what}: {type(job).__qualname__} job is not in this workflow (add a job after the jobs it waits for)"
            )
        return position

    def edges(self) -> list[tuple[Any, tuple[int, ...], list[int], EnqueueKwargs]]:
        """Each job with the positions of its parents and of its children, and its
        options, in the order added: what the enqueue writes."""
        children: list[list[int]] = [[] for _ in self._nodes]
        for position, node in enumerate(self._nodes):
            for parent in node.parents:
                children[parent].append(position)
        return [(node.job, node.parents, children[n], node.options) for n, node in enumerate(self._nodes)]

    def __len__(self) -> int:
        return len(self._nodes)

    def __repr__(self) -> str:
        return f"Workflow(id={self.id}, jobs={len(self._nodes)}, on_parent_failure={self.on_parent_failure!r})"
