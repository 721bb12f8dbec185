"""The workers' control messages: typed NOTIFY payloads on a queue table's channel.

A queue table's channel carries plain queue names (jobs were committed there: wake up)
and messages of the library's own, whose payloads start with ``sqla_queue.`` (no queue
may: see :data:`~sqla_queue.model.RESERVED_QUEUE_PREFIX`):

- :class:`Swept` (``sqla_queue.swept:<queue>``): a sweeper returned jobs of that queue,
  isolated now;
- :class:`Cancel` (``sqla_queue.cancel:<id>,<id>,...``): those jobs were cancelled; a
  worker running one of them reads its row, and tells its handler.

A message is a hint, never an order: a worker acts on what the rows say. NOTIFY payloads
are limited to 8000 bytes, so a cancel of many jobs sends several messages.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

__all__ = [
    "CANCEL_PREFIX", "SWEPT_PREFIX", "Cancel", "Message", "Swept", "Wake", "cancel_payloads", "parse", "swept_payloads",
]

SWEPT_PREFIX: Final = "sqla_queue.swept:"
CANCEL_PREFIX: Final = "sqla_queue.cancel:"
#: Bytes of ids per cancel message (PostgreSQL's payload limit is 8000).
_MAX_IDS_BYTES: Final = 7000


@dataclass(frozen=True)
class Wake:
    """Jobs were committed to ``queue``."""

    queue: str


@dataclass(frozen=True)
class Swept:
    """A sweeper returned jobs of ``queue`` (isolated now)."""

    queue: str


@dataclass(frozen=True)
class Cancel:
    """The jobs ``ids`` (their keys as text) were cancelled."""

    ids: frozenset[str]


Message: TypeAlias = Wake | Swept | Cancel


def parse(payload: str) -> Message | None:
    """The message a payload carries; None for a library message this version does not know."""
    if payload.startswith(SWEPT_PREFIX):
        return Swept(payload[len(SWEPT_PREFIX):])
    if payload.startswith(CANCEL_PREFIX):
        return Cancel(frozenset(i for i in payload[len(CANCEL_PREFIX):].split(",") if i))
    if payload.startswith("sqla_queue."):
        return None
    return Wake(payload)


def swept_payload(queue: str) -> str:
    return SWEPT_PREFIX + queue


def swept_payloads(queues: Iterable[str]) -> list[str]:
    """What a sweep that returned jobs of ``queues`` sends: each queue's name (it wakes
    idle workers, those that only know queue names too), then each queue's
    :class:`Swept` (isolated jobs wait there: a claim of one each, at once)."""
    queues = list(queues)
    return [*queues, *(swept_payload(queue) for queue in queues)]


def cancel_payloads(ids: Iterable[Any]) -> list[str]:
    """The cancel messages for ``ids``, each within NOTIFY's limit."""
    payloads: list[str] = []
    chunk: list[str] = []
    size = 0
    for job_id in ids:
        text = str(job_id)
        if chunk and size + len(text.encode()) + 1 > _MAX_IDS_BYTES:
            payloads.append(CANCEL_PREFIX + ",".join(chunk))
            chunk, size = [], 0
        chunk.append(text)
        size += len(text.encode()) + 1
    if chunk:
        payloads.append(CANCEL_PREFIX + ",".join(chunk))
    return payloads
