"""The worker loads every column type PostgreSQL's dialect offers as a Session would.

One queue table per type, each with a ``value`` column of it: a job inserted through the
ORM is claimed and loaded by a real worker (both runtimes), and its ``value`` must equal,
and be of the same Python type as, what a ``Session`` loads for the same row.
"""

from __future__ import annotations

import datetime as dt
import enum
import uuid
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Date,
    DateTime,
    Double,
    Enum,
    Float,
    Integer,
    Interval,
    LargeBinary,
    Numeric,
    PickleType,
    SmallInteger,
    String,
    Text,
    Time,
    Unicode,
    Uuid,
    select,
    text,
)
from sqlalchemy import Engine as SAEngine
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.dialects.postgresql import Range
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from sqla_queue import JobMixin, QueueSession

from .helpers import wait_for


class TypesBase(DeclarativeBase):
    pass


class Mood(enum.Enum):
    happy = "happy"
    sad = "sad"


_UTC = dt.UTC
_T0 = dt.datetime(2024, 5, 6, 7, 8, 9, 123456)
_T0Z = _T0.replace(tzinfo=_UTC)

#: (id, column type, a value) for every type a column can have.
TYPES: list[tuple[str, Any, Any]] = [
    ("numeric", Numeric(10, 2), Decimal("12.34")),
    ("numeric_as_float", Numeric(10, 2, asdecimal=False), 12.5),
    ("pg_numeric", pg.NUMERIC(), Decimal("3.14159")),
    ("float", Float(), 1.5),
    ("float_as_decimal", Float(asdecimal=True), Decimal("2.5")),
    ("real", pg.REAL(), 1.25),
    ("double_precision", pg.DOUBLE_PRECISION(), 2.0625),
    ("double", Double(), 0.5),
    ("integer", Integer(), 42),
    ("bigint", BigInteger(), 2**40),
    ("smallint", SmallInteger(), 7),
    ("boolean", Boolean(), True),
    ("string", String(50), "héllo"),
    ("text", Text(), "long text"),
    ("unicode", Unicode(20), "ünï"),
    ("array_numeric", pg.ARRAY(Numeric(10, 2)), [Decimal("1.50"), Decimal("2.00")]),
    ("array_numeric_2d", pg.ARRAY(Numeric(), dimensions=2), [[Decimal("1"), Decimal("2")], [Decimal("3"), None]]),
    ("array_float", pg.ARRAY(Float()), [1.5, 2.5]),
    ("array_real", pg.ARRAY(pg.REAL()), [0.5]),
    ("array_double", pg.ARRAY(pg.DOUBLE_PRECISION()), [0.25, -1.0]),
    ("array_integer", pg.ARRAY(Integer()), [1, 2, 3]),
    ("array_string", pg.ARRAY(String(20)), ["a", "b"]),
    ("array_bigint_2d", pg.ARRAY(BigInteger(), dimensions=2), [[1, 2], [3, None]]),
    ("array_text_nulls", pg.ARRAY(Text()), ["a", None, ""]),
    ("array_uuid", pg.ARRAY(Uuid()), [uuid.UUID(int=5)]),
    ("array_jsonb", pg.ARRAY(pg.JSONB()), [{"a": 1}, [2, 3]]),
    ("json", JSON(), {"a": [1, 2.5, None, "x"]}),
    ("jsonb", pg.JSONB(), {"nested": {"b": True}}),
    ("pg_json", pg.JSON(), [1, "two"]),
    ("hstore", pg.HSTORE(), {"k": "v", "n": None}),
    ("inet", pg.INET(), "192.168.0.1"),
    ("cidr", pg.CIDR(), "10.0.0.0/8"),
    ("macaddr", pg.MACADDR(), "08:00:2b:01:02:03"),
    ("macaddr8", pg.MACADDR8(), "08:00:2b:01:02:03:04:05"),
    ("money", pg.MONEY(), "$1.50"),
    ("uuid", Uuid(), uuid.UUID(int=1)),
    ("uuid_as_str", Uuid(as_uuid=False), str(uuid.UUID(int=2))),
    ("pg_uuid", pg.UUID(), uuid.UUID(int=3)),
    ("interval", Interval(), dt.timedelta(days=1, seconds=5)),
    ("pg_interval", pg.INTERVAL(), dt.timedelta(hours=3)),
    ("date", Date(), dt.date(2024, 2, 29)),
    ("time", Time(), dt.time(12, 30, 1)),
    ("time_tz", Time(timezone=True), dt.time(12, 30, 1, tzinfo=_UTC)),
    ("timestamp", DateTime(), _T0),
    ("timestamp_tz", DateTime(timezone=True), _T0.replace(tzinfo=_UTC)),
    ("pg_timestamp_tz", pg.TIMESTAMP(timezone=True), _T0.replace(tzinfo=_UTC)),
    ("int4range", pg.INT4RANGE(), Range(1, 10)),
    ("int8range", pg.INT8RANGE(), Range(1, 2**40)),
    ("numrange", pg.NUMRANGE(), Range(Decimal("1.5"), Decimal("2.5"), bounds="[]")),
    ("daterange", pg.DATERANGE(), Range(dt.date(2024, 1, 1), dt.date(2024, 2, 1))),
    ("tsrange", pg.TSRANGE(), Range(_T0, _T0 + dt.timedelta(hours=1))),
    ("tstzrange", pg.TSTZRANGE(), Range(_T0.replace(tzinfo=_UTC), None)),
    ("int4multirange", pg.INT4MULTIRANGE(), [Range(1, 3), Range(5, 8)]),
    ("nummultirange", pg.NUMMULTIRANGE(), [Range(Decimal("0.5"), Decimal("1"))]),
    ("datemultirange", pg.DATEMULTIRANGE(), [Range(dt.date(2024, 1, 1), dt.date(2024, 1, 5))]),
    ("tstzmultirange", pg.TSTZMULTIRANGE(), [Range(_T0Z, _T0Z + dt.timedelta(1))]),
    ("native_enum", pg.ENUM("red", "green", name="sqla_queue_test_colour"), "green"),
    ("python_enum", Enum(Mood, name="sqla_queue_test_mood"), Mood.sad),
    ("enum_not_native", Enum(Mood, native_enum=False), Mood.happy),
    ("bytea", pg.BYTEA(), b"\x00\x01\xff"),
    ("large_binary", LargeBinary(), b"bytes"),
    ("bit", pg.BIT(3), "101"),
    ("varbit", pg.BIT(8, varying=True), "1101"),
    ("tsvector", pg.TSVECTOR(), "'a' 'b'"),
    ("pickle", PickleType(), {"picked": (1, 2)}),
    ("citext_free_text", pg.TEXT(), "plain"),
    ("oid", pg.OID(), 1234),
    ("regclass", pg.REGCLASS(), "pg_class"),
]


