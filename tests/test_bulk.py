"""``enqueue_many()``: COPY (or multi-row INSERT) inside the caller's transaction."""

from __future__ import annotations

import base64
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Computed, Engine, ForeignKey, Integer, String, event, func, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import (
    DeclarativeBase,
    Mapped,
    Session,
    mapped_column,
    relationship,
    sessionmaker,
)

from sqla_queue import (
    BulkRowError,
    EnqueueError,
    InvalidPayload,
    JobMixin,
    QueueSession,
    enqueue_many,
    queue_table,
)
from sqla_queue.enqueue.bulk import COPY_MIN_ROWS

from .bad_values import COLUMN_SAMPLE, GOOD_PAYLOAD, GOOD_TEXT, OPTION_SAMPLE, row_values
from .helpers import SENTINEL_CHANNEL, Server, notifications_until_sentinel
from .models import EmailJob, EncodedJob, InheritedJob, InheritedJobA, InheritedJobB, Order, ReportJob, Task, UuidJob

EMAIL_CHANNEL = queue_table(EmailJob).channel
TASK_CHANNEL = queue_table(Task).channel
METHODS = ["copy", "insert"]


@pytest.fixture
def Sessions(engine: Engine) -> sessionmaker[QueueSession]:
    return sessionmaker(engine, class_=QueueSession)


@pytest.fixture
def listening(listener: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    for channel in (EMAIL_CHANNEL, TASK_CHANNEL, SENTINEL_CHANNEL):
        listener.execute(f'LISTEN "{channel}"')
    return listener


@pytest.fixture
def inserts(engine: Engine) -> Iterator[list[str]]:
    """INSERTs into email_jobs sent through SQLAlchemy; COPY goes around it, so it sends none."""
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("INSERT INTO EMAIL_JOBS"):
            seen.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    yield seen
    event.remove(engine, "before_cursor_execute", record)


def count(engine: Engine, model: Any) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(model)) or 0)


def new_order(session: Session, customer: str = "ada") -> int:
    order = Order(customer=customer)
    session.add(order)
    session.flush()
    return order.id


# -- what gets written --------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_typed_rows_from_dicts_and_instances(
    Sessions: sessionmaker[QueueSession], engine: Engine, inserts: list[str], method: Any
) -> None:
    with Sessions() as session:
        order_id = new_order(session)
        instance = EmailJob(order_id=order_id, recipient="obj@example.com", priority=7)
        rows: list[Any] = [
            {"order_id": order_id, "recipient": f"u{n}@example.com"} for n in range(40)
        ]
        rows.insert(10, instance)
        rows.append({"recipient": "no-order@example.com", "queue": "other"})
        assert session.enqueue_many(EmailJob, rows, method=method) == 42
        # instances are read, not added: COPY bypasses the identity map
        assert instance not in session and instance.id is None
        session.commit()
    assert (len(inserts) > 0) == (method == "insert")  # the path really taken
    with engine.connect() as conn:
        got = conn.execute(
            select(
                EmailJob.order_id, EmailJob.recipient, EmailJob.queue, EmailJob.priority
            ).order_by(EmailJob.id)
        ).all()
    assert len(got) == 42
    assert tuple(got[0]) == (order_id, "u0@example.com", "default", 0)
    assert tuple(got[10]) == (order_id, "obj@example.com", "default", 7)  # input order kept
    assert tuple(got[-1]) == (None, "no-order@example.com", "other", 0)


@pytest.mark.parametrize("method", METHODS)
def test_pending_business_rows_are_flushed_first(
    Sessions: sessionmaker[QueueSession], engine: Engine, method: Any
) -> None:
    with Sessions() as session:
        session.add(Order(id=77, customer="not flushed yet"))
        session.enqueue_many(EmailJob, [{"order_id": 77}] * 3, method=method)  # FK satisfied
        session.commit()
    assert count(engine, EmailJob) == 3


PAYLOADS: list[Any] = [
    {"nested": {"list": [1, 2.5, None, True, {"deep": ["x"]}], "empty": {}}},
    {"unicode": "héllo wörld ✓ 日本語 🎉", "escapes": 'tab\there\nnewline \\ back "quoted"'},
    {"big": 2**62, "neg": -1.5e-300, "copy markers": "\\N \\. \t end"},
    [1, "a", {"b": []}],
    "just a string",
    {},
]


