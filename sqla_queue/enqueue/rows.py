"""Row plans: how a job's values become a row of its queue table, worked out once.

The three enqueue paths write the same rows: ``enqueue()`` (an ORM object, inserted by
the session's flush), ``enqueue_many()`` (dicts or instances, by COPY or executemany) and
``enqueue_values()`` (one dict, one ``INSERT … RETURNING`` on the driver's cursor). What
depends only on the model, the dialect and which columns a call gives is resolved here,
once, and shared by the three:

- :class:`TablePlan`, per model: the columns' rules (types, lengths, characters, sizes:
  :mod:`sqla_queue._rules`), which columns are JSON, the Python-side defaults (scalars,
  callables, and those taking SQLAlchemy's execution context), generated and NOT NULL
  columns, the columns the queue manages, the discriminator of single-table
  inheritance, and the queue a row left without one is woken on;
- :class:`DialectPlan`, per model and dialect: the JSON serializer, the type converters,
  whether COPY can fill the table as an INSERT would, and the :class:`RowShape` of each
  set of columns a bulk row gives (its checks, the options and defaults that fill the
  others, the order COPY writes them in);
- :class:`InsertPlan`, per model, dialect, schema map and set of columns given: the
  compiled INSERT of ``enqueue_values()`` with its NOTIFY and its fixed parameters.

Every plan lives in the one bounded cache (:data:`sqla_queue.cache.plans`). Checking a
row is then a walk over lists made for its shape: no per-row set arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from itertools import islice
from operator import itemgetter
from typing import Any, Final

from sqlalchemy import JSON, Column, Table, bindparam, insert, inspect, literal_column, select
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Mapper, object_mapper
from sqlalchemy.orm import attributes as orm_attributes
from sqlalchemy.orm.exc import UnmappedInstanceError
from sqlalchemy.sql.base import Executable
from sqlalchemy.sql.elements import ClauseElement, ColumnElement, False_, Null, True_

from ..cache import plans
from ..dbapi import SchemaMapKey, compile_statement
from ..errors import BulkRowError, EnqueueError, NotAQueueModel
from ..model import (
    DEFAULT_QUEUE,
    WAKE_AFTER_COMMIT,
    WAKE_NONE,
    QueueTable,
    UniqueJobs,
    notify_channel,
    queue_table,
    unique_jobs,
    wake_mode,
)
from ..sql import delay_from_insert, insert_unique
from ..sql._notify import pg_notify
from ..tracing import TRACE_COLUMN, current_trace_context
from ._rules import (
    MANAGED_KEYS,
    Polymorphic,
    TableRules,
    check_json,
    check_row_size,
    check_task_name,
    dialect_json_serializer,
    managed_violation,
    polymorphic_rule,
    python_default,
)

__all__ = [
    "DELAY_PARAM",
    "DialectPlan",
    "InsertPlan",
    "RowShape",
    "RowWriter",
    "TablePlan",
    "default_queue",
    "insert_plan",
    "queue_table_of",
    "table_plan",
]

#: The parameter of ``enqueue_values()``'s INSERT that carries the delay in seconds.
DELAY_PARAM: Final = "sqla_queue_delay_seconds"
#: ``DEFAULT`` in the VALUES list: the column's server default.
_DEFAULT: ColumnElement[Any] = literal_column("DEFAULT")
#: Bulk row shapes kept per plan and set of options (a new one past that starts afresh).
_MAX_SHAPES: Final = 256
#: Values that are never SQL expressions: the common case skips the isinstance check.
_PLAIN: Final = frozenset({int, str, float, bool, type(None), dict, list})


# -- models -------------------------------------------------------------------------------


def queue_table_of(obj: Any) -> QueueTable | None:
    """The queue table of a mapped instance, or None if it is not a queue model's
    (known per class: the outbox asks it of every new object of every flush)."""
    key = (_QUEUE_TABLE_OF, type(obj))
    found: QueueTable | bool | None = plans.get(key)
    if found is None:
        try:
            mapper = object_mapper(obj)
        except UnmappedInstanceError:
            return None  # not remembered: the class may be mapped later
        try:
            found = queue_table(mapper.class_)
        except NotAQueueModel:
            found = False
        plans.put(key, found)
    return found if isinstance(found, QueueTable) else None


#: Key of :func:`queue_table_of`'s answers in the shared cache.
_QUEUE_TABLE_OF: Final = "sqla_queue.rows.queue_table_of"


def default_queue(table: Table) -> str:
    """The queue a row that does not name one goes to: the column's scalar default."""
    arg = getattr(table.c.queue.default, "arg", None)
    return arg if isinstance(arg, str) and arg else DEFAULT_QUEUE


