"""The operations layer: every statement the worker runs on one queue table, as typed calls.

One :class:`QueueOps` per worker and queue table owns the statements of
:mod:`sqla_queue.sql` it runs, each compiled once through the driver
(:meth:`~sqla_queue.driver.Driver.compile`), the names their parameters are bound by,
and the decoding of their rows. The services of :mod:`sqla_queue.worker` call its
methods with tokens, owners and keys, and get tokens, statuses and model instances back:
no statement, parameter name or column position leaves this package. A new transition is
a builder in :mod:`sqla_queue.sql` plus a method of :class:`QueueOps`;
:class:`Operations` is the shape the services rely on, so an in-memory stand-in can
replace the database in unit tests.

- :mod:`.protocol`: :class:`Operations` and the values it takes and returns;
- :mod:`.queue`: :class:`QueueOps`, the queue table's statements;
- :mod:`.schedules`: :class:`ScheduleOps`, the periodic jobs' watermark rows;
- :mod:`.retention`: :class:`RetentionOps`, the pruning of finished jobs.
"""

from ..sql import SESSION_MARK
from .protocol import (
    Claimed,
    ClaimRequest,
    ClaimSeen,
    ClaimStart,
    CursorStart,
    Moved,
    Operations,
    RowProblem,
    SweepResult,
    SweptJob,
    TokenState,
    WorkerRecord,
)
from .queue import TOKENS_PER_STATEMENT, QueueOps, parts, token_values
from .retention import RetentionOps
from .schedules import ScheduleOps

__all__ = [
    "SESSION_MARK", "TOKENS_PER_STATEMENT", "ClaimRequest", "ClaimSeen", "ClaimStart", "Claimed", "CursorStart",
    "Moved", "Operations", "QueueOps", "RetentionOps", "RowProblem", "ScheduleOps", "SweepResult", "SweptJob",
    "TokenState", "WorkerRecord", "parts", "token_values",
]
