"""Kept so that ``from sqla_queue.unique import ...`` keeps working; the code lives in
:mod:`sqla_queue.enqueue.unique`."""

from .enqueue.unique import Enqueued, EnqueuedMany, UniqueKey, enqueue_keyed, holder_of

__all__ = ["Enqueued", "EnqueuedMany", "UniqueKey", "enqueue_keyed", "holder_of"]