@pytest.mark.parametrize("method", METHODS)
def test_task_rows_with_jsonb_payloads(
    Sessions: sessionmaker[QueueSession], engine: Engine, method: Any
) -> None:
    with Sessions() as session:
        rows: list[Any] = [{"task": f"t{n}", "payload": p} for n, p in enumerate(PAYLOADS)]
        rows.append(Task(task="from-object", payload={"ü": "ß"}))
        rows.append({"task": "default-payload"})
        session.enqueue_many(Task, rows, method=method)
        session.commit()
    with engine.connect() as conn:
        got: dict[str, Any] = dict(conn.execute(select(Task.task, Task.payload)).all())
        types = set(conn.scalars(text("SELECT DISTINCT jsonb_typeof(payload) FROM tasks")))
    assert got == {
        **{f"t{n}": p for n, p in enumerate(PAYLOADS)},
        "from-object": {"ü": "ß"},
        "default-payload": {},
    }
    assert types == {"object", "array", "string"}  # stored as JSON values, not as text


@pytest.mark.parametrize("method", METHODS)
def test_rolled_back_with_the_session(
    Sessions: sessionmaker[QueueSession],
    engine: Engine,
    listening: Any,
    server: Server,
    method: Any,
) -> None:
    with Sessions() as session:
        order_id = new_order(session)
        session.enqueue_many(EmailJob, [{"order_id": order_id}] * 30, method=method)
        assert session.scalar(select(func.count()).select_from(EmailJob)) == 30
        session.rollback()
    assert count(engine, EmailJob) == 0 and count(engine, Order) == 0
    assert notifications_until_sentinel(listening, server.conninfo) == []


@pytest.mark.parametrize("method", METHODS)
def test_one_notification_per_queue_on_commit(
    Sessions: sessionmaker[QueueSession], listening: Any, server: Server, method: Any
) -> None:
    with Sessions() as session:
        rows = [{"queue": "a"}] * 50 + [{"queue": "b"}] * 50 + [{}] * 50
        session.enqueue_many(EmailJob, rows, queue="opt", method=method, batch_size=40)
        session.enqueue_many(Task, [{"task": "t"}] * 20, method=method)
        assert notifications_until_sentinel(listening, server.conninfo) == []  # not before commit
        session.commit()
    got = notifications_until_sentinel(listening, server.conninfo)
    assert sorted(got) == sorted(
        [
            (EMAIL_CHANNEL, "a"),
            (EMAIL_CHANNEL, "b"),
            (EMAIL_CHANNEL, "opt"),
            (TASK_CHANNEL, "default"),
        ]
    )


def test_plain_session_gets_the_notify_hooks(
    engine: Engine, listening: Any, server: Server
) -> None:
    with Session(engine) as session:
        assert enqueue_many(session, EmailJob, [{"queue": "plain"}] * 3) == 3
        session.commit()
    assert notifications_until_sentinel(listening, server.conninfo) == [(EMAIL_CHANNEL, "plain")]


# -- defaults, options and the database clock ---------------------------------------------


def _rows_by_id(session: Session, model: Any) -> list[dict[str, Any]]:
    table = queue_table(model).table
    return [dict(r._mapping) for r in session.execute(select(table).order_by(table.c.id))]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"queue": "q", "priority": -4, "max_attempts": 3, "delay": 90},
        {"run_at": datetime(2031, 5, 1, tzinfo=UTC)},
    ],
)
def test_rows_match_what_enqueue_writes(
    Sessions: sessionmaker[QueueSession], method: Any, options: dict[str, Any]
) -> None:
    """Same transaction, so now() (created_at) is the same instant for both.

    A ``delay`` is measured from each insert, so only its run_after differs: checked apart.
    """
    with Sessions() as session:
        started = session.scalar(select(func.clock_timestamp()))
        order_id = new_order(session)
        session.enqueue(EmailJob(order_id=order_id), **options)
        session.flush()
        session.enqueue_many(EmailJob, [{"order_id": order_id}], method=method, **options)
        session.enqueue_many(EmailJob, [EmailJob(order_id=order_id)], method=method, **options)
        session.enqueue(Task(task="t"), **options)
        session.flush()
        session.enqueue_many(Task, [{"task": "t"}, Task(task="t")], method=method, **options)
        ended = session.scalar(select(func.clock_timestamp()))
        skip = {"id", "run_after"} if "delay" in options else {"id"}
        for model in (EmailJob, Task):
            rows = _rows_by_id(session, model)
            if "delay" in options:
                assert started is not None and ended is not None
                delay = timedelta(seconds=options["delay"])
                assert all(started + delay <= row["run_after"] <= ended + delay for row in rows)
            by_enqueue, *by_bulk = [{k: v for k, v in row.items() if k not in skip} for row in rows]
            assert len(by_bulk) == 2 and by_bulk == [by_enqueue, by_enqueue]
            assert by_enqueue.get("recipient", "someone@example.com") == "someone@example.com"
            assert by_enqueue.get("payload", {}) == {}
        session.rollback()