def table_plan(model: Any) -> TablePlan:
    """The (cached) plan of a queue model class, an instance of one, or its ``Table``.

    Raises :class:`~sqla_queue.NotAQueueModel` for anything else.
    """
    plan: TablePlan | None = plans.get(model)
    if plan is None:
        plan = TablePlan(queue_table(model))
        if isinstance(model, (type, Table)):  # not instances: they would pile up
            plans.put(model, plan)
    return plan


class TablePlan:
    """What one queue model's rows need, whatever the dialect or the call."""

    def __init__(self, qt: QueueTable) -> None:
        table = qt.table
        self.qt = qt
        self.table = table
        #: How a Session finds the bind of the table.
        self.bind_arguments: dict[str, Any] = (
            {"mapper": qt.mapped_class} if qt.mapped_class is not None else {"clause": table}
        )
        self.mapper: Mapper[Any] | None = inspect(qt.mapped_class) if qt.mapped_class is not None else None
        #: The discriminator of single-table inheritance: the model's identity, as the ORM.
        self.polymorphic: Polymorphic | None = polymorphic_rule(self.mapper, table)
        self.rules = TableRules(table)
        self.columns: dict[str, Column[Any]] = {c.key: c for c in table.c}
        self.order = {key: n for n, key in enumerate(self.columns)}
        self.pk_key = qt.pk.key
        self.is_task_table = qt.is_task_table
        #: The key of the column enqueuers store the trace context in, if the table has it.
        self.trace_key: str | None = TRACE_COLUMN if TRACE_COLUMN in self.columns else None
        self.default_queue = default_queue(table)
        #: (key, is_callable, value) of the Python defaults filled outside SQLAlchemy.
        self.defaults: list[tuple[str, bool, Any]] = []
        #: Defaults only an INSERT can evaluate: a SQL expression or sequence ("sql"), a
        #: function of SQLAlchemy's execution context ("context").
        self.insert_only: dict[str, str] = {}
        for key, column in self.columns.items():
            kind, value = python_default(column)
            if kind in ("scalar", "callable"):
                self.defaults.append((key, kind == "callable", value))
            elif kind in ("sql", "context"):
                self.insert_only[key] = kind
        self.contextual = frozenset(key for key, kind in self.insert_only.items() if kind == "context")
        #: Written by the database only: COPY or INSERT into them fails.
        self.generated = frozenset(
            key
            for key, c in self.columns.items()
            if c.computed is not None or (c.identity is not None and c.identity.always)
        )
        autoincrement = table.autoincrement_column
        #: NOT NULL and nothing fills them when neither the row nor an option does.
        self.required = frozenset(
            key
            for key, c in self.columns.items()
            if not c.nullable
            and c.default is None
            and c.server_default is None
            and c.identity is None
            and c is not autoincrement
            and key not in self.generated
        )
        self.not_null = frozenset(key for key, c in self.columns.items() if not c.nullable)
        #: Columns whose type writes a None as a value (JSON's 'null'), not as "unset".
        self.evaluates_none = frozenset(key for key, c in self.columns.items() if c.type.should_evaluate_none)
        #: Columns whose scalar Python default the server default repeats: a row written
        #: by an INSERT of our own may leave them to the server (less to send and bind).
        self.server_same = frozenset(
            key
            for key, c in self.columns.items()
            if c.default is not None and c.default.is_scalar and _server_says_the_same(c)
        )
        #: Unique jobs: the declaration, and the key of the column holding the keys.
        self.unique: UniqueJobs | None = unique_jobs(table)
        self.unique_column: str | None = self.unique.column if self.unique is not None else None
        #: The mapped attribute of that column (None: no key, or a Table without a model).
        self.unique_attr: str | None = None
        if self.unique_column is not None and self.mapper is not None:
            self.unique_attr = self.mapper.get_property_by_column(table.c[self.unique_column]).key
        self._instances: dict[Mapper[Any], tuple[tuple[tuple[str, str], ...], tuple[str, ...]]] = {}
        self._dialects: dict[Dialect, DialectPlan] = {}

    def dialect(self, dialect: Dialect) -> DialectPlan:
        """The part of the plan that depends on ``dialect`` (made on first use)."""
        found = self._dialects.get(dialect)
        if found is None:
            if len(self._dialects) >= 8:
                self._dialects.clear()
            found = self._dialects[dialect] = DialectPlan(self, dialect)
        return found

    def instance_attrs(self, mapper: Mapper[Any]) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
        """(attribute key, column key) of ``mapper``'s columns in the table, and its
        relationships."""
        found = self._instances.get(mapper)
        if found is None:
            found = self._instances[mapper] = (
                tuple(
                    (prop.key, prop.columns[0].key)
                    for prop in mapper.column_attrs
                    if prop.columns[0].table is self.table
                ),
                tuple(rel.key for rel in mapper.relationships),
            )
        return found

    def key_values(self, values: dict[str, Any], unique_key: Any) -> None:
        """Set the key column in ``values`` to the ``unique_key=`` option, checked by the
        column's rules (a string's length, …)."""
        column = self.unique_column
        if column is None:
            raise EnqueueError(
                f"unique_key: table {self.table.fullname!r} has no unique key column (its model "
                "needs sqla_queue.JobMixin's unique_key column, or a UniqueJobs declaration)"
            )
        self.rules.check(column, unique_key)
        values[column] = unique_key

    def check_options(self, values: Mapping[str, Any]) -> None:
        """The options' column values meet the columns' rules too (lengths)."""
        for key, value in values.items():
            self.rules.check(key, value)

    # -- enqueue(): an ORM object -------------------------------------------------------

    def check_job(
        self,
        job: Any,
        mapper: Mapper[Any],
        options: dict[str, Any],
        serializer: Callable[[], Callable[[Any], Any]],
    ) -> None:
        """A new ORM object's values, with ``options`` over them, through the rules
        ``enqueue_many()`` applies to its rows too: what would only fail at flush or
        commit, taking the caller's transaction with it, fails here, naming the column.

        Unset and ``None`` values are left to the column defaults (the ORM omits them
        from the INSERT, and evaluates Python and contextual defaults itself) and SQL
        expressions to the database; a discriminator of single-table inheritance set to
        None gets the model's identity (added to ``options``, set on the job with them),
        and one naming another model is refused. ``mapper`` is the job's own (a
        subclass's, with inheritance); ``serializer()`` gives the JSON serializer of the
        session's dialect, asked for only when a JSON value is set.
        """
        data = orm_attributes.instance_state(job).dict
        violation = managed_violation(data)
        if violation is not None:
            key, value = violation
            raise EnqueueError(
                f"{_describe(job)} has {key}={value!r}; the queue manages {key}, leave it unset"
            )
        rules = self.rules
        dumps: Callable[[Any], Any] | None = None
        texts: list[str] = []
        jsons: list[str] = []
        try:
            if self.is_task_table:
                check_task_name(options.get("task", data.get("task")))
            for attr, key in self.instance_attrs(mapper)[0]:
                if key in options:
                    value = options[key]
                elif attr in data:
                    value = data[attr]
                else:
                    continue
                if value is None or isinstance(value, ClauseElement):
                    continue
                if key in rules.json:
                    if value is not JSON.NULL:
                        dumps = dumps or serializer()
                        jsons.append(check_json(value, key, dumps))
                else:
                    rules.check(key, value)
                    if isinstance(value, str):
                        texts.append(value)
            check_row_size(texts, jsons)
            polymorphic = self.polymorphic if mapper is self.mapper else polymorphic_rule(mapper, self.table)
            if polymorphic is not None:
                given = data.get(polymorphic.attr)
                identity = polymorphic.resolve(given)
                if given is None and identity is not None:
                    options[polymorphic.attr] = identity
        except EnqueueError as exc:
            raise type(exc)(f"{_describe(job)}: {exc}") from exc.__cause__


