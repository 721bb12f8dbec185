"""What a handler's run came to: the executor's only product, the completer's only input."""

from __future__ import annotations

import enum
import traceback
from dataclasses import dataclass

from .ledger import Held

__all__ = ["Kind", "Outcome", "describe_error", "storable"]


class Kind(enum.Enum):
    #: Finished: mark it ``done``.
    DONE = "done"
    #: Completed inside the handler's own transaction, which committed: nothing to record.
    COMMITTED = "committed"
    #: Failed: back to ``pending`` after ``delay`` (``failed`` once attempts are used up).
    RETRY = "retry"
    #: Dead-letter now.
    FAIL = "fail"
    #: Snoozed (``Snooze``): back to ``pending`` after ``delay``, the attempt given back.
    SNOOZE = "snooze"
    #: Back to ``pending`` at once: never started (shutdown), or the worker's own
    #: connection was lost under the handler's transaction (the attempt refunded); or its
    #: handler gave up because the worker stops (the attempt counts: see ``refund``).
    RELEASE = "release"
    #: The lease was lost: someone else owns the job now; record nothing.
    LOST = "lost"
    #: The job was cancelled while it ran: its row says so already; record nothing.
    CANCELLED = "cancelled"


@dataclass(slots=True)
class Outcome:
    held: Held
    kind: Kind
    error: str = ""
    delay: float = 0.0
    #: The handler's transaction, with the job's completion in it, may have committed: the
    #: connection was lost at the commit, before its answer came. The completer records
    #: ``kind`` fenced as usual, and reads the row when that matches nothing: ``done`` by
    #: this owner and attempt means the commit had landed.
    unsure: bool = False
    #: A ``release`` gives the attempt back (the worker's own fault); False: it counts
    #: (a handler that gave up because the worker stops had run).
    refund: bool = True
    #: A done job's result, as the JSON text its table keeps (None: none, or a table
    #: that keeps no results).
    result: str | None = None


def storable(text: str, limit: int) -> str:
    """Text PostgreSQL accepts: no NUL (text rejects it), no lone surrogate (not UTF-8),
    at most ``limit`` characters."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text[:limit]


def describe_error(exc: BaseException, limit: int) -> str:
    """``module.Type: message`` and the end of the traceback, storable and bounded,
    whatever the exception does when formatted."""
    kind = type(exc)
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - an exception whose __str__ fails
        message = "<exception message could not be formatted>"
    head = storable(f"{kind.__module__}.{kind.__qualname__}: {message}", limit)
    try:
        tb = "".join(traceback.format_exception(kind, exc, exc.__traceback__))
    except Exception:  # noqa: BLE001
        return head
    tb = storable(tb, limit * 4)
    text = f"{head}\n\n{tb}"
    if len(text) <= limit:
        return text
    keep = limit - len(head) - 40
    if keep <= 0:
        return head[:limit]
    return f"{head}\n\n... (traceback truncated) ...\n{tb[-keep:]}"[:limit]