@pytest.mark.parametrize("method", METHODS)
def test_instance_attributes_set_to_none_get_the_defaults_as_in_enqueue(
    Sessions: sessionmaker[QueueSession], method: Any
) -> None:
    """The ORM's INSERT leaves a None attribute out, so the column's default applies."""
    with Sessions() as session:
        session.enqueue(EmailJob(queue=None, priority=None, max_attempts=None, run_after=None))
        session.flush()
        unset = EmailJob(queue=None, priority=None, max_attempts=None, run_after=None)
        session.enqueue_many(EmailJob, [unset], method=method)
        by_enqueue, by_bulk = [{k: v for k, v in row.items() if k != "id"} for row in _rows_by_id(session, EmailJob)]
        assert by_bulk == by_enqueue
        assert (by_bulk["queue"], by_bulk["priority"], by_bulk["max_attempts"]) == ("default", 0, 20)
        session.rollback()


@pytest.mark.parametrize("method", METHODS)
def test_delay_is_measured_by_the_database_clock_at_the_call(
    Sessions: sessionmaker[QueueSession], method: Any
) -> None:
    with Sessions() as session:
        session.execute(text("SELECT pg_sleep(1)"))  # the transaction has been open 1 s
        before = session.scalar(select(func.clock_timestamp()))
        session.enqueue_many(EmailJob, [{}] * 3, delay=timedelta(minutes=5), method=method)
        after = session.scalar(select(func.clock_timestamp()))
        now = session.scalar(select(func.now()))
        run_after = set(session.scalars(select(EmailJob.run_after)))
        assert len(run_after) == 1  # one instant for the whole call
        (at,) = run_after
        assert before is not None and after is not None and now is not None
        # from the call, not from the transaction's start (now() + 5 min is 1 s earlier)
        assert before + timedelta(minutes=5) <= at <= after + timedelta(minutes=5)
        assert at - now >= timedelta(minutes=5, seconds=1)
        session.rollback()


@pytest.mark.parametrize("method", METHODS)
def test_row_values_win_over_options(Sessions: sessionmaker[QueueSession], method: Any) -> None:
    at = datetime(2030, 1, 1, tzinfo=UTC)
    with Sessions() as session:
        before = session.scalar(select(func.clock_timestamp()))
        session.enqueue_many(
            EmailJob,
            [{"queue": "own", "priority": 9, "run_after": at}, {}],
            queue="opt",
            priority=1,
            delay=60,
            method=method,
        )
        after = session.scalar(select(func.clock_timestamp()))
        got = session.execute(
            select(EmailJob.queue, EmailJob.priority, EmailJob.run_after).order_by(EmailJob.id)
        ).all()
        assert [tuple(r)[:2] for r in got] == [("own", 9), ("opt", 1)]
        assert got[0].run_after == at
        minute = timedelta(seconds=60)
        assert before is not None and after is not None
        assert before + minute <= got[1].run_after <= after + minute
        session.rollback()


@pytest.mark.parametrize("method", METHODS)
def test_python_defaults_are_filled(Sessions: sessionmaker[QueueSession], method: Any) -> None:
    with Sessions() as session:
        session.enqueue_many(UuidJob, [{}, {"id": None}, {}], method=method)
        session.enqueue_many(ReportJob, [{}, {"report": "weekly"}], method=method)
        ids = session.scalars(select(UuidJob.id)).all()
        assert len(set(ids)) == 3 and all(isinstance(i, uuid.UUID) for i in ids)
        assert sorted(session.scalars(select(ReportJob.report))) == ["daily", "weekly"]
        session.rollback()


# -- streaming ----------------------------------------------------------------------------