def _describe(job: Any) -> str:
    return f"{type(job).__qualname__} job"


def _has_bind_expression(column: Column[Any], dialect: Dialect) -> bool:
    """The column's type puts SQL around its bound value (``TypeDecorator.bind_expression``)."""
    return bool(column.type.dialect_impl(dialect)._has_bind_expression)


class DialectPlan:
    """A :class:`TablePlan` for one dialect: JSON, converters, COPY, bulk row shapes."""

    def __init__(self, plan: TablePlan, dialect: Dialect) -> None:
        self.plan = plan
        self.dialect = dialect
        table = plan.table
        self.serializer = dialect_json_serializer(dialect)
        #: JSON column key -> (serializer, whether None is SQL NULL for its type).
        self.json: dict[str, tuple[Callable[[Any], Any], bool]] = {}
        #: Column key -> the driver converter of its type (not JSON, not bind_expression).
        self.processors: dict[str, Callable[[Any], Any]] = {}
        expressions: list[str] = []
        for key, column in plan.columns.items():
            impl = column.type.dialect_impl(dialect)
            if isinstance(column.type, JSON):
                self.json[key] = (self.serializer, bool(getattr(impl, "none_as_null", False)))
                continue
            if _has_bind_expression(column, dialect):
                expressions.append(key)
                continue  # bound inside the expression, as its type says: left to the INSERT
            processor = impl.bind_processor(dialect)
            if processor is not None:
                self.processors[key] = processor
        #: Why COPY cannot write to the table as an INSERT would, or None if it can.
        self.copy_impossible: str | None = None
        if dialect.name != "postgresql":
            self.copy_impossible = f"COPY needs PostgreSQL, the session's database is {dialect.name}"
        elif dialect.driver != "psycopg":
            self.copy_impossible = f"COPY needs the psycopg 3 driver, the session uses {dialect.driver}"
        elif plan.insert_only:
            self.copy_impossible = (
                f"column(s) {', '.join(plan.insert_only)} of {table.fullname} have defaults that only "
                "an INSERT can evaluate (SQL expressions, sequences or context-sensitive functions)"
            )
        elif expressions:
            self.copy_impossible = (
                f"column(s) {', '.join(expressions)} of {table.fullname} have a type whose "
                "bind_expression wraps the value in SQL (pgp_sym_encrypt(), …), which only an "
                "INSERT applies: COPY would store the value as given"
            )
        self._shapes: dict[tuple[frozenset[str], bool, bool], dict[tuple[str, ...], RowShape]] = {}

    def shapes(
        self, options: frozenset[str], for_copy: bool, server_fills: bool = False
    ) -> dict[tuple[str, ...], RowShape]:
        """The bulk row shapes of calls with these option columns (filled as rows come)."""
        key = (options, for_copy, server_fills)
        found = self._shapes.get(key)
        if found is None:
            if len(self._shapes) >= 64:
                self._shapes.clear()
            found = self._shapes[key] = {}
        return found


