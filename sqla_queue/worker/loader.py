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
from operator import itemgetter
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
        pk_columns = list(mapper.primary_key)
        column_list = list(columns)
        pk_index = [column_list.index(c) for c in pk_columns if c in column_list]
        self._pk = itemgetter(*pk_index) if len(pk_index) > 1 else None
        self._pk_single = pk_index[0] if len(pk_index) == 1 else None
        plain: list[tuple[str, int]] = []
        self._processed: list[tuple[str, int, Callable[[Any], Any] | None, bool]] = []
        for index, column in enumerate(columns):
            try:
                prop = mapper.get_property_by_column(column)
            except UnmappedColumnError:
                continue
            process = column.type._cached_result_processor(dialect, None)
            is_json = _is_json(column.type, dialect)
            if process is None and not is_json:
                plain.append((prop.key, index))
            else:
                self._processed.append((prop.key, index, process, is_json))
        self._plain_keys = tuple(key for key, _ in plain)
        self._plain_values = itemgetter(*(index for _, index in plain)) if len(plain) > 1 else None
        self._plain_one = plain[0] if len(plain) == 1 else None
        self._deserialize = deserialize
        self._identity_key = mapper.identity_key_from_primary_key
        #: The class part of the identity key (the mapper's base), as the ORM builds it.
        self._identity_class = mapper.identity_key_from_primary_key([None])[0]
        self._new_instance = self._manager.new_instance
        self._fire_load = bool(self._manager.dispatch.load)

    def load(self, row: Sequence[Any]) -> Any:
        """The instance for one row; raises whatever building it raised."""
        instance = self._new_instance()
        state = attributes.instance_state(instance)
        values = state.dict
        if self._plain_values is not None:
            values.update(zip(self._plain_keys, self._plain_values(row), strict=True))
        elif self._plain_one is not None:
            values[self._plain_one[0]] = row[self._plain_one[1]]
        for key, index, process, is_json in self._processed:
            value = row[index]
            if is_json and value is not None:
                value = self._deserialize(value)
            if process is not None:
                value = process(value)
            values[key] = value
        if self._pk_single is not None:
            state.key = (self._identity_class, (row[self._pk_single],), None)
        else:
            state.key = self._identity_key(list(self._pk(row)) if self._pk else [])
        if self._fire_load:
            self._manager.dispatch.load(state, None)
            state._commit_all(values)  # as the ORM does after the load event
        return instance