class Row(dict):  # type: ignore[type-arg]
    """A dict that counts how many of its kind are alive at once."""

    live = 0

    def __del__(self) -> None:
        Row.live -= 1


@pytest.mark.parametrize(
    ("method", "total", "batch"), [("copy", 200_000, 1000), ("insert", 5_000, 100)]
)
def test_rows_stream_in_bounded_batches(
    Sessions: sessionmaker[QueueSession], engine: Engine, method: Any, total: int, batch: int
) -> None:
    Row.live = peak = 0

    def rows() -> Iterator[Row]:
        nonlocal peak
        for n in range(total):
            row = Row(recipient=f"r{n}")
            Row.live += 1
            peak = max(peak, Row.live)
            yield row

    with Sessions() as session:
        assert session.enqueue_many(EmailJob, rows(), method=method, batch_size=batch) == total
        session.commit()
    assert count(engine, EmailJob) == total
    # list(rows) would keep every row alive; batching keeps about one batch
    assert peak <= 2 * batch, peak


# -- bad rows, bad options, database errors -----------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("then", ["rollback", "commit"])
def test_bad_row_in_a_later_batch_leaves_nothing(
    Sessions: sessionmaker[QueueSession],
    engine: Engine,
    listening: Any,
    server: Server,
    method: Any,
    then: str,
) -> None:
    pulled = 0

    def rows() -> Iterator[dict[str, Any]]:
        nonlocal pulled
        for n in range(5000):
            pulled += 1
            yield {"recipient": f"r{n}"} if n != 2345 else {"recipient": "x", "recipent": "typo"}

    with Sessions() as session:
        session.add(Order(customer="kept"))
        with pytest.raises(BulkRowError, match=r"^row 2345: unknown column.*'recipent'") as info:
            session.enqueue_many(EmailJob, rows(), method=method, batch_size=1000)
        assert info.value.index == 2345
        assert pulled <= 3000  # stopped at the bad batch
        # batches 0 and 1 were written, then rolled back to the savepoint: the transaction
        # still works and holds the caller's order but none of the jobs
        assert session.scalar(select(func.count()).select_from(EmailJob)) == 0
        assert session.scalar(select(func.count()).select_from(Order)) == 1
        getattr(session, then)()
        # and the session is usable again
        session.enqueue_many(EmailJob, [{"recipient": "after"}] * 3, method=method)
        session.commit()
    assert count(engine, Order) == (1 if then == "commit" else 0)
    with engine.connect() as conn:
        assert conn.scalars(select(EmailJob.recipient)).all() == ["after"] * 3
    assert notifications_until_sentinel(listening, server.conninfo) == [(EMAIL_CHANNEL, "default")]


def test_bad_row_in_the_first_batch_writes_nothing(
    Sessions: sessionmaker[QueueSession], engine: Engine
) -> None:
    with Sessions() as session:
        order = Order(customer="pending")
        session.add(order)
        with pytest.raises(BulkRowError, match=r"^row 3: "):
            session.enqueue_many(EmailJob, [{}, {}, {}, {"status": "done"}, {}])
        assert order in session.new  # not even the autoflush ran
        session.commit()
    assert count(engine, Order) == 1 and count(engine, EmailJob) == 0