# -- enqueue_many(): rows ------------------------------------------------------------------


class RowShape:
    """What a bulk row giving a given set of columns needs: checks, fills, order.

    Made once per set of columns given (and set of options), so that a row's work is a
    walk over these lists: its given values checked, the options and defaults filled in,
    its JSON encoded and its values converted, in the order COPY writes them.
    """

    __slots__ = (
        "disc",
        "error",
        "fill_defaults",
        "fill_options",
        "final",
        "getter",
        "given",
        "json",
        "managed",
        "missing",
        "pk_given",
        "processors",
        "without_pk",
    )

    def __init__(
        self, dp: DialectPlan, keys: tuple[str, ...], options: frozenset[str], *, pk_removed: bool = False,
        server_fills: bool = False,
    ) -> None:
        plan = dp.plan
        self.without_pk: RowShape | None = None
        #: Raised for every row of this shape (unknown columns; an abstract model).
        self.error: str | None = None
        unknown = set(keys) - plan.columns.keys()
        if unknown:
            names = ", ".join(sorted(map(repr, unknown)))
            self.error = f"unknown column(s) for table {plan.table.fullname}: {names}"
        #: Whether the row gives the primary key (None there means "generate it").
        self.pk_given = plan.pk_key in keys and not pk_removed
        given = list(keys)
        #: The discriminator: (key, given?, identity to write when not given).
        self.disc: tuple[str, bool, Any] | None = None
        poly = plan.polymorphic
        if poly is not None and self.error is None:
            if poly.key in keys:
                self.disc = (poly.key, True, None)
            else:
                try:
                    identity = poly.resolve(None)
                except EnqueueError as exc:
                    self.error = str(exc)
                    identity = None
                if identity is not None:
                    self.disc = (poly.key, False, identity)
                    given.append(poly.key)
        checks = plan.rules.checks
        json_keys = dp.json.keys()
        #: Per given column: (key, generated?, None refused?, JSON?, check of a value).
        self.given: tuple[tuple[str, bool, bool, bool, Any], ...] = tuple(
            (
                key,
                key in plan.generated,
                key in plan.not_null and key not in json_keys,
                key in json_keys,
                checks.get(key),
            )
            for key in given
            if key in plan.columns
        )
        present = set(given)
        #: Whether the row sets a column the queue manages (then its values are looked at).
        self.managed = not present.isdisjoint(MANAGED_KEYS)
        self.fill_options = tuple(key for key in options if key not in present)
        present.update(options)
        # server_fills: the defaults the server default repeats are left out of the row
        # (its INSERT sends DEFAULT), the others filled as an ORM insert fills them.
        skipped = plan.server_same if server_fills else frozenset()
        self.fill_defaults = tuple(
            item for item in plan.defaults if item[0] not in present and item[0] not in skipped
        )
        present.update(key for key, _, _ in plan.defaults if key not in skipped)
        missing = (plan.required - options) - present
        #: Raised after the defaults: NOT NULL columns nothing fills.
        self.missing = (
            f"missing a value for NOT NULL column(s) {', '.join(sorted(missing))}" if missing else None
        )
        self.json = tuple((key, *dp.json[key]) for key in dp.json if key in present)
        self.processors = tuple((key, dp.processors[key]) for key in dp.processors if key in present)
        order = plan.order
        final = tuple(sorted((key for key in present if key in order), key=order.__getitem__))
        #: The columns the row sets, in table order (one COPY or executemany per shape).
        self.final = final
        self.getter: Callable[[Any], Any] = (
            itemgetter(*final) if len(final) > 1 else (lambda v: (v[final[0]],))
        )


