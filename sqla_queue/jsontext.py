"""JSON text as PostgreSQL takes it, for both sides: the serializer a dialect uses, what
in a text jsonb refuses, and a handler's return value as the result it stores.

The enqueue side checks payloads with these (:mod:`sqla_queue.enqueue._rules`); the
worker encodes results with them, in the executor, before anything is written, so a
result the column cannot hold fails its attempt with a clear error rather than the
statement that completes its batch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Final

from .errors import ResultNotStorable

__all__ = [
    "BAD_CHAR",
    "ResultEncoder",
    "dialect_json_serializer",
    "json_text_problem",
    "progress_encoder",
]

#: Characters PostgreSQL text cannot hold (NUL) or psycopg cannot encode (lone surrogates).
BAD_CHAR: Final = re.compile("[\x00\ud800-\udfff]")
#: Every escape in JSON text (the ``.`` alternative consumes ``\\\\``, keeping parity).
_JSON_ESCAPE: Final = re.compile(r"\\(?:u([0-9a-fA-F]{4})|.)", re.DOTALL)

#: ``json.dumps(value, allow_nan=False)``, without building an encoder per call.
_strict_dumps: Final[Callable[[Any], str]] = json.JSONEncoder(allow_nan=False).encode


def dialect_json_serializer(dialect: Any) -> Callable[[Any], Any]:
    """The engine's ``json_serializer`` if it has one, else strict ``json.dumps``.

    Strict (``allow_nan=False``) because PostgreSQL rejects the ``NaN`` that the
    standard ``json.dumps`` writes; better to fail on the Python side, naming the column.
    """
    custom = getattr(dialect, "_json_serializer", None)
    if custom is not None:
        return custom  # type: ignore[no-any-return]
    return _strict_dumps


def json_text_problem(text: str) -> str | None:
    """What in JSON text PostgreSQL would refuse: NUL, or a surrogate escape without a pair."""
    if "\x00" in text:
        return "a NUL character"
    if not text.isascii() and BAD_CHAR.search(text):
        return "a lone surrogate"
    high_end = -1  # where an unpaired high-surrogate escape ended
    for match in _JSON_ESCAPE.finditer(text):
        digits = match.group(1)
        code = int(digits, 16) if digits is not None else -1
        if high_end >= 0:
            if 0xDC00 <= code <= 0xDFFF and match.start() == high_end:
                high_end = -1
                continue
            return "a lone surrogate (\\ud800-\\udfff)"
        if code == 0:
            return "\\u0000"
        if 0xD800 <= code <= 0xDBFF:
            high_end = match.end()
        elif 0xDC00 <= code <= 0xDFFF:
            return "a lone surrogate (\\ud800-\\udfff)"
    if high_end >= 0:
        return "a lone surrogate (\\ud800-\\udfff)"
    return None


class ResultEncoder:
    """A value a job reports (a handler's return value, its progress) as the JSON text
    the worker stores, or :class:`~sqla_queue.ResultNotStorable`: not JSON, something
    jsonb refuses, longer than ``limit`` characters, or (``python_type``: the column is
    not a JSON one) not of the column's type. None stays None (SQL NULL). ``what`` and
    ``limit_name`` name the value and its limit in the messages."""

    __slots__ = ("limit", "limit_name", "python_type", "serializer", "what")

    def __init__(
        self, serializer: Callable[[Any], Any], limit: int, python_type: type[Any] | None = None, *,
        what: str = "the handler's result", limit_name: str = "the worker's max_result_size",
    ) -> None:
        self.serializer = serializer
        self.limit = limit
        self.python_type = python_type
        self.what = what
        self.limit_name = limit_name

    def __call__(self, value: Any) -> str | None:
        if value is None:
            return None
        kind = self.python_type
        if kind is not None and not (isinstance(value, kind) and not (kind is int and isinstance(value, bool))):
            raise ResultNotStorable(
                f"{self.what} is a {type(value).__qualname__}, and its column holds {kind.__qualname__}"
            )
        try:
            text = self.serializer(value if kind is None or isinstance(value, (int, float, str)) else str(value))
        except RecursionError:
            raise ResultNotStorable(f"{self.what} is nested too deeply to be stored as JSON") from None
        except (TypeError, ValueError, OverflowError) as exc:
            raise ResultNotStorable(f"{self.what} is not JSON-serialisable: {exc}") from None
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode(errors="replace")
        elif not isinstance(text, str):
            text = str(text)
        if len(text) > self.limit:
            raise ResultNotStorable(
                f"{self.what} is {len(text)} characters of JSON, over {self.limit_name} of {self.limit}: "
                f"store big values elsewhere and keep a reference"
            )
        if "\\u" in text or "\x00" in text or not text.isascii():
            problem = json_text_problem(text)
            if problem:
                raise ResultNotStorable(f"{self.what} contains {problem}, which PostgreSQL jsonb cannot store")
        return text


#: The longest progress a job records, in characters of JSON: a small value, written with
#: every heartbeat.
MAX_PROGRESS_SIZE: Final = 8192


def progress_encoder(serializer: Callable[[Any], Any], limit: int = MAX_PROGRESS_SIZE) -> ResultEncoder:
    """How ``current_job().progress(value)`` encodes its value."""
    return ResultEncoder(serializer, limit, what="the job's progress", limit_name="the progress limit")