@pytest.mark.parametrize(
    ("model", "row", "message"),
    [
        (EmailJob, {"recipient": "x", "nope": 1, "zap": 2}, "unknown column.*'nope', 'zap'"),
        (EmailJob, {1: "x"}, "unknown column"),
        (EmailJob, {"status": "done"}, "status='done': the queue manages status"),
        (EmailJob, {"attempts": 3}, "the queue manages attempts"),
        (EmailJob, {"lease_owner": "w"}, "the queue manages lease_owner"),
        (
            EmailJob,
            EmailJob(finished_at=datetime.now(UTC)),
            "the queue manages finished_at",
        ),
        (EmailJob, {"recipient": None}, "recipient is NOT NULL"),
        (EmailJob, {"priority": "high"}, "priority must be a 32-bit integer"),
        (EmailJob, {"priority": 2**40}, "priority must be a 32-bit integer"),
        (EmailJob, {"queue": ""}, "queue must be a non-empty string"),
        (EmailJob, {"queue": "sqla_queue.swept:mail"}, "which sqla_queue reserves"),
        (EmailJob, {"max_attempts": 0}, "max_attempts must be an integer >= 1"),
        (EmailJob, {"run_after": datetime(2030, 1, 1)}, "run_after must be a timezone-aware"),
        (EmailJob, {"run_after": func.now()}, "SQL expression"),
        (EmailJob, {"isolated": "maybe"}, "isolated"),
        (EmailJob, 42, "expected a dict of column values or a new instance"),
        (EmailJob, ReportJob(), "ReportJob is not a row of table email_jobs"),
        (EmailJob, EmailJob(status="done"), "the queue manages status"),
        (Task, {"payload": {}}, "needs a task name"),
        (Task, {"task": ""}, "needs a task name"),
        (
            Task,
            {"task": "t", "payload": None, "id": 5, "created_at": None},
            "created_at is NOT NULL",
        ),
    ],
)
def test_bad_rows_name_their_position(
    Sessions: sessionmaker[QueueSession], engine: Engine, model: Any, row: Any, message: str
) -> None:
    good = {"task": "t"} if model is Task else {}
    with Sessions() as session:
        with pytest.raises(BulkRowError, match=f"^row 2: .*{message}") as info:
            session.enqueue_many(model, [good, good, row, good])
        assert info.value.index == 2 and isinstance(info.value, EnqueueError)
        session.commit()
    assert count(engine, model) == 0


@pytest.mark.parametrize(
    "payload", [{"when": datetime.now()}, {"x": float("nan")}, {"blob": b"bytes"}, {"s": {1, 2}}]
)
@pytest.mark.parametrize("method", METHODS)
def test_payload_must_be_json(
    Sessions: sessionmaker[QueueSession], payload: dict[str, Any], method: Any
) -> None:
    with Sessions() as session:
        with pytest.raises(BulkRowError, match=r"^row 1: payload is not JSON-serialisable") as info:
            session.enqueue_many(
                Task, [{"task": "ok"}, {"task": "t", "payload": payload}], method=method
            )
        assert isinstance(info.value.__cause__, InvalidPayload)


def test_engine_json_serializer_is_respected(server: Server) -> None:
    import json

    from sqlalchemy import create_engine

    engine = create_engine(server.url, json_serializer=lambda v: json.dumps(v, default=str))
    try:
        with Session(engine) as session:
            enqueue_many(
                session, Task, [{"task": "t", "payload": {"when": datetime(2030, 1, 1)}}] * 3
            )
            assert (
                session.scalars(select(Task.payload)).all() == [{"when": "2030-01-01 00:00:00"}] * 3
            )
            session.rollback()
    finally:
        engine.dispose()


def test_persistent_and_pending_instances_are_refused(Sessions: sessionmaker[QueueSession]) -> None:
    with Sessions() as session:
        pending = EmailJob()
        session.add(pending)
        with pytest.raises(BulkRowError, match=r"^row 0: EmailJob is already in a session"):
            session.enqueue_many(EmailJob, [pending])
        session.commit()
        with pytest.raises(
            BulkRowError, match=r"^row 1: EmailJob is already in a session or persistent"
        ):
            session.enqueue_many(EmailJob, [{}, pending])


class _LocalBase(DeclarativeBase):
    """Models whose rows are refused before any SQL, so their tables never need to exist."""


class _Parent(_LocalBase):
    __tablename__ = "bulk_parents"
    id: Mapped[int] = mapped_column(primary_key=True)


