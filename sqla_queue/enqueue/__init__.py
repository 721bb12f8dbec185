"""The enqueue side: how a job gets into its queue table, in the caller's transaction.

This is what a web request that enqueues imports, and all it imports: the model, the
statement builders and the errors below it, never the worker (``tests/unit/
test_structure.py``). A job goes in by one of three paths, each with the same options
and the same checks:

- :func:`enqueue` (:mod:`.session`): the job joins the caller's ORM unit of work, the
  session classes :class:`QueueSession` and :class:`AsyncQueueSession` carry it as a
  method; with a unique key it is a keyed insert instead (:mod:`.unique`);
- :func:`enqueue_many` (:mod:`.bulk`): many rows at once, by COPY or bounded inserts;
- :func:`enqueue_values` (:mod:`.values`): one INSERT of plain values, its NOTIFY in the
  same statement;
- :func:`enqueue_workflow` (:mod:`.session`): a :class:`Workflow` (:mod:`.workflow`) of
  jobs that wait for others, each by :func:`enqueue`, with their edges.

Under them: the options as one checked value (:class:`EnqueueOptions`, :mod:`.options`),
the row plans every path applies (:mod:`.rows`) with the rules of single values
(:mod:`._rules`), the session an enqueue call was handed resolved (:mod:`.binds`), and
the wake-up of the workers: NOTIFY when the caller's transaction commits (the outbox,
:mod:`.outbox`), or sent after it, coalesced (:mod:`.waker`).

The public names are exported from :mod:`sqla_queue` as well.
"""

from .bulk import enqueue_many
from .options import EnqueueKwargs, EnqueueOptions
from .session import AsyncQueueSession, QueueSession, enqueue, enqueue_workflow, notify_on_commit
from .unique import Enqueued, EnqueuedMany
from .values import enqueue_values
from .workflow import Workflow

__all__ = [
    "AsyncQueueSession",
    "EnqueueKwargs",
    "EnqueueOptions",
    "Enqueued",
    "EnqueuedMany",
    "QueueSession",
    "Workflow",
    "enqueue",
    "enqueue_many",
    "enqueue_values",
    "enqueue_workflow",
    "notify_on_commit",
]
