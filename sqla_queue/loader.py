"""Claimed rows become instances of the user's model, one row at a time.

A full ORM load (a Session, its identity map, a ``select(Model).from_statement()``) cost
more than the claim itself, and one row it could not load failed the whole batch. The
loader builds each instance as the ORM's own loading does (``new_instance()``, the
column attributes, an identity key, then the ``load`` event, so ``@reconstructor``
runs) and reports a row it cannot build as that job's error. The instance is detached:
``session.add(job)`` makes it persistent, as for any object loaded by a closed session.

As in the ORM, a column's result processor is made for the type the server reports for
it (``cursor.description``'s type code): PostgreSQL numbers are converted, or not,
according to it. With single-table inheritance each row becomes an instance of the
mapper its discriminator names, as a ``Session`` would load it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from typing import Any

from sqlalchemy import ARRAY, JSON, Column, Double, Enum, Float, Integer, String, TypeDecorator, inspect
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Mapper, attributes, configure_mappers
from sqlalchemy.orm.base import instance_dict
from sqlalchemy.orm.exc import UnmappedColumnError

__all__ = ["RowLoader", "polymorphic_column"]


def _impl(column_type: Any, dialect: Dialect) -> Any:
    impl = column_type.dialect_impl(dialect)
    while isinstance(impl, TypeDecorator):
        impl = impl.impl_instance.dialect_impl(dialect)
    return impl


def _json_kind(column_type: Any, dialect: Dialect) -> int:
    """1 for a JSON column, 2 for an array of JSON, 0 otherwise: the runtime's cursor
    reads JSON as text (so that one unparsable value fails its own job), elements of
    arrays too, and the loader parses it."""
    impl = _impl(column_type, dialect)
    if isinstance(impl, JSON):
        return 1
    if isinstance(impl, ARRAY) and isinstance(_impl(impl.item_type, dialect), JSON):
        return 2
    return 0


def _plain_array(column_type: Any, dialect: Dialect) -> bool:
    """An ``ARRAY`` (not a decorated one) that loads as the list psycopg reads: not as
    tuples, of integers or texts needing no conversion."""
    if isinstance(column_type, TypeDecorator):
        return False
    impl = column_type.dialect_impl(dialect)
    if not isinstance(impl, ARRAY) or impl.as_tuple:
        return False
    item = _impl(impl.item_type, dialect)
    # Integers and texts only: a number's processor depends on the server's type.
    plain = isinstance(item, (Integer, String)) and not isinstance(item, Enum)
    return plain and item.result_processor(dialect, None) is None


def _parse_items(value: Any, parse: Callable[[str], Any]) -> Any:
    if isinstance(value, list):
        return [_parse_items(item, parse) for item in value]
    return None if value is None else parse(value)


def polymorphic_column(mapper: Mapper[Any]) -> Column[Any] | None:
    """The discriminator column of ``mapper``'s single-table hierarchy, if it has one
    (a discriminator that is a SQL expression is not in the claimed row: such rows load
    as ``mapper``'s class)."""
    on = mapper.polymorphic_on
    if isinstance(on, Column) and on.table is mapper.local_table:
        return on
    return None


#: The type code of ``double precision``.
_FLOAT8_OID = 701


class _MapperPlan:
    """How one mapper's instance is built from a row: which columns go to which
    attributes, and which need their type's result processor."""

    def __init__(self, mapper: Mapper[Any], columns: Sequence[Column[Any]], dialect: Dialect,
                 type_codes: Mapping[str, Any] | None) -> None:
        manager = mapper.class_manager
        plain: list[tuple[str, int]] = []
        self.processed: list[tuple[str, int, Callable[[Any], Any] | None, int]] = []
        for index, column in enumerate(columns):
            try:
                prop = mapper.get_property_by_column(column)
            except UnmappedColumnError:
                continue
            coltype = type_codes.get(column.name) if type_codes is not None else None
            if coltype is None and isinstance(column.type, Float):
                # PostgreSQL's numeric processors need the server's type: the column's own.
                coltype = _FLOAT8_OID if isinstance(column.type, Double) or column.type.precision is None else None
            process = column.type.dialect_impl(dialect).result_processor(dialect, coltype)
            json_kind = _json_kind(column.type, dialect)
            if process is not None and not json_kind and _plain_array(column.type, dialect):
                process = None  # psycopg's list is the value: the processor would only copy it
            if process is None and not json_kind:
                plain.append((prop.key, index))
            else:
                self.processed.append((prop.key, index, process, json_kind))
        self.plain_keys = tuple(key for key, _ in plain)
        self.plain_values = itemgetter(*(index for _, index in plain)) if len(plain) > 1 else None
        self.plain_one = plain[0] if len(plain) == 1 else None
        self.manager = manager
        self.new_instance = manager.new_instance
        self.fire_load = bool(manager.dispatch.load)


class RowLoader:
    """Turns the claim's ``RETURNING`` rows (every table column, in table order) into
    model instances."""

    def __init__(
        self,
        model: type[Any],
        columns: Sequence[Column[Any]],
        dialect: Dialect,
        type_codes: Mapping[str, Any] | None = None,
    ) -> None:
        configure_mappers()  # instrumented attributes need configured mappers
        mapper: Any = inspect(model)
        self._mapper: Mapper[Any] = mapper
        self._columns = list(columns)
        self._dialect = dialect
        self._type_codes = dict(type_codes) if type_codes is not None else None
        self._plans: dict[Mapper[Any], _MapperPlan] = {}
        self._deserialize: Callable[[str], Any] = getattr(dialect, "_json_deserializer", None) or json.loads
        pk_columns = list(mapper.primary_key)
        where = {id(c): n for n, c in enumerate(self._columns)}  # by identity: == makes SQL
        pk_index = [where[id(c)] for c in pk_columns if id(c) in where]
        self._pk = itemgetter(*pk_index) if len(pk_index) > 1 else None
        self._pk_single = pk_index[0] if len(pk_index) == 1 else None
        self._identity_key = mapper.identity_key_from_primary_key
        #: The class part of the identity key (the mapper's base), as the ORM builds it.
        self._identity_class = mapper.identity_key_from_primary_key([None])[0]
        discriminator = polymorphic_column(mapper)
        self._discriminator = where.get(id(discriminator)) if discriminator is not None else None
        self._polymorphic_map: dict[Any, Mapper[Any]] = dict(mapper.polymorphic_map)
        #: The instance for one row; raises whatever building it raised. Without a
        #: discriminator, a function made for the model's one plan (see :meth:`_one_plan`).
        self.load: Callable[[Sequence[Any]], Any] = self._load if self._discriminator is not None else self._first

    def use_type_codes(self, type_codes: Mapping[str, Any]) -> None:
        """The type code the server reports for each column (by name), as in
        ``cursor.description``: result processors are made for them."""
        self._type_codes = dict(type_codes)
        self._plans = {}
        if self._discriminator is None:
            self.load = self._first

    def _first(self, row: Sequence[Any]) -> Any:
        """The first row since the type codes are known: make the plan's function (the
        processors need the codes, so not before), then load with it."""
        self.load = self._one_plan()
        return self.load(row)

    def _one_plan(self) -> Callable[[Sequence[Any]], Any]:
        """:meth:`_load` for a model whose rows all load as its own class, as one function
        with the plan's parts bound: every claimed row passes here, and a no-op job costs
        little more than this (no plan lookup, no mapper choice, no call per attribute)."""
        plan = self._plan(self._mapper)
        if plan.plain_values is None or self._pk_single is None or plan.manager.dict_getter() is not instance_dict:
            return self._load  # one plain column, a composite key, custom instrumentation
        new_instance = plan.new_instance
        state_of = attributes.instance_state
        keys, values_of, processed = plan.plain_keys, plan.plain_values, plan.processed
        deserialize = self._deserialize
        identity_class, pk = self._identity_class, self._pk_single
        manager, fire_load = plan.manager, plan.fire_load

        def load(row: Sequence[Any]) -> Any:
            instance = new_instance()
            values = instance.__dict__  # what instance_dict() gives (checked above)
            values.update(zip(keys, values_of(row), strict=True))
            for key, index, process, json_kind in processed:
                value = row[index]
                if json_kind and value is not None:
                    value = deserialize(value) if json_kind == 1 else _parse_items(value, deserialize)
                if process is not None:
                    value = process(value)
                values[key] = value
            state = state_of(instance)
            state.key = (identity_class, (row[pk],), None)
            if fire_load:
                manager.dispatch.load(state, None)
                state._commit_all(values)  # as the ORM does after the load event
            return instance

        return load

    def _plan(self, mapper: Mapper[Any]) -> _MapperPlan:
        plan = self._plans.get(mapper)
        if plan is None:
            plan = self._plans[mapper] = _MapperPlan(mapper, self._columns, self._dialect, self._type_codes)
        return plan

    def _mapper_of(self, row: Sequence[Any]) -> Mapper[Any]:
        if self._discriminator is None:
            return self._mapper
        identity = row[self._discriminator]
        found = self._polymorphic_map.get(identity)
        if found is None:
            raise LookupError(
                f"no mapper of {self._mapper.class_.__qualname__}'s hierarchy has the polymorphic "
                f"identity {identity!r}"
            )
        if not found.isa(self._mapper):
            raise LookupError(
                f"polymorphic identity {identity!r} is a {found.class_.__qualname__}, not a "
                f"{self._mapper.class_.__qualname__}"
            )
        return found

    def _load(self, row: Sequence[Any]) -> Any:
        """The instance for one row, any mapper of the hierarchy (see :attr:`load`)."""
        plan = self._plan(self._mapper_of(row))
        instance = plan.new_instance()
        state = attributes.instance_state(instance)
        values = state.dict
        if plan.plain_values is not None:
            values.update(zip(plan.plain_keys, plan.plain_values(row), strict=True))
        elif plan.plain_one is not None:
            values[plan.plain_one[0]] = row[plan.plain_one[1]]
        for key, index, process, json_kind in plan.processed:
            value = row[index]
            if json_kind and value is not None:
                value = self._deserialize(value) if json_kind == 1 else _parse_items(value, self._deserialize)
            if process is not None:
                value = process(value)
            values[key] = value
        if self._pk_single is not None:
            state.key = (self._identity_class, (row[self._pk_single],), None)
        else:
            state.key = self._identity_key(list(self._pk(row)) if self._pk else [])
        if plan.fire_load:
            plan.manager.dispatch.load(state, None)
            state._commit_all(values)  # as the ORM does after the load event
        return instance