class _ChildJob(_LocalBase, JobMixin):
    __tablename__ = "bulk_child_jobs"
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("bulk_parents.id"))
    parent: Mapped[_Parent | None] = relationship()
    size: Mapped[int] = mapped_column(Integer)  # NOT NULL, no default
    doubled: Mapped[int] = mapped_column(Computed("size * 2"))
    label: Mapped[str] = mapped_column(String(20), default=func.lower("X"))  # SQL default


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (_ChildJob(parent=_Parent(), size=1), "relationship 'parent' is set"),
        ({"parent_id": 1}, "missing a value for NOT NULL column.* size"),
        ({"size": 1, "doubled": 2}, "column doubled is generated by the database"),
    ],
)
def test_rows_the_database_would_reject_are_refused_first(
    engine: Engine, row: Any, message: str
) -> None:
    with Session(engine) as session:
        with pytest.raises(BulkRowError, match=f"^row 0: {message}"):
            enqueue_many(session, _ChildJob, [row], method="insert")
        with pytest.raises(EnqueueError, match=r"label.*only an INSERT can evaluate"):
            enqueue_many(session, _ChildJob, [{"size": 1}], method="copy")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"delay": -1}, "non-negative"),
        ({"delay": "soon"}, "seconds or a timedelta"),
        ({"run_at": datetime(2030, 1, 1)}, "timezone-aware"),
        (
            {"delay": 1, "run_at": datetime(2030, 1, 1, tzinfo=UTC)},
            "either delay or run_at",
        ),
        ({"priority": 2**40}, "32-bit"),
        ({"max_attempts": 0}, ">= 1"),
        ({"queue": ""}, "non-empty"),
        ({"batch_size": 0}, "batch_size must be an integer >= 1"),
        ({"batch_size": True}, "batch_size must be an integer >= 1"),
        ({"method": "fast"}, "method must be one of"),
    ],
)
def test_bad_options_fail_before_any_row_is_read(
    Sessions: sessionmaker[QueueSession], options: dict[str, Any], message: str
) -> None:
    pulled = 0

    def rows() -> Iterator[dict[str, Any]]:
        nonlocal pulled
        pulled += 1
        yield {}

    with Sessions() as session:
        with pytest.raises(EnqueueError, match=message) as info:
            session.enqueue_many(EmailJob, rows(), **options)
        assert not isinstance(info.value, BulkRowError) and pulled == 0


def test_rows_must_be_an_iterable_of_rows(Sessions: sessionmaker[QueueSession]) -> None:
    with Sessions() as session:
        with pytest.raises(TypeError, match="wrap a single row in a list"):
            session.enqueue_many(EmailJob, {"recipient": "x"})
        with pytest.raises(TypeError, match="wrap a single row"):
            session.enqueue_many(EmailJob, EmailJob())  # type: ignore[arg-type]
        assert session.enqueue_many(EmailJob, iter(())) == 0


# -- choosing the path --------------------------------------------------------------------


def test_auto_uses_insert_below_the_crossover_and_copy_above(
    Sessions: sessionmaker[QueueSession], engine: Engine, inserts: list[str]
) -> None:
    with Sessions() as session:
        session.enqueue_many(EmailJob, [{}] * (COPY_MIN_ROWS - 1))
        assert len(inserts) == (1 if COPY_MIN_ROWS > 1 else 0)
        session.enqueue_many(EmailJob, [{}] * COPY_MIN_ROWS)
        session.enqueue_many(EmailJob, ({} for _ in range(5)), batch_size=2)  # maybe more: COPY
        assert len(inserts) == (1 if COPY_MIN_ROWS > 1 else 0)
        session.commit()
    assert count(engine, EmailJob) == 2 * COPY_MIN_ROWS - 1 + 5


def test_copy_honours_schema_translate_map(engine: Engine) -> None:
    """COPY is written by hand, so it must apply the schema translation INSERT would."""
    with engine.begin() as conn:
        conn.execute(text("DROP SCHEMA IF EXISTS bulk_other CASCADE"))
        conn.execute(text("CREATE SCHEMA bulk_other"))
        conn.execute(
            text("CREATE TABLE bulk_other.email_jobs (LIKE public.email_jobs INCLUDING ALL)")
        )
    try:
        translated = engine.execution_options(schema_translate_map={None: "bulk_other"})
        with Session(translated) as session:
            enqueue_many(session, EmailJob, [{}] * 5, method="copy")
            session.commit()
        with engine.connect() as conn:
            assert conn.scalar(text("SELECT count(*) FROM bulk_other.email_jobs")) == 5
        assert count(engine, EmailJob) == 0
    finally:
        with engine.begin() as conn:
            conn.execute(text("DROP SCHEMA bulk_other CASCADE"))


