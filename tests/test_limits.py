"""PostgreSQL's size limits: every enqueue path refuses a value or a row that the server
would refuse (at the flush, or at COMMIT, taking the caller's transaction with it), before
anything is sent.

The limits were measured against the server (see :mod:`sqla_queue.enqueue._rules`). Here the
jsonb size the rules compute is compared with what the server stores, and values past the
limits are refused on every path. The large strings (300 MB each) are built once per
module and shared by the cases.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, func, insert, select
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session

from sqla_queue import BulkRowError, EnqueueError, InvalidPayload, enqueue, enqueue_many, enqueue_values
from sqla_queue.enqueue._rules import MAX_JSONB_BYTES, MAX_ROW_BYTES, check_row_size, jsonb_size, text_bytes

from .helpers import Server, table_of
from .models import DocumentJob, Order, Task

SIZE = 300_000_000


@pytest.fixture(scope="module")
def big() -> str:
    """300 MB of ASCII text: past jsonb's limit in one JSON value, past a row's in four
    text columns."""
    return "x" * SIZE


def _random_json(rnd: random.Random, depth: int = 0) -> str:
    """JSON text with what changes jsonb's layout: numbers of every form, strings with
    escapes and multi-byte characters, empty and nested containers, repeated keys."""
    kind = rnd.randrange(10 if depth < 5 else 4)
    if kind in (0, 3):
        return rnd.choice(
            [
                str(rnd.randrange(-(10 ** rnd.randrange(1, 30)), 10 ** rnd.randrange(1, 30))),
                rnd.choice(["0", "-0", "0.0", "0.000e5", "10000", "1e4", "1E-4", "0.00010000", "5e63", "5e-64"]),
                rnd.choice(["1e252", "1e-256", "1e-257", "1.5e-63", "1e-66", "7e+2", "123.456e-300"]),
                repr(rnd.uniform(-1e6, 1e6)),
                f"{rnd.randrange(1, 10**6)}e{rnd.randrange(-400, 400)}",
                f"{rnd.randrange(99)}.{'0' * rnd.randrange(70)}{rnd.randrange(999)}",
                "0." + "0" * rnd.randrange(100) + str(rnd.randrange(1, 10**8)),
            ]
        )
    if kind == 1:
        pieces = ["a", "\u00e9", "\U0001f600", "\\", "\n", "\u65e5", "\x7f", "abababab"]
        value = "".join(rnd.choice(pieces) for _ in range(rnd.randrange(8)))
        return json.dumps(value, ensure_ascii=rnd.random() < 0.5)
    if kind == 2:
        return rnd.choice(["null", "true", "false"])
    if kind < 7:
        return "[" + ",".join(_random_json(rnd, depth + 1) for _ in range(rnd.randrange(7))) + "]"
    # few distinct keys: objects often repeat one (jsonb keeps the last value)
    names = ["", "k", "key", "\u00e9", "long key"]
    keys = [json.dumps(rnd.choice(names) + str(rnd.randrange(3))) for _ in range(rnd.randrange(7))]
    return "{" + ", ".join(f"{key}: {_random_json(rnd, depth + 1)}" for key in keys) + "}"


def test_jsonb_size_is_what_postgresql_stores(engine: Engine) -> None:
    """The size the rules compute for JSON text is the size of the server's jsonb value,
    padding and all (``pg_column_size`` of the value, less its 4-byte header)."""
    rnd = random.Random(20261201)
    docs = [_random_json(rnd) for _ in range(2000)]
    docs += ['"' + "a" * 100 + '"', "[]", "{}", "0", '{"a": 1, "a": [2, 3]}', "[[[[[]]]]]", '"\\u00e9"']
    with engine.connect() as conn:
        stored = [
            size
            for (size,) in conn.exec_driver_sql(
                "SELECT pg_column_size(doc::jsonb) - 4 FROM unnest(%(docs)s::text[]) WITH ORDINALITY AS d(doc, n)"
                " ORDER BY n",
                {"docs": docs},
            )
        ]
    assert [jsonb_size(doc) for doc in docs] == stored


def test_text_is_counted_in_utf8_bytes_and_a_scalar_as_an_array_of_one() -> None:
    wide = "\u00e9" * (2**20 + 3) + "\U0001f600"  # across the chunks text_bytes encodes
    assert text_bytes(wide) == 2 * (2**20 + 3) + 4 == len(wide.encode())
    assert jsonb_size('"' + "a" * 10 + '"') == 10 + 8  # header and entry of the array
    check_row_size([wide], ['{"a": 1}'])  # an ordinary row passes


#: The synchronous paths: (session, model, values) -> the call.
SYNC_PATHS: dict[str, Callable[[Session, Any, dict[str, Any]], Any]] = {
    "enqueue": lambda session, model, values: enqueue(session, model(**values)),
    "enqueue_many copy": lambda session, model, values: enqueue_many(session, model, [values], method="copy"),
    "enqueue_many insert": lambda session, model, values: enqueue_many(session, model, [values], method="insert"),
    "enqueue_values": lambda session, model, values: enqueue_values(session, model, values),
}
PATHS = [*SYNC_PATHS, "await enqueue_values"]


def _refused(kind: str, big: str) -> tuple[Any, dict[str, Any], type[Exception], str]:
    """(model, values, error, message) of a job PostgreSQL would refuse."""
    if kind == "json":
        payload = {"task": "t", "payload": {"blob": big}}
        return Task, payload, InvalidPayload, "payload is too large for PostgreSQL jsonb"
    columns = dict.fromkeys(("subject", "body", "html", "attachment"), big)
    return DocumentJob, columns, EnqueueError, f"take {4 * SIZE} bytes, more than PostgreSQL takes in one row"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["json", "text"])
def test_too_large_for_postgresql_is_refused_before_anything_is_written(
    engine: Engine, server: Server, big: str, path: str, kind: str
) -> None:
    model, values, error, message = _refused(kind, big)
    orders = table_of(Order)
    if path == "await enqueue_values":

        async def main() -> None:
            async_engine = create_async_engine(server.url.set(drivername="postgresql+psycopg"))
            try:
                async with async_engine.connect() as conn:
                    await conn.execute(insert(orders).values(customer="kept"))
                    with pytest.raises(error, match=message):
                        await enqueue_values(conn, model, values)
                    await conn.commit()  # the transaction is whole
            finally:
                await async_engine.dispose()

        asyncio.run(main())
    else:
        with Session(engine) as session:
            session.add(Order(customer="kept"))
            session.flush()
            with pytest.raises(EnqueueError) as raised:
                SYNC_PATHS[path](session, model, values)
            cause = raised.value.__cause__ if isinstance(raised.value, BulkRowError) else raised.value
            assert isinstance(cause, error) and message in str(cause)
            assert not session.new  # nothing was added, nothing is pending
            session.commit()
    with engine.connect() as conn:
        assert conn.scalars(select(orders.c.customer)).all() == ["kept"]
        assert conn.scalar(select(func.count()).select_from(table_of(model))) == 0


def test_copy_counts_the_escapes_it_sends(engine: Engine) -> None:
    """COPY sends a tab (or a backslash, a newline) as two bytes: a row that fits in an
    INSERT can be past the limit of a COPY line."""
    tabs = "\t" * SIZE
    check_row_size([tabs, tabs], [])  # 600 MB: fits in an INSERT
    with pytest.raises(EnqueueError, match=f"take {4 * SIZE} bytes"):
        check_row_size([tabs, tabs], [], copy=True)
    with Session(engine) as session:
        with pytest.raises(BulkRowError, match=f"^row 0: the job's text and JSON values take {4 * SIZE} bytes"):
            enqueue_many(session, DocumentJob, [{"subject": tabs, "body": tabs}], method="copy")
        session.commit()
    with engine.connect() as conn:
        assert conn.scalar(select(func.count()).select_from(table_of(DocumentJob))) == 0
    assert 2 * SIZE < MAX_ROW_BYTES < 4 * SIZE and MAX_JSONB_BYTES < SIZE
