"""One canary per SQLAlchemy API the package relies on that is not public.

Each asserts the behaviour sqla_queue depends on, on whichever SQLAlchemy is installed
(CI runs the newest 2.0.x and 2.1.x), so an upgrade that changes it fails here, by name,
instead of somewhere deep in a worker. No database: SQLite and compile-only dialects.
"""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any

import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, TypeDecorator, bindparam, create_engine, func, select
from sqlalchemy.dialects import postgresql
from sqlalchemy.exc import IntegrityError
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.util.concurrency import await_only, greenlet_spawn, in_greenlet

DIALECT = postgresql.psycopg.dialect()  # type: ignore[no-untyped-call]

jobs = Table("canary_jobs", MetaData(), Column("id", Integer, primary_key=True), Column("queue", String))


class Upper(TypeDecorator[str]):
    impl = String
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Any) -> Any:
        return None if value is None else str(value).upper()


class Wrapped(TypeDecorator[str]):
    impl = String
    cache_ok = True

    def bind_expression(self, bindvalue: Any) -> Any:
        return func.lower(bindvalue)


def test_connection_handle_dbapi_exception_raises_sqlalchemy_s_class() -> None:
    """driver.reraise_as_sqlalchemy: a DBAPI error from a cursor used directly becomes the
    error ``Connection.execute`` would raise, with the original as ``.orig``."""
    engine = create_engine("sqlite://")
    with engine.connect() as conn:
        raw = sqlite3.IntegrityError("UNIQUE constraint failed")

        def reraise() -> None:
            try:
                raise raw  # the handler reads sys.exc_info(), as in the driver
            except sqlite3.IntegrityError as raised:
                conn._handle_dbapi_exception(raised, "INSERT ...", {}, None, None)

        with pytest.raises(IntegrityError) as caught:
            reraise()
        assert caught.value.orig is raw
    engine.dispose()


def test_get_transaction_is_the_outermost_transaction_inside_savepoints() -> None:
    """outbox.notify_with_commit: the NOTIFY goes with the COMMIT of the outermost
    transaction, found with the public get_transaction() even inside a savepoint."""
    engine = create_engine("sqlite://")
    with engine.connect() as conn:
        root = conn.begin()
        conn.begin_nested()
        conn.begin_nested()
        assert conn.get_transaction() is root
        root.rollback()
    engine.dispose()


def test_compiler_bind_processors_map_bind_names_to_callables() -> None:
    """driver.compile_statement: the processors of a statement compiled once are applied
    by hand when it runs on the DBAPI cursor."""
    table = Table("canary_upper", MetaData(), Column("id", Integer, primary_key=True), Column("name", Upper()))
    compiled = table.update().values(name=bindparam("new_name")).compile(dialect=DIALECT)
    assert isinstance(compiled, SQLCompiler)
    processor: Any = compiled._bind_processors["new_name"]
    assert processor("ada") == "ADA"


def test_construct_params_without_check_leaves_missing_binds_out() -> None:
    compiled = select(jobs.c.id).where(jobs.c.queue == bindparam("q")).compile(dialect=DIALECT)
    assert compiled.construct_params(_check=False) == {"q": None}


def test_expanding_binds_are_marked_so_compile_once_can_refuse_them() -> None:
    compiled = select(jobs.c.id).where(jobs.c.queue.in_(["a", "b"])).compile(dialect=DIALECT)
    assert isinstance(compiled, SQLCompiler)
    assert any(bind.expanding for bind in compiled.binds.values())
    assert "__[POSTCOMPILE_" in compiled.string


def test_type_has_bind_expression_flag() -> None:
    """bulk: COPY cannot apply a type's bind_expression, so such columns are refused."""
    assert Wrapped().dialect_impl(DIALECT)._has_bind_expression
    assert not Upper().dialect_impl(DIALECT)._has_bind_expression


def test_greenlet_helpers_run_blocking_code_on_the_event_loop() -> None:
    """runtime.AsyncRuntime: the services are blocking code run in greenlets, awaiting
    the loop through await_only, as SQLAlchemy's asyncio extension does."""

    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    def blocking() -> tuple[bool, int]:
        return in_greenlet(), await_only(answer())

    async def main() -> tuple[bool, int]:
        assert not in_greenlet()
        return await greenlet_spawn(blocking)

    assert asyncio.run(main()) == (True, 42)