# -- one set of rules, in every batch path -------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("form", ["dict", "instance"])
@pytest.mark.parametrize(("model", "column", "value", "error", "message"), COLUMN_SAMPLE)
def test_bad_row_values_are_bulk_row_errors_in_every_path(
    Sessions: sessionmaker[QueueSession],
    engine: Engine,
    method: Any,
    form: str,
    model: Any,
    column: str,
    value: Any,
    error: type[Exception],
    message: str,
) -> None:
    values = row_values(model, column, value)
    good = row_values(model, "queue", "fine")
    rows: list[Any] = [good, values] if form == "dict" else [model(**good), model(**values)]
    with Sessions() as session:
        session.add(Order(customer="kept"))
        session.flush()
        with pytest.raises(BulkRowError, match=message) as raised:
            session.enqueue_many(model, rows, method=method)
        assert raised.value.index == 1
        assert type(raised.value.__cause__) is error
        session.commit()  # the caller's transaction, and its business row, are intact
    assert count(engine, Order) == 1 and count(engine, model) == 0


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("options", "message"), OPTION_SAMPLE)
def test_bad_option_values_fail_before_any_row_is_written(
    Sessions: sessionmaker[QueueSession],
    engine: Engine,
    method: Any,
    options: dict[str, Any],
    message: str,
) -> None:
    with Sessions() as session:
        session.add(Order(customer="kept"))
        session.flush()
        with pytest.raises(EnqueueError, match=message) as raised:
            session.enqueue_many(EmailJob, [{}, {}], method=method, **options)
        assert not isinstance(raised.value, BulkRowError)
        session.commit()
    assert count(engine, Order) == 1 and count(engine, EmailJob) == 0


@pytest.mark.parametrize("method", METHODS)
def test_text_and_json_near_the_rules_are_stored_as_given(
    Sessions: sessionmaker[QueueSession], engine: Engine, method: Any
) -> None:
    with Sessions() as session:
        session.enqueue_many(EmailJob, [{"recipient": GOOD_TEXT}, EmailJob(recipient=GOOD_TEXT)], method=method)
        session.enqueue_many(Task, [{"task": "t", "payload": GOOD_PAYLOAD}] * 2, method=method)
        session.commit()
    with engine.connect() as conn:
        assert conn.scalars(select(EmailJob.recipient)).all() == [GOOD_TEXT, GOOD_TEXT]
        assert conn.scalars(select(Task.payload)).all() == [GOOD_PAYLOAD, GOOD_PAYLOAD]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("batches", ["one batch", "several batches"])
def test_a_database_error_leaves_the_callers_transaction_usable(
    Sessions: sessionmaker[QueueSession], engine: Engine, method: Any, batches: str
) -> None:
    """One batch or many, the load runs in a SAVEPOINT: a foreign key error undoes only it."""
    batch_size = 1000 if batches == "one batch" else 10
    with Sessions() as session:
        session.add(Order(customer="kept"))
        session.flush()
        rows = [{"recipient": "ok"}] * 30 + [{"order_id": 987654}] + [{"recipient": "ok"}] * 5
        with pytest.raises(IntegrityError, match="foreign key"):
            session.enqueue_many(EmailJob, rows, method=method, batch_size=batch_size)
        assert session.enqueue_many(EmailJob, [{"recipient": "again"}] * 2, method=method) == 2
        session.commit()
    assert count(engine, Order) == 1
    with engine.connect() as conn:
        assert conn.scalars(select(EmailJob.recipient)).all() == ["again", "again"]


@pytest.mark.parametrize("method", METHODS)
def test_a_one_row_load_with_a_database_error_leaves_the_transaction_usable(
    Sessions: sessionmaker[QueueSession], engine: Engine, method: Any
) -> None:
    with Sessions() as session:
        session.add(Order(customer="kept"))
        session.flush()
        with pytest.raises(IntegrityError, match="foreign key"):
            session.enqueue_many(EmailJob, [{"order_id": 987654}], method=method)
        session.commit()
    assert count(engine, Order) == 1 and count(engine, EmailJob) == 0


@pytest.mark.parametrize("method", METHODS)
def test_a_database_error_goes_through_the_engines_error_hooks(
    Sessions: sessionmaker[QueueSession], engine: Engine, method: Any
) -> None:
    """COPY runs on the psycopg connection, beside SQLAlchemy's execution: its errors are
    still SQLAlchemy's (``.orig`` psycopg's), seen by ``handle_error`` hooks as on the
    INSERT path, and the SAVEPOINT keeps the transaction usable."""
    handled: list[Exception] = []
    listener = event.listens_for(engine, "handle_error")(lambda context: handled.append(context.original_exception))
    try:
        with Sessions() as session:
            session.add(Order(customer="kept"))
            session.flush()
            with pytest.raises(IntegrityError) as raised:
                session.enqueue_many(EmailJob, [{"recipient": "ok"}, {"order_id": 987654}], method=method)
            assert isinstance(raised.value.orig, psycopg.errors.ForeignKeyViolation)
            assert handled == [raised.value.orig]
            session.enqueue_many(EmailJob, [{"recipient": "again"}] * 2, method=method)
            session.commit()
    finally:
        event.remove(engine, "handle_error", listener)
    assert count(engine, Order) == 1
    with engine.connect() as conn:
        assert conn.scalars(select(EmailJob.recipient)).all() == ["again", "again"]