def _model(name: str, column_type: Any) -> type[Any]:
    return type(
        f"TypedJob_{name}",
        (TypesBase, JobMixin),
        {
            "__tablename__": f"typed_jobs_{name}",
            "value": mapped_column(column_type, nullable=True),
            "__annotations__": {"value": Mapped[Any]},
        },
    )


MODELS = {name: _model(name, column_type) for name, column_type, _ in TYPES}


@pytest.fixture(scope="module")
def typed_tables(_schema: SAEngine) -> Iterator[SAEngine]:
    with _schema.begin() as conn:
        conn.execute(text("CREATE EXTENSION IF NOT EXISTS hstore"))
    TypesBase.metadata.create_all(_schema)
    yield _schema
    TypesBase.metadata.drop_all(_schema)


@pytest.mark.parametrize(("name", "value"), [(name, value) for name, _, value in TYPES], ids=[t[0] for t in TYPES])
def test_the_worker_loads_each_type_as_a_session_does(
    typed_tables: SAEngine, make_worker: Any, name: str, value: Any
) -> None:
    engine = typed_tables
    model = MODELS[name]
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {model.__tablename__}"))
    with QueueSession(engine) as session:
        job = session.enqueue(model(value=value))
        session.commit()
        job_id = job.id
    with Session(engine) as session:
        expected = session.scalars(select(model.value).where(model.id == job_id)).one()
    seen: list[Any] = []
    worker = make_worker(engine, model, seen.append, poll_interval=0.5, sweep_interval=0)
    worker.start()
    try:
        wait_for(lambda: seen or worker.stats.failed, what=f"the {name} job handled")
    finally:
        worker.stop(grace=1)
    assert worker.stats.failed == 0 and len(seen) == 1, f"{name}: the worker could not load the row"
    (loaded,) = seen
    assert type(loaded) is model and loaded.id == job_id
    assert type(loaded.value) is type(expected), (name, loaded.value, expected)
    assert loaded.value == expected, (name, loaded.value, expected)
