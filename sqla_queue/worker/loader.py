"""Claimed rows become instances of the user's model, one row at a time.

A full ORM load (a Session, its identity map, a ``select(Model).from_statement()``) cost
more than the claim itself, and one row it could not load failed the whole batch. The
loader builds each instance as the ORM's own loading does (``new_instance()``, the
column attributes, an identity key, then the ``load`` event, so ``@reconstructor``
runs) and reports a row it cannot build as that job's error. The instance is detached:
``session.add(job)`` makes it persistent, as for any object loaded by a closed session.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import JSON, Column, TypeDecorator, inspect
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import attributes, configure_mappers
from sqlalchemy.orm.exc import UnmappedColumnError

__all__ = ["RowLoader"]


def _is_json(column_type: Any, dialect: Dialect) -> bool:
    impl = column_type.dialect_impl(dialect)
    while isinstance(impl, TypeDecorator):
        impl = impl.impl_instance.dialect_impl(dialect)
    return isinstance(impl, JSON)


class RowLoader:
    """Turns the claim's ``RETURNING`` rows (every table column, in table order) into
    model instances."""

    def __init__(self, model: type[Any], columns: Sequence[Column[Any]], dialect: Dialect) -> None:
        configure_mappers()  # instrumented attributes need configured mappers
        mapper = inspect(model)
        self._mapper = mapper
        self._manager = mapper.class_manager
        self._cls = model
        deserialize: Callable[[str], Any] = getattr(dialect, "_json_deserializer", None) or json.loads
        self._fields: list[tuple[str, int, Callable[[Any], Any] | None, bool]] = []
        pk_columns = list(mapper.primary_key)
        self._pk_index = [list(columns).index(c) for c in pk_columns] if all(
            c in columns for c in pk_columns
        ) else []
        for index, column in enumerate(columns):
            try:
                prop = mapper.get_property_by_column(column)
            except UnmappedColumnError:
                continue
            process = column.type._cached_result_processor(dialect, None)
            self._fields.append((prop.key, index, process, _is_json(column.type, dialect)))
        self._deserialize = deserialize
        self._fire_load = bool(self._manager.dispatch.load)

    def load(self, row: Sequence[Any]) -> Any:
        """The instance for one row; raises whatever building it raised."""
        instance = self._manager.new_instance()
        state = attributes.instance_state(instance)
        values = state.dict
        deserialize = self._deserialize
        for key, index, process, is_json in self._fields:
            value = row[index]
            if is_json and value is not None:
                value = deserialize(value)
            if process is not None:
                value = process(value)
            values[key] = value
        state.key = self._mapper.identity_key_from_primary_key([row[i] for i in self._pk_index])
        if self._fire_load:
            self._manager.dispatch.load(state, None)
        state._commit_all(values)
        return instance
