"""Values the database would refuse at commit: every enqueue path must refuse them first.

Shared by the ``enqueue()`` and ``enqueue_many()`` tests, since both apply one set of
rules. Each case: (model, column, value, error class, message pattern).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest

from sqla_queue import EnqueueError, InvalidPayload

from .models import EmailJob, Task


def deep_payload(depth: int) -> dict[str, Any]:
    """A dict nested ``depth`` levels deep, built without recursion."""
    payload: dict[str, Any] = {}
    for _ in range(depth):
        payload = {"next": payload}
    return payload


#: Too deep for the JSON encoder of every supported Python (3.12's C encoder goes past the
#: recursion limit; 20,000 levels already fail everywhere).
DEEP = deep_payload(100_000)

#: Values a job's own columns (attribute, dict or instance row) must not hold.
COLUMN_CASES = [
    pytest.param(EmailJob, "queue", "q" * 200, EnqueueError, "queue is longer than 128", id="queue-too-long"),
    pytest.param(EmailJob, "queue", "a\x00b", EnqueueError, "queue contains a NUL", id="queue-nul"),
    pytest.param(EmailJob, "queue", "sqla_queue.x", EnqueueError, "which sqla_queue reserves", id="queue-reserved"),
    pytest.param(EmailJob, "queue", "a\ud800", EnqueueError, "lone surrogate", id="queue-surrogate"),
    pytest.param(EmailJob, "priority", "high", EnqueueError, "32-bit", id="priority-str"),
    pytest.param(EmailJob, "priority", 2**31, EnqueueError, "32-bit", id="priority-int4-range"),
    pytest.param(EmailJob, "max_attempts", -1, EnqueueError, ">= 1", id="max-attempts-negative"),
    pytest.param(EmailJob, "max_attempts", 0, EnqueueError, ">= 1", id="max-attempts-zero"),
    pytest.param(EmailJob, "max_attempts", 2**31, EnqueueError, "32-bit", id="max-attempts-range"),
    pytest.param(EmailJob, "run_after", datetime(2030, 1, 1), EnqueueError, "timezone-aware", id="run-after-naive"),
    pytest.param(Task, "task", "t" * 300, EnqueueError, "task is longer than 200", id="task-too-long"),
    pytest.param(Task, "task", "t\x00", EnqueueError, "NUL", id="task-nul"),
    pytest.param(Task, "payload", {"a": "x\x00y"}, InvalidPayload, "u0000", id="payload-nul-value"),
    pytest.param(Task, "payload", {"k\x00": 1}, InvalidPayload, "u0000", id="payload-nul-key"),
    pytest.param(Task, "payload", {"a": ["\ud800"]}, InvalidPayload, "lone surrogate", id="payload-high-surrogate"),
    pytest.param(Task, "payload", {"\udc00": 1}, InvalidPayload, "lone surrogate", id="payload-surrogate-key"),
    pytest.param(Task, "payload", {"a": "\ud83d\ud83d"}, InvalidPayload, "lone surrogate", id="payload-two-highs"),
    pytest.param(Task, "payload", DEEP, InvalidPayload, "nested too deeply", id="payload-too-deep"),
    pytest.param(EmailJob, "recipient", "a\x00@x", EnqueueError, "recipient contains a NUL", id="user-text-nul"),
    pytest.param(EmailJob, "recipient", "\udfff@example.com", EnqueueError, "lone surrogate", id="user-text-surrogate"),
    pytest.param(EmailJob, "recipient", "r" * 201, EnqueueError, "longer than 200", id="user-text-too-long"),
]

#: Enqueue options the database would refuse (or that overflow on the way there).
OPTION_CASES = [
    pytest.param({"queue": "q" * 200}, "queue is longer than 128", id="queue-too-long"),
    pytest.param({"queue": "a\x00b"}, "NUL", id="queue-nul"),
    pytest.param({"queue": "sqla_queue.swept:mail"}, "which sqla_queue reserves", id="queue-reserved"),
    pytest.param({"queue": "\ud800"}, "lone surrogate", id="queue-surrogate"),
    pytest.param({"priority": "high"}, "32-bit", id="priority-str"),
    pytest.param({"priority": -(2**31) - 1}, "32-bit", id="priority-int4-range"),
    pytest.param({"max_attempts": -1}, ">= 1", id="max-attempts-negative"),
    pytest.param({"max_attempts": 0}, ">= 1", id="max-attempts-zero"),
    pytest.param({"run_at": datetime(2030, 1, 1)}, "timezone-aware", id="run-at-naive"),
    pytest.param({"delay": 1e12}, "at most 1000 years", id="delay-1e12"),
    pytest.param({"delay": 10**400}, "finite", id="delay-huge-int"),
    pytest.param({"delay": timedelta(days=999_999_999)}, "at most 1000 years", id="delay-timedelta-max"),
]

#: One case of each kind, for the integration suites: on the real server they prove that
#: the caller's transaction commits whole after a refusal. Every case runs on every path in
#: the unit tier (``tests/unit/test_refused_before_sent.py``), where nothing may be sent.
COLUMN_SAMPLE = [case for case in COLUMN_CASES if case.id in ("queue-too-long", "payload-nul-value", "user-text-nul")]
OPTION_SAMPLE = [case for case in OPTION_CASES if case.id in ("queue-nul", "delay-1e12")]

#: Values that look close to the bad ones but are fine, and must be stored as given.
GOOD_TEXT = "caf\u00e9 \U0001f600 \\u0000 \\ud800"  # non-BMP emoji, escaped-looking text
GOOD_PAYLOAD = {"emoji \U0001f600": ["\U0001f600", "\\u0000", "\\\\ud800", "\u00e9"]}


def row_values(model: Any, column: str, value: Any) -> dict[str, Any]:
    """The column values of a job whose ``column`` is ``value``, otherwise valid."""
    values: dict[str, Any] = {"task": "t"} if model is Task else {}
    values[column] = value
    return values
