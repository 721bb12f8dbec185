"""Kept so that ``from sqla_queue.session import ...`` keeps working; the code lives in
:mod:`sqla_queue.enqueue.session`."""

from .enqueue.session import AsyncQueueSession, QueueSession, UniqueKey, enqueue, enqueue_workflow, notify_on_commit

__all__ = ["AsyncQueueSession", "QueueSession", "UniqueKey", "enqueue", "enqueue_workflow", "notify_on_commit"]