class RowWriter:
    """The rows of one ``enqueue_many()`` call become column values: checked, filled with
    the call's options and the columns' defaults, encoded for COPY when it is used.

    Collects the queues written (:attr:`queues`), to wake them on commit.
    """

    def __init__(
        self, dp: DialectPlan, options: dict[str, Any], *, for_copy: bool, server_fills: bool = False
    ) -> None:
        plan = dp.plan
        self.dp = dp
        self.plan = plan
        self.table = plan.table
        self.for_copy = for_copy
        trace_key = plan.trace_key
        if trace_key is not None and trace_key not in options:
            context = current_trace_context()  # once per call, the same for every row
            if context is not None:
                options = {**options, trace_key: context}
        self.options = options
        self.default_queue = plan.default_queue
        self.queues: set[str] = set()
        self._option_keys = frozenset(options)
        #: Leave to the server the defaults it repeats (the statement must send DEFAULT).
        self.server_fills = server_fills
        self._shapes = dp.shapes(self._option_keys, for_copy, server_fills)

    def batches(
        self, first: list[Any], rows: Iterator[Any], size: int
    ) -> Iterator[list[tuple[tuple[str, ...], Any]]]:
        """Validated batches: (shape, values) per row; the raw rows are dropped as we go."""
        index = 0
        chunk = first
        del first
        while chunk:
            out = [self.row(index + n, raw) for n, raw in enumerate(chunk)]
            index += len(chunk)
            chunk = []
            yield out
            del out
            chunk = list(islice(rows, size))

    def row(self, index: int, raw: Any) -> tuple[tuple[str, ...], Any]:
        try:
            return self._row(raw)
        except EnqueueError as exc:
            raise BulkRowError(index, str(exc)) from exc

    def _shape(self, keys: tuple[str, ...]) -> RowShape:
        if len(self._shapes) >= _MAX_SHAPES:
            self._shapes.clear()
        shape = self._shapes[keys] = RowShape(self.dp, keys, self._option_keys, server_fills=self.server_fills)
        return shape

    def _row(self, raw: Any) -> tuple[tuple[str, ...], Any]:
        values = dict(raw) if type(raw) is dict or isinstance(raw, Mapping) else self._instance_values(raw)
        keys = tuple(values)
        shape = self._shapes.get(keys) or self._shape(keys)
        if shape.error is not None:
            raise EnqueueError(shape.error)
        if shape.pk_given and values[self.plan.pk_key] is None:
            del values[self.plan.pk_key]  # as the ORM does: None means "generate it"
            if shape.without_pk is None:
                shape.without_pk = RowShape(
                    self.dp, tuple(values), self._option_keys, pk_removed=True, server_fills=self.server_fills
                )
            shape = shape.without_pk
        if shape.disc is not None:
            key, given, identity = shape.disc
            if given:
                identity = self.plan.polymorphic.resolve(values[key])  # type: ignore[union-attr]
            if identity is not None:
                values[key] = identity
        texts: list[str] = []
        for key, generated, null_refused, is_json, check in shape.given:
            value = values[key]
            if generated:
                raise EnqueueError(f"column {key} is generated by the database, leave it unset")
            if type(value) not in _PLAIN and isinstance(value, ClauseElement):
                if not isinstance(value, Null):
                    raise EnqueueError(
                        f"{key} is a SQL expression; enqueue_many writes plain values "
                        "(for run_after use delay= or run_at=)"
                    )
                if not is_json:
                    values[key] = value = None
            if value is None:
                if null_refused:
                    raise EnqueueError(f"{key} is NOT NULL, got None")
            elif check is not None:
                check(value, key)
                if isinstance(value, str):
                    texts.append(value)
        if shape.managed:
            violation = managed_violation(values)
            if violation is not None:
                key, value = violation
                raise EnqueueError(f"{key}={value!r}: the queue manages {key}, leave it unset")
        if shape.fill_options:
            options = self.options
            for key in shape.fill_options:
                values[key] = options[key]
        for key, is_callable, default in shape.fill_defaults:
            values[key] = default() if is_callable else default
        if self.plan.is_task_table:
            check_task_name(values.get("task"))
        if shape.missing is not None:
            raise EnqueueError(shape.missing)
        for_copy = self.for_copy
        jsons: list[str] = []
        for key, serializer, none_as_null in shape.json:
            encoded = self._json(key, values[key], serializer, none_as_null)
            if encoded is not None:
                jsons.append(encoded)
            if for_copy:
                values[key] = encoded
        check_row_size(texts, jsons, copy=for_copy)
        for key, processor in shape.processors:
            value = values[key]
            if value is not None:
                try:
                    processed = processor(value)
                except (TypeError, ValueError, LookupError) as exc:
                    raise EnqueueError(f"{key}: {exc}") from exc
                if for_copy:
                    values[key] = processed
        self.queues.add(values.get("queue") or self.default_queue)
        return shape.final, (shape.getter(values) if for_copy else values)

    def _json(
        self, key: str, value: Any, serializer: Callable[[Any], Any], none_as_null: bool
    ) -> str | None:
        """The JSON text COPY writes (None: SQL NULL), with SQLAlchemy's NULL rules."""
        if isinstance(value, Null) or (value is None and none_as_null):
            if key in self.plan.not_null:
                raise EnqueueError(f"{key} is NOT NULL, got SQL NULL")
            return None
        if value is JSON.NULL:
            value = None
        return check_json(value, key, serializer)

    def _instance_values(self, obj: Any) -> dict[str, Any]:
        try:
            state = orm_attributes.instance_state(obj)
        except AttributeError:
            raise EnqueueError(
                f"expected a dict of column values or a new instance of the queue model, "
                f"got {type(obj).__qualname__}"
            ) from None
        mapper = state.mapper
        if mapper.local_table is not self.table:
            raise EnqueueError(
                f"a {mapper.class_.__qualname__} is not a row of table {self.table.fullname}"
            )
        attrs, relationships = self.plan.instance_attrs(mapper)
        if not state.transient:
            raise EnqueueError(
                f"{type(obj).__qualname__} is already in a session or persistent; "
                "enqueue_many writes new rows only"
            )
        data = state.dict
        for rel in relationships:
            if data.get(rel):
                raise EnqueueError(
                    f"relationship {rel!r} is set; enqueue_many does not follow "
                    "relationships, set the foreign key column instead"
                )
        # A Pydantic model (SQLModel) holds a value for every field, its default where
        # the caller set none: only the fields set count, so options apply to the rest.
        explicit = getattr(obj, "__pydantic_fields_set__", None)
        # An attribute set to None is left out, as the ORM's INSERT leaves it out (unless
        # the type stores None, as JSON does): the column's default then applies.
        evaluates_none = self.plan.evaluates_none
        return {
            column_key: data[attr]
            for attr, column_key in attrs
            if attr in data
            and (explicit is None or attr in explicit)
            and (data[attr] is not None or column_key in evaluates_none)
        }