# -- what only SQL can write, and single-table inheritance ---------------------------------


def _secrets(engine: Engine) -> tuple[list[Any], list[Any]]:
    """The ``secret`` column as stored, and as the type reads it."""
    with engine.connect() as conn:
        stored = conn.scalars(text("SELECT secret FROM encoded_jobs ORDER BY id")).all()
        read = conn.scalars(select(EncodedJob.secret).order_by(EncodedJob.id)).all()
    return list(stored), list(read)


@pytest.mark.parametrize("method", ["auto", "insert"])
def test_a_type_with_a_bind_expression_is_written_by_insert(
    Sessions: sessionmaker[QueueSession], engine: Engine, inserts: list[str], method: Any
) -> None:
    """A ``bind_expression`` (SQL around the value, e.g. ``pgp_sym_encrypt()``) lives in
    the INSERT's text; COPY would store the value as given. ``auto`` takes INSERTs."""
    written = ["by enqueue", *(f"row {n}" for n in range(5)), "from an object", None]
    with Sessions() as session:
        session.enqueue(EncodedJob(secret=written[0]))
        session.flush()
        rows: list[Any] = [{"secret": s} for s in written[1:-2]]
        session.enqueue_many(EncodedJob, [*rows, EncodedJob(secret=written[-2]), {"secret": None}], method=method)
        session.commit()
    stored, read = _secrets(engine)
    assert read == written
    assert stored == [None if s is None else base64.b64encode(s.encode()).decode() for s in written]


def test_copy_is_refused_for_a_type_with_a_bind_expression(
    Sessions: sessionmaker[QueueSession], engine: Engine
) -> None:
    with Sessions() as session:
        message = r"method='copy' is impossible.* secret of encoded_jobs .*bind_expression"
        with pytest.raises(EnqueueError, match=message):
            session.enqueue_many(EncodedJob, [{"secret": "s"}] * 3, method="copy")
        session.commit()
    assert count(engine, EncodedJob) == 0


@pytest.mark.parametrize("method", METHODS)
def test_a_subclass_of_single_table_inheritance_writes_its_identity(
    Sessions: sessionmaker[QueueSession], engine: Engine, method: Any
) -> None:
    """Rows of a subclass get its polymorphic identity, as ``enqueue()`` of an instance
    writes it; rows of the base may name a subclass's; any other identity is refused."""
    with Sessions() as session:
        session.enqueue(InheritedJobA())
        session.flush()
        session.enqueue_many(InheritedJobA, [{}, {"kind": None}, InheritedJobA(), {"kind": "a"}], method=method)
        session.enqueue_many(InheritedJobB, [{}, {}], method=method)
        session.enqueue_many(InheritedJob, [{}, {"kind": "b"}, InheritedJobB(), InheritedJobA()], method=method)
        refused: list[tuple[Any, list[Any], str]] = [
            (InheritedJobA, [{}, {"kind": "b"}], "kind='b' is not a polymorphic identity of InheritedJobA"),
            (InheritedJobA, [InheritedJobB()], "kind='b' is not a polymorphic identity of InheritedJobA"),
            (InheritedJobB, [{"kind": "base"}], "kind='base' is not a polymorphic identity of InheritedJobB"),
            (InheritedJob, [{}, {"kind": "c"}], "kind='c' is not a polymorphic identity of InheritedJob "),
        ]
        for model, rows, message in refused:
            with pytest.raises(BulkRowError, match=f"^row {len(rows) - 1}: {message}"):
                session.enqueue_many(model, rows, method=method)
        session.commit()
    with Session(engine) as session:
        loaded = session.scalars(select(InheritedJob).order_by(InheritedJob.id)).all()
        assert [type(job).__name__ for job in loaded] == [
            "InheritedJobA",
            *["InheritedJobA"] * 4,
            *["InheritedJobB"] * 2,
            "InheritedJob",
            "InheritedJobB",
            "InheritedJobB",
            "InheritedJobA",
        ]
