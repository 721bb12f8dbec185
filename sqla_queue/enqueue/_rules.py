"""The rules a job's values must pass before they reach the session: one set for all.

``enqueue()`` (its options and the attributes set on the job), ``enqueue_many()`` (its
options and every dict or instance row) and ``enqueue_values()`` apply these same checks,
so a value that the database would refuse at flush or commit (where it would abort the
caller's transaction, business rows included) is refused here instead, with a typed error
naming the column: wrong types and ranges, characters text cannot hold, sizes PostgreSQL
cannot take, a discriminator of single-table inheritance naming another model.

Per table the rules are resolved once (:class:`TableRules`, kept by the row plans of
:mod:`sqla_queue.enqueue.rows`); checking a value is then a dict lookup and a few
comparisons, because ``enqueue()`` of one job is a hot path. The enqueue options
themselves are checked by :class:`sqla_queue.enqueue.EnqueueOptions`, with the checks
defined here (those of queue, priority and max_attempts in :mod:`sqla_queue.model`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from sqlalchemy import JSON, Column, String, Table, TypeDecorator
from sqlalchemy.orm import Mapper

from ..cache import plans
from ..errors import EnqueueError, InvalidPayload
from ..jsontext import BAD_CHAR, dialect_json_serializer, json_text_problem
from ..model import (
    MAX_DELAY_SECONDS,
    MAX_TIMEOUT_SECONDS,
    RESERVED_QUEUE_PREFIX,
    JobStatus,
    check_max_attempts,
    check_priority,
    check_queue,
    unique_jobs,
)

__all__ = [
    "MAX_DELAY_SECONDS",
    "MAX_JSONB_BYTES",
    "MAX_ROW_BYTES",
    "MAX_KEY_BYTES",
    "Check",
    "Polymorphic",
    "TableRules",
    "check_json",
    "check_key_size",
    "check_max_attempts",
    "check_priority",
    "RESERVED_QUEUE_PREFIX",
    "check_queue",
    "check_row_size",
    "check_run_at",
    "check_task_name",
    "check_text",
    "check_timeout",
    "timeout_seconds",
    "delay_seconds",
    "dialect_json_serializer",
    "jsonb_size",
    "managed_violation",
    "polymorphic_rule",
    "python_default",
    "text_bytes",
]

#: Columns the queue manages; a job arriving with other values in them is a mistake.
_MANAGED_DEFAULTS: Final = {
    "status": (None, JobStatus.PENDING.value),
    "attempts": (None, 0),
    "lease_owner": (None,),
    "lease_expires_at": (None,),
    "finished_at": (None,),
    "started_at": (None,),
    "deadline_at": (None,),
}
#: Their names: a row setting none of them needs no closer look.
MANAGED_KEYS: Final = frozenset(_MANAGED_DEFAULTS)



# -- single values ------------------------------------------------------------------------
# The limits, and the checks of queue, priority and max_attempts, are sqla_queue.model's
# (imported above): the worker's config, the tasks and the schedules, which sit below the
# enqueue side, need them too.


def check_run_at(value: Any, name: str = "run_at") -> None:
    if not isinstance(value, datetime) or value.tzinfo is None or value.utcoffset() is None:
        raise EnqueueError(f"{name} must be a timezone-aware datetime, got {value!r}")
    try:
        value.astimezone(UTC)  # year 9999 at +02:00 is year 10000 in UTC
    except OverflowError:
        raise EnqueueError(f"{name} is out of range, got {value!r}") from None


def check_task_name(value: Any, name: str = "task") -> None:
    if not isinstance(value, str) or not value:
        raise EnqueueError(f"needs a task name (a non-empty string), got {value!r}")


def check_text(value: str, name: str, length: int | None) -> None:
    """A string PostgreSQL can store in a column of ``length`` characters (None: any)."""
    if length is not None and len(value) > length:
        raise EnqueueError(f"{name} is longer than {length} characters ({len(value)})")
    # "\x00" in s is a memchr; isascii() is a flag test, so ASCII strings skip the regex.
    if "\x00" in value or (not value.isascii() and BAD_CHAR.search(value)):
        raise EnqueueError(
            f"{name} contains a NUL character or a lone surrogate, which PostgreSQL "
            f"text cannot store: {value[:60]!r}"
        )


#: The longest unique key, in UTF-8 bytes. A B-tree entry holds at most 2704 bytes (8 kB
#: pages), 12 of them headers: a longer key makes the server refuse the INSERT
#: (``ProgramLimitExceeded``), aborting the caller's transaction. PostgreSQL may compress
#: a longer one enough to fit, but that depends on its content: the limit does not.
MAX_KEY_BYTES: Final = 2692


def check_key_size(value: Any, name: str) -> None:
    """A unique key whose index entry fits: the mixin's ``unique_key`` is short by its
    length, a key column of the user's own (``Text``, ``String()``) may have none."""
    # At most 4 bytes a character: short strings need no encoding to know they fit.
    if isinstance(value, str) and len(value) * 4 > MAX_KEY_BYTES:
        size = text_bytes(value)
        if size > MAX_KEY_BYTES:
            raise EnqueueError(
                f"{name} is a unique key of {size} bytes, more than its index can hold ({MAX_KEY_BYTES}): "
                "keep keys short (an id, or a hash of a long value)"
            )