# -- enqueue_values(): one INSERT ---------------------------------------------------------


def insert_plan(
    plan: TablePlan, dialect: Dialect, row: Mapping[str, Any], delayed: bool, schemas: SchemaMapKey = None,
    keyed: bool = False,
) -> InsertPlan:
    """The (cached) :class:`InsertPlan` of a call giving ``row``'s columns, once ``row``
    meets its checks. ``schemas``: the ``schema_translate_map`` the statement renders;
    ``keyed``: the row has a unique key (``ON CONFLICT DO NOTHING``)."""
    key = (plan.table, dialect, schemas, delayed, keyed, *row)
    found: InsertPlan | None = plans.get(key)
    if found is None:
        found = plans.put(key, InsertPlan(plan, frozenset(row), delayed, dialect, schemas, keyed))
    found.check(row)
    return found


class InsertPlan:
    """The INSERT of ``enqueue_values()`` for one set of given columns: how to check
    them, how to fill the others, and the wake-up riding in the statement."""

    def __init__(
        self, plan: TablePlan, keys: frozenset[str], delayed: bool, dialect: Dialect, schemas: SchemaMapKey = None,
        keyed: bool = False,
    ) -> None:
        table = plan.table
        #: A keyed row: the INSERT skips a duplicate (no row comes back) instead of failing.
        self.keyed = keyed
        #: The ``schema_translate_map`` rendered into the SQL (frozen).
        self.schemas = schemas
        translate = dict(schemas) if schemas else None
        channel = notify_channel(table, translate)
        unknown = sorted(keys - plan.columns.keys())
        if unknown:
            raise EnqueueError(f"{table.name} has no column {', '.join(map(repr, unknown))}")
        rules = plan.rules
        serializer = plan.dialect(dialect).serializer
        #: The JSON columns given (checked even when None: JSON null is a value).
        self.json: list[tuple[str, Callable[[Any], Any]]] = [(key, serializer) for key in sorted(rules.json & keys)]
        #: The other given columns that have a check, and the check.
        self.checks: list[tuple[str, Callable[[Any, str], None]]] = [
            (key, rules.checks[key]) for key in sorted(keys - rules.json) if key in rules.checks
        ]
        values: dict[str, Any] = {key: bindparam(key, type_=table.c[key].type) for key in keys}
        scalars: dict[str, Any] = {}
        #: Columns filled per row by a Python callable default.
        self.callables: list[tuple[str, Callable[[], Any]]] = []
        #: A column left out has a default that takes SQLAlchemy's execution context
        #: (``default=lambda ctx: ctx.get_current_parameters()…``): only SQLAlchemy's
        #: execution of the INSERT can evaluate it, so the plan leaves every default to it.
        contextual = bool(plan.contextual - keys)
        for column in table.c:
            if contextual or column.key in keys or column.default is None:
                continue
            default: Any = column.default
            if getattr(default, "is_sequence", False) or getattr(default, "is_identity", False):
                continue
            if default.is_clause_element:
                values[column.key] = default.arg
            elif default.is_callable:
                values[column.key] = bindparam(column.key, type_=column.type)
                self.callables.append((column.key, _no_context(default.arg)))
            elif default.is_scalar:
                if _server_says_the_same(column):
                    values[column.key] = _DEFAULT  # the server fills it in alike: one parameter less
                    continue
                values[column.key] = bindparam(column.key, type_=column.type)
                scalars[column.key] = default.arg
        if delayed:
            values["run_after"] = delay_from_insert(bindparam(DELAY_PARAM))  # type: ignore[arg-type]
        (pk,) = table.primary_key.columns
        # The wake-up rides in the INSERT itself: WITH job AS (INSERT … RETURNING) SELECT
        # pk, pg_notify(channel, job.queue). PostgreSQL delivers it only on commit, once per
        # queue per transaction, and an autocommit insert takes a single round trip.
        # A model waking after the commit (``__queue_wake__``) returns the queue instead:
        # the caller hands it to the outbox for after the COMMIT (psycopg only).
        self.statement: Executable
        #: The wake-up's channel, and whether it goes after the commit (else it is here).
        self.channel = channel
        mode = wake_mode(table)
        self.after = mode == WAKE_AFTER_COMMIT and dialect.driver == "psycopg"
        notifies = mode != WAKE_NONE and not self.after
        into = insert_unique(table) if keyed else insert(table)
        if contextual:
            # SQLAlchemy evaluates such defaults for a top-level INSERT only (the context's
            # current parameters are its own): the wake-up rides in its RETURNING.
            notify = pg_notify(channel, table.c.queue) if notifies else table.c.queue
            self.statement = into.values(values).returning(pk, notify)
        else:
            job = into.values(values).returning(pk, table.c.queue).cte("sqla_queue_job")
            second = pg_notify(channel, job.c.queue) if notifies else job.c.queue
            self.statement = select(job.c[pk.name], second)
        #: On psycopg, the statement runs on the driver's cursor (sync, or awaited on the
        #: async one): SQLAlchemy's execution machinery would cost more Python time than
        #: the round trip. Not for a contextual default, which only that machinery evaluates.
        self.direct = dialect.driver == "psycopg" and not dialect.is_async and not contextual
        self.direct_async = dialect.driver == "psycopg" and dialect.is_async and not contextual
        compiled = compile_statement(self.statement, dialect, translate)
        self.sql = compiled.sql
        #: The SQLAlchemy-level values of the scalar defaults (for ``Connection.execute``).
        self.scalars = scalars
        processors = compiled.processors
        per_call = set(keys) | {key for key, _ in self.callables} | {DELAY_PARAM}
        #: Every parameter that does not change per call, ready for the driver: the
        #: compiled literals and the scalar defaults, converted once here.
        self.fixed: dict[str, Any] = {
            name: value for name, value in compiled.defaults.items() if name not in per_call
        }
        self.fixed.update(scalars)
        for name, value in self.fixed.items():
            process = processors.get(name)
            if process is not None and value is not None:
                self.fixed[name] = process(value)
        #: The converters of the parameters that change per call.
        self.processors: list[tuple[str, Callable[[Any], Any]]] = [
            (name, process) for name, process in processors.items() if name in per_call
        ]

    def check(self, row: Mapping[str, Any]) -> None:
        violation = managed_violation(row)
        if violation is not None:
            key, value = violation
            raise EnqueueError(f"{key} is managed by the queue; do not set it (got {value!r})")
        jsons = [check_json(row[key], key, serializer) for key, serializer in self.json]
        texts: list[str] = []
        for key, check in self.checks:
            value = row[key]
            if value is not None:
                check(value, key)
                if isinstance(value, str):
                    texts.append(value)
        check_row_size(texts, jsons)

    def params(self, row: Mapping[str, Any], delay: float | None) -> dict[str, Any]:
        """The parameters for ``Connection.execute`` (SQLAlchemy converts them)."""
        params = dict(row)
        params.update(self.scalars)
        for key, make in self.callables:
            params[key] = make()
        if delay is not None:
            params[DELAY_PARAM] = delay
        return params

    def driver_params(self, row: Mapping[str, Any], delay: float | None) -> dict[str, Any]:
        """The parameters for the psycopg cursor, converted as SQLAlchemy would."""
        params = dict(self.fixed)
        params.update(row)
        for key, make in self.callables:
            params[key] = make()
        if delay is not None:
            params[DELAY_PARAM] = delay
        for name, process in self.processors:
            value = params[name]
            if value is not None:
                params[name] = process(value)
        return params


def _server_says_the_same(column: Any) -> bool:
    """The column's server default is the literal its Python default would send (the
    mixin's columns: ``default=0, server_default=text("0")``, ``default=False,
    server_default=false()``)."""
    server = column.server_default
    arg = getattr(server, "arg", None)
    python = column.default.arg
    if arg is None:
        return False
    if isinstance(python, bool):
        return (python is False and isinstance(arg, False_)) or (python is True and isinstance(arg, True_))
    text = arg if isinstance(arg, str) else getattr(arg, "text", None)
    return text is not None and text.strip("'") == str(python)


def _no_context(fn: Callable[..., Any]) -> Callable[[], Any]:
    """SQLAlchemy wraps a default's zero-argument callable to take an execution context."""
    return lambda: fn(None)
