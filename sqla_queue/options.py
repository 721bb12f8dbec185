"""Kept so that ``from sqla_queue.options import ...`` keeps working; the code lives in
:mod:`sqla_queue.enqueue.options`."""

from .enqueue.options import NO_OPTIONS, EnqueueKwargs, EnqueueOptions, enqueue_options

__all__ = ["NO_OPTIONS", "EnqueueKwargs", "EnqueueOptions", "enqueue_options"]