def delay_seconds(delay: Any) -> float:
    """``delay`` (seconds or a timedelta) as float seconds, checked."""
    if isinstance(delay, timedelta):
        seconds = delay.total_seconds()
    elif isinstance(delay, (int, float)) and not isinstance(delay, bool):
        try:
            seconds = float(delay)
        except OverflowError:  # an int too large for a float
            seconds = math.inf
    else:
        raise EnqueueError(f"delay must be seconds or a timedelta, got {delay!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise EnqueueError(f"delay must be a finite, non-negative duration, got {delay!r}")
    if seconds > MAX_DELAY_SECONDS:
        raise EnqueueError(f"delay must be at most 1000 years, got {delay!r}")
    return seconds


def timeout_seconds(value: Any, name: str = "timeout") -> float:
    """A timeout (positive seconds or a timedelta) as float seconds, checked."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value) if abs(value) < 2**63 else math.inf
    else:
        raise EnqueueError(f"{name} must be seconds or a timedelta, got {value!r}")
    if not math.isfinite(seconds) or seconds <= 0 or seconds > MAX_TIMEOUT_SECONDS:
        raise EnqueueError(f"{name} must be a positive duration of at most ten years, got {value!r}")
    return seconds


def check_timeout(value: Any, name: str = "timeout") -> None:
    timeout_seconds(value, name)


def _check_timeout_column(value: Any, name: str = "timeout") -> None:
    """A row's own ``timeout`` value: seconds, as the column stores them."""
    if isinstance(value, timedelta):
        raise EnqueueError(f"{name} of a row must be seconds (the column's type), got {value!r}")
    timeout_seconds(value, name)


def managed_violation(values: Any) -> tuple[str, Any] | None:
    """The first queue-managed column ``values`` (a mapping) sets, with its value, or None."""
    for key, allowed in _MANAGED_DEFAULTS.items():
        value = values.get(key)
        if value not in allowed:
            return key, value
    return None


# -- JSON ---------------------------------------------------------------------------------


def check_json(value: Any, name: str, serializer: Callable[[Any], Any]) -> str:
    """``value`` as the JSON text the database will get, or :class:`InvalidPayload`.

    Beyond what the serializer refuses, PostgreSQL's jsonb refuses ``\\u0000`` and lone
    surrogates anywhere (keys too), and a value nested past Python's recursion limit
    must fail as a payload error rather than a ``RecursionError``.
    """
    try:
        text = serializer(value)
    except RecursionError:
        raise InvalidPayload(f"{name} is nested too deeply to be stored as JSON") from None
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidPayload(f"{name} is not JSON-serialisable: {exc}") from exc
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode()
        except UnicodeDecodeError as exc:
            raise InvalidPayload(f"{name}: the JSON serializer wrote invalid UTF-8") from exc
    elif not isinstance(text, str):
        text = str(text)
    if "\\u" in text or "\x00" in text or not text.isascii():
        problem = json_text_problem(text)
        if problem:
            raise InvalidPayload(f"{name} contains {problem}, which PostgreSQL jsonb cannot store")
    if len(text) > _JSONB_ALWAYS_FITS:  # a few megabytes and less never need measuring
        size = jsonb_size(text, name)
        if size > MAX_JSONB_BYTES:
            raise InvalidPayload(
                f"{name} is too large for PostgreSQL jsonb: {size} bytes or more stored, "
                f"at most {MAX_JSONB_BYTES} allowed"
            )
    return text


# -- sizes --------------------------------------------------------------------------------
#
# Measured on PostgreSQL 15 with psycopg 3.3, where a value over a limit fails only at the
# INSERT (or COPY), at flush or commit, aborting the caller's transaction:
# - jsonb stores a value in at most 2**28 - 1 bytes of its binary form (JENTRY_OFFLENMASK):
#   a top-level string of 2**28 - 9 bytes is stored, one byte more raises
#   ProgramLimitExceeded ("total size of jsonb array elements exceeds the maximum"); the
#   binary form is not the text's size (a number "0," takes 12 bytes, an escape 1);
# - a statement's parameters travel in one message, which the server refuses from 1 GiB
#   by closing the connection (a text of 2**30 - 10 bytes: "server closed the connection
#   unexpectedly"), and the row is built in memory whole before TOAST moves it out, which
#   fails from 1 GiB too (a text of 2**30 - 30 bytes: InternalError "invalid memory alloc
#   request size"); COPY reads a row as one line, its escapes included, and refuses one
#   of 1 GiB (540 million tabs, sent as 1.08 GB: ProgramLimitExceeded "out of memory").

#: The largest jsonb value, in bytes of its binary form (checked for every JSON column).
MAX_JSONB_BYTES: Final = 2**28 - 1
#: The most text and JSON one row may hold, in bytes: 1 GiB less 1 MiB left for the
#: row's other columns and the framing of the message, the tuple or the COPY line.
MAX_ROW_BYTES: Final = 2**30 - 2**20
#: JSON text of at most this many characters always fits in jsonb: one character of
#: JSON text takes at most 7 bytes of jsonb ("0," as 12), plus 16 for the top level.
_JSONB_ALWAYS_FITS: Final = (MAX_JSONB_BYTES - 16) // 7
#: A row of at most this many characters of text and JSON always fits: a character is
#: at most 4 bytes of UTF-8 (an escaped one 2 bytes of a COPY line), 7 of jsonb.
_ROW_ALWAYS_FITS: Final = 2**26
#: Characters that COPY's text format sends as two bytes (psycopg's escapes).
_COPY_ESCAPED: Final = "\b\t\n\v\f\r\\"
_CHUNK: Final = 1 << 20


def text_bytes(text: str) -> int:
    """The UTF-8 size of ``text``, encoded a chunk at a time (no copy of a large string)."""
    if text.isascii():
        return len(text)
    return sum(
        len(text[n : n + _CHUNK].encode("utf-8", "surrogatepass"))
        for n in range(0, len(text), _CHUNK)
    )


def _copy_bytes(text: str) -> int:
    """The size of ``text`` in a COPY line: its UTF-8, one more byte per escape."""
    return text_bytes(text) + sum(text.count(char) for char in _COPY_ESCAPED if char in text)


def check_row_size(texts: list[str], jsons: list[str], *, copy: bool = False) -> None:
    """Raise :class:`EnqueueError` if a row holding ``texts`` (its string values) and
    ``jsons`` (the JSON text of its JSON columns) is too large for PostgreSQL to take in
    one statement (``copy``: one COPY line), or to store as one row.

    Rows of less than 64 million characters in all cannot be: that is all most rows cost.
    """
    if sum(map(len, texts)) + sum(map(len, jsons)) <= _ROW_ALWAYS_FITS:
        return
    measure = _copy_bytes if copy else text_bytes
    sent = sum(map(measure, texts)) + sum(map(measure, jsons))
    stored = sum(map(text_bytes, texts)) + sum(
        max(text_bytes(j), min(7 * len(j) + 16, MAX_JSONB_BYTES)) for j in jsons
    )
    size = max(sent, stored)
    if size > MAX_ROW_BYTES:
        raise EnqueueError(
            f"the job's text and JSON values take {size} bytes, more than PostgreSQL takes "
            f"in one row (at most {MAX_ROW_BYTES})"
        )


class _Number:
    """A JSON number, as the size of the ``numeric`` that jsonb stores for it."""

    __slots__ = ("size",)

    def __init__(self, token: str) -> None:
        self.size = _numeric_size(token)


def _numeric_size(token: str) -> int:
    """Bytes of PostgreSQL's ``numeric`` for a JSON number: base-10000 digits after
    leading and trailing zeros are stripped, 2 bytes each, after a 6-byte header (8 when
    the weight or the display scale is out of the short form's range)."""
    mantissa, _, exponent_text = token.lstrip("-").lower().partition("e")
    exponent = int(exponent_text) if exponent_text else 0
    whole, _, fraction = mantissa.partition(".")
    digits = whole + fraction
    scale = max(len(fraction) - exponent, 0)
    significant = digits.lstrip("0")
    if not significant:
        count, weight = 0, 0
    else:
        first = len(whole) - 1 + exponent - (len(digits) - len(significant))
        last = first - len(significant.rstrip("0")) + 1
        weight = first // 4
        count = weight - last // 4 + 1
    short = scale <= 63 and -64 <= weight <= 63
    return (6 if short else 8) + 2 * count


class _Object:
    """A JSON object as jsonb keeps it: one value per key (the last), keys sorted by
    length and then bytes."""

    __slots__ = ("keys", "values")

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        kept = sorted(
            ((key.encode("utf-8", "surrogatepass"), value) for key, value in dict(pairs).items()),
            key=lambda pair: (len(pair[0]), pair[0]),
        )
        self.keys = sum(len(key) for key, _ in kept)
        self.values = [value for _, value in kept]


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def jsonb_size(text: str, name: str = "value") -> int:
    """The size of JSON ``text`` in PostgreSQL's jsonb binary form, in bytes (without
    the varlena header); past :data:`MAX_JSONB_BYTES` the count stops, returning more.

    Follows ``convertToJsonb`` (jsonb_util.c): a container is a 4-byte header, a 4-byte
    entry per element (two per object pair), the keys, then the values; numbers and
    containers are aligned to 4 bytes, the padding counting in the size; a top-level
    scalar is an array of one. Measured against the server in the tests.
    """
    try:
        root = json.loads(
            text,
            parse_int=_Number,
            parse_float=_Number,
            parse_constant=_refuse_constant,
            object_pairs_hook=_Object,
        )
    except RecursionError:
        raise InvalidPayload(f"{name} is nested too deeply to be stored as JSON") from None
    except ValueError as exc:
        raise InvalidPayload(f"{name}: the JSON serializer wrote invalid JSON: {exc}") from exc
    if not isinstance(root, (list, _Object)):
        root = [root]
    start = position = 4  # after the varlena header
    stack: list[Iterator[Any]] = []
    node: Any = root
    while True:
        if isinstance(node, (list, _Object)):
            position += -position % 4
            if isinstance(node, list):
                position += 4 + 4 * len(node)
                stack.append(iter(node))
            else:
                position += 4 + 8 * len(node.values) + node.keys
                stack.append(iter(node.values))
        elif isinstance(node, str):
            position += text_bytes(node)
        elif isinstance(node, _Number):
            position += -position % 4 + node.size
        # null, true and false are their entry alone
        if position - start > MAX_JSONB_BYTES:
            return position - start
        while stack:
            node = next(stack[-1], _END)
            if node is not _END:
                break
            stack.pop()
        else:
            return position - start


_END: Final = object()


# -- single-table inheritance -------------------------------------------------------------


class Polymorphic:
    """The discriminator (``polymorphic_on``) column of a model mapped with single-table
    inheritance: the value the ORM writes for the model, and the values it may hold."""

    __slots__ = ("abstract", "accepted", "attr", "identity", "key", "model")

    def __init__(self, mapper: Mapper[Any], column: Column[Any]) -> None:
        self.model = mapper.class_.__qualname__
        #: Column key, and the attribute mapping it.
        self.key = column.key
        self.attr = mapper.get_property_by_column(column).key
        #: What the ORM sets on a new instance of the model (None: nothing).
        self.identity = mapper.polymorphic_identity
        #: ``polymorphic_abstract``: the ORM makes no instance of the model itself.
        self.abstract = bool(mapper.polymorphic_abstract)
        #: The model's identity and those of its subclasses in the same table: what the
        #: ORM can load as the model (as ``Mapper._acceptable_polymorphic_identities``).
        self.accepted = frozenset(
            m.polymorphic_identity
            for m in mapper.self_and_descendants
            if m.persist_selectable is mapper.persist_selectable and m.polymorphic_identity is not None
        )

    def resolve(self, value: Any) -> Any:
        """The discriminator to write for a row giving ``value`` (None: unset), or
        :class:`EnqueueError` for the identity of another model."""
        if value is None:
            if self.abstract:
                raise EnqueueError(
                    f"{self.model} is polymorphic_abstract: enqueue one of its subclasses, "
                    f"or set {self.key}"
                )
            return self.identity
        try:
            accepted = value in self.accepted
        except TypeError:  # unhashable
            accepted = False
        if not accepted:
            known = ", ".join(sorted(map(repr, self.accepted))) or "none"
            raise EnqueueError(
                f"{self.key}={value!r} is not a polymorphic identity of {self.model} "
                f"or its subclasses ({known})"
            )
        return value

    def fill(self, values: dict[str, Any]) -> None:
        """Set the discriminator of ``values`` (by column key) as the ORM would, or refuse it."""
        identity = self.resolve(values.get(self.key))
        if identity is not None:
            values[self.key] = identity


#: Key of the polymorphic rules in the shared cache.
_POLYMORPHIC: Final = "sqla_queue.rules.polymorphic"


def polymorphic_rule(mapper: Mapper[Any] | None, table: Table) -> Polymorphic | None:
    """The (cached) :class:`Polymorphic` rule of ``mapper``, if its ``polymorphic_on`` is
    a column of ``table``; None for a Table, or a mapping without one."""
    if mapper is None:
        return None
    key = (_POLYMORPHIC, mapper, table)
    found: tuple[Polymorphic | None] | None = plans.get(key)
    if found is None:
        column = mapper.polymorphic_on
        rule = None
        if isinstance(column, Column) and table.c.contains_column(column):
            rule = Polymorphic(mapper, column)
        found = plans.put(key, (rule,))
    return found[0]


# -- Python-side defaults -----------------------------------------------------------------


def python_default(column: Column[Any]) -> tuple[str, Any]:
    """How ``column``'s Python-side default is filled, outside SQLAlchemy's execution:
    ("none" | "scalar" | "callable" | "context" | "sql", value).

    SQLAlchemy wraps a callable that takes no argument to take the execution context
    (``__wrapped__`` is the original): "callable", the original. One that takes the context
    itself (``default=lambda ctx: …``) is "context": only SQLAlchemy's execution of an
    INSERT can evaluate it (``ctx.get_current_parameters()``). SQL expressions and
    sequences are "sql", for the INSERT too.
    """
    default: Any = column.default
    if default is None:
        return "none", None
    if default.is_scalar:
        return "scalar", default.arg
    if default.is_callable:
        wrapped = getattr(default.arg, "__wrapped__", None)
        if wrapped is not None:
            return "callable", wrapped
        return "context", default.arg
    return "sql", None


# -- per table ----------------------------------------------------------------------------

#: A check of one column's non-NULL value: (value, column key).
Check = Callable[[Any, str], None]


def _text_check(length: int | None, first: Check | None = None) -> Check:
    def check(value: Any, name: str) -> None:
        if first is not None:
            first(value, name)
        if isinstance(value, str):
            check_text(value, name, length)

    return check


def _key_check(then: Check | None) -> Check:
    def check(value: Any, name: str) -> None:
        if then is not None:
            then(value, name)
        check_key_size(value, name)

    return check


#: The queue's own columns: their type rules, before the generic text rule.
_QUEUE_CHECKS: Final[dict[str, Check]] = {
    "queue": check_queue,
    "priority": check_priority,
    "max_attempts": check_max_attempts,
    "run_after": check_run_at,
    "timeout": _check_timeout_column,
}


def stored_text_type(type_: Any) -> String | None:
    """The ``String`` that stores a column's values as given: the type itself, or the
    impl of a ``TypeDecorator`` that binds values unchanged (SQLModel's ``AutoString``,
    every ``str`` field of a SQLModel model); None for other types, whose bound value
    may not be the text the caller passed."""
    while isinstance(type_, TypeDecorator):
        cls = type(type_)
        if (
            cls.process_bind_param is not TypeDecorator.process_bind_param
            or cls.bind_expression is not TypeDecorator.bind_expression
        ):
            return None
        type_ = type_.impl_instance
    return type_ if isinstance(type_, String) else None


class TableRules:
    """The checks of one queue table's columns, resolved once per table."""

    def __init__(self, table: Table) -> None:
        #: Column key -> check of a non-NULL, non-SQL-expression value (JSON apart).
        self.checks: dict[str, Check] = {}
        #: Keys of the JSON columns, checked with the dialect's serializer.
        self.json: frozenset[str] = frozenset(
            c.key for c in table.c if isinstance(c.type, JSON)
        )
        is_task_table = "task" in table.c and "payload" in table.c
        for column in table.c:
            if column.key in self.json:
                continue
            first = _QUEUE_CHECKS.get(column.key)
            if column.key == "task" and is_task_table:
                first = check_task_name
            text_type = stored_text_type(column.type)
            if text_type is not None:
                self.checks[column.key] = _text_check(text_type.length, first)
            elif first is not None:
                self.checks[column.key] = first
        unique = unique_jobs(table)
        if unique is not None:
            key = table.c[unique.column].key
            self.checks[key] = _key_check(self.checks.get(key))

    def check(self, key: str, value: Any) -> None:
        """Raise :class:`EnqueueError` if column ``key`` cannot hold ``value``."""
        check = self.checks.get(key)
        if check is not None and value is not None:
            check(value, key)


