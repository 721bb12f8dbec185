"""Row plans (sqla_queue.enqueue.rows) and the plan cache, without a database.

What a plan decides from the model and the dialect alone (defaults, checks, NOT NULL,
the managed columns, the discriminator, the queue to wake, the COPY order, the SQL of
``enqueue_values()``) is checked here on the psycopg dialect, unconnected. That the rows
are then written as described is the integration tests' part (tests/test_bulk.py,
tests/test_values.py, tests/test_enqueue.py).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import JSON, String, func, null
from sqlalchemy.dialects import sqlite
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqla_queue import BulkRowError, EnqueueError, InvalidPayload, JobMixin, NotAQueueModel, queue_table
from sqla_queue.cache import PlanCache, plans
from sqla_queue.enqueue.rows import DELAY_PARAM, InsertPlan, RowWriter, TablePlan, insert_plan, table_plan
from tests.models import EmailJob, EncodedJob, Order, PolyJob, PolyJobA, PolyJobA1, PolyJobB, RoutedJob, Task

DIALECT = PGDialect_psycopg()  # type: ignore[no-untyped-call]


class _Base(DeclarativeBase):
    """Models of these tests alone (never created in a database)."""


def _writer(model: Any, options: dict[str, Any] | None = None, *, for_copy: bool = True) -> RowWriter:
    return RowWriter(table_plan(model).dialect(DIALECT), dict(options or {}), for_copy=for_copy)


def _rows(writer: RowWriter, rows: list[Any]) -> list[tuple[tuple[str, ...], Any]]:
    return [row for batch in writer.batches(rows, iter(()), len(rows) or 1) for row in batch]


def _bad(writer: RowWriter, rows: list[Any]) -> BulkRowError:
    with pytest.raises(BulkRowError) as raised:
        _rows(writer, rows)
    return raised.value


# -- the table plan ---------------------------------------------------------------------


def test_a_table_plan_classifies_the_columns_once() -> None:
    plan = table_plan(EmailJob)
    assert plan is table_plan(EmailJob)  # cached per model
    assert plan.table is EmailJob.__table__
    defaults = {key: (is_callable, value) for key, is_callable, value in plan.defaults}
    assert defaults["recipient"] == (False, "someone@example.com")
    assert defaults["queue"] == (False, "default")
    assert plan.default_queue == "default"
    assert plan.insert_only == {}
    assert plan.contextual == frozenset()
    assert "status" in plan.not_null
    assert "order_id" not in plan.not_null
    assert plan.required == frozenset()  # every NOT NULL column has a default
    assert plan.bind_arguments == {"mapper": EmailJob}


def test_a_table_plan_of_a_table_or_an_instance() -> None:
    table = Task.__table__
    plan = table_plan(table)
    assert plan is table_plan(table)
    assert plan.table is table
    assert plan.is_task_table
    assert table_plan(Task(task="x")) is not table_plan(Task(task="x"))  # instances are not kept
    with pytest.raises(NotAQueueModel):
        table_plan(Order)


def test_defaults_only_an_insert_evaluates() -> None:
    routed = table_plan(RoutedJob)
    assert routed.insert_only == {"routing": "context"}
    assert routed.contextual == frozenset({"routing"})
    class SqlDefaultJob(_Base, JobMixin):
        __tablename__ = "sql_default_jobs"
        stamp: Mapped[str] = mapped_column(String(40), default=func.now())

    plan = TablePlan(queue_table(SqlDefaultJob))
    assert plan.insert_only == {"stamp": "sql"}
    assert plan.contextual == frozenset()


def test_copy_is_refused_where_it_would_not_write_what_an_insert_writes() -> None:
    assert table_plan(EmailJob).dialect(DIALECT).copy_impossible is None
    routed = table_plan(RoutedJob).dialect(DIALECT).copy_impossible
    assert routed is not None and "routing" in routed and "only an INSERT can evaluate" in routed
    encoded = table_plan(EncodedJob).dialect(DIALECT).copy_impossible
    assert encoded is not None and "secret" in encoded and "bind_expression" in encoded
    other = table_plan(EmailJob).dialect(sqlite.dialect()).copy_impossible
    assert other == "COPY needs PostgreSQL, the session's database is sqlite"


def test_the_options_meet_the_columns_rules() -> None:
    plan = table_plan(EmailJob)
    plan.check_options({"queue": "q" * 128})
    with pytest.raises(EnqueueError, match="queue is longer than 128 characters"):
        plan.check_options({"queue": "q" * 129})


# -- bulk rows ------------------------------------------------------------------------------


def test_a_row_gets_the_options_it_lacks_and_the_python_defaults() -> None:
    writer = _writer(EmailJob, {"queue": "mail", "priority": 5}, for_copy=False)
    (own, filled) = _rows(writer, [{"order_id": 1, "queue": "own"}, {"recipient": "a@example.com"}])
    shape, values = own
    assert values["queue"] == "own"  # a row's own value wins over the option
    assert values["priority"] == 5
    assert values["recipient"] == "someone@example.com"  # the column's Python default
    assert values["order_id"] == 1
    assert shape == tuple(c.key for c in EmailJob.__table__.c if c.key in values)  # table order
    _, values = filled
    assert values["queue"] == "mail"
    assert values["recipient"] == "a@example.com"
    assert writer.queues == {"own", "mail"}


def test_rows_without_a_queue_wake_the_default_queue() -> None:
    writer = _writer(EmailJob)
    _rows(writer, [{"order_id": 1}])
    assert writer.queues == {"default"}


def test_a_callable_default_is_called_per_row() -> None:
    calls: list[int] = []

    def next_serial() -> int:
        calls.append(1)
        return len(calls)

    class CountedJob(_Base, JobMixin):
        __tablename__ = "counted_jobs"
        serial: Mapped[int] = mapped_column(default=next_serial)

    writer = RowWriter(TablePlan(queue_table(CountedJob)).dialect(DIALECT), {}, for_copy=False)
    rows = _rows(writer, [{}, {}, {}])
    assert [values["serial"] for _, values in rows] == [1, 2, 3]


def test_copy_rows_are_tuples_in_table_order_with_json_as_text() -> None:
    writer = _writer(Task, {"queue": "t"})
    ((shape, values),) = _rows(writer, [{"payload": {"b": [1, 2]}, "task": "resize"}])
    assert shape == tuple(c.key for c in Task.__table__.c if c.key in shape)
    row = dict(zip(shape, values, strict=True))
    assert row["task"] == "resize"
    assert json.loads(row["payload"]) == {"b": [1, 2]}
    assert row["queue"] == "t"


def test_rows_of_different_columns_get_their_own_shapes() -> None:
    writer = _writer(EmailJob)
    (a, b, c) = _rows(writer, [{"order_id": 1}, {"priority": 3}, {"order_id": 3, "priority": 4}])
    assert a[0] == c[0] != b[0]
    assert "order_id" in a[0] and "order_id" not in b[0]  # no default: left out, NULL


def test_a_primary_key_of_none_is_left_to_the_database() -> None:
    writer = _writer(EmailJob, for_copy=False)
    ((shape, values), (shape2, values2)) = _rows(writer, [{"id": None, "order_id": 1}, {"id": 7, "order_id": 1}])
    assert "id" not in values and "id" not in shape
    assert values2["id"] == 7 and "id" in shape2


def test_instances_are_read_not_added() -> None:
    writer = _writer(EmailJob, for_copy=False)
    job = EmailJob(order_id=4, recipient="b@example.com")
    ((_, values),) = _rows(writer, [job])
    assert values["order_id"] == 4 and values["recipient"] == "b@example.com"
    assert job.id is None


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"nope": 1}, "unknown column(s) for table email_jobs: 'nope'"),
        ({"status": "running"}, "status='running': the queue manages status, leave it unset"),
        ({"attempts": 2}, "attempts=2: the queue manages attempts"),
        ({"queue": None}, "queue is NOT NULL, got None"),
        ({"queue": ""}, "queue must be a non-empty string"),
        ({"priority": 2**40}, "priority must be a 32-bit integer"),
        ({"recipient": "x" * 201}, "recipient is longer than 200 characters"),
        ({"recipient": "a\x00b"}, "recipient contains a NUL character"),
        ({"run_after": func.now()}, "run_after is a SQL expression"),
        ({"queue": null()}, "queue is NOT NULL, got None"),
        ({"run_after": "tomorrow"}, "run_after must be a timezone-aware datetime"),
    ],
)
def test_a_bad_row_is_named_by_its_index(row: dict[str, Any], message: str) -> None:
    error = _bad(_writer(EmailJob), [{"order_id": 1}, row])
    assert error.index == 1
    assert message in str(error)
    assert isinstance(error.__cause__, EnqueueError)


def test_bad_json_is_an_invalid_payload() -> None:
    error = _bad(_writer(Task), [{"task": "t", "payload": {"x": float("nan")}}])
    assert error.index == 0
    assert isinstance(error.__cause__, InvalidPayload)
    error = _bad(_writer(Task), [{"task": "t", "payload": "\u0000"}])
    assert "jsonb cannot store" in str(error)


def test_a_task_row_needs_a_task_name() -> None:
    error = _bad(_writer(Task), [{"payload": {}}])
    assert "needs a task name" in str(error)


def test_a_not_null_column_nothing_fills_is_missing() -> None:
    class NeedyJob(_Base, JobMixin):
        __tablename__ = "needy_jobs"
        needed: Mapped[str] = mapped_column(String(10))
        doc: Mapped[Any] = mapped_column(JSON)

    writer = RowWriter(TablePlan(queue_table(NeedyJob)).dialect(DIALECT), {}, for_copy=True)
    with pytest.raises(BulkRowError, match=r"row 0: missing a value for NOT NULL column\(s\) doc, needed"):
        _rows(writer, [{}])
    with pytest.raises(BulkRowError, match="doc is NOT NULL, got SQL NULL"):
        _rows(writer, [{"needed": "x", "doc": null()}])


def test_the_discriminator_of_single_table_inheritance() -> None:
    writer = _writer(PolyJobA, for_copy=False)
    rows = _rows(writer, [{"note": "n"}, {"kind": None}, {"kind": "a1"}])
    assert [values["kind"] for _, values in rows] == ["a", "a", "a1"]
    error = _bad(_writer(PolyJobA), [{"kind": "b"}])
    assert "kind='b' is not a polymorphic identity of PolyJobA" in str(error)
    assert table_plan(PolyJobB).polymorphic is not None
    assert table_plan(PolyJob).polymorphic is not table_plan(PolyJobA1).polymorphic


# -- enqueue(): ORM objects -------------------------------------------------------------------


def _check(job: Any, options: dict[str, Any] | None = None) -> dict[str, Any]:
    from sqlalchemy.orm import object_mapper

    from sqla_queue.enqueue._rules import dialect_json_serializer

    options = dict(options or {})
    table_plan(type(job)).check_job(job, object_mapper(job), options, lambda: dialect_json_serializer(DIALECT))
    return options


def test_a_job_object_meets_the_same_rules() -> None:
    assert _check(EmailJob(order_id=1)) == {}
    with pytest.raises(EnqueueError, match="EmailJob job has status='done'; the queue manages status"):
        _check(EmailJob(status="done"))
    with pytest.raises(EnqueueError, match="EmailJob job: recipient is longer than 200"):
        _check(EmailJob(recipient="x" * 201))
    with pytest.raises(EnqueueError, match="EmailJob job: queue is longer than 128"):
        _check(EmailJob(), {"queue": "q" * 129})  # an option overrides the job's value
    with pytest.raises(InvalidPayload, match="Task job: payload is not JSON-serialisable"):
        _check(Task(task="t", payload={"x": object()}))
    with pytest.raises(EnqueueError, match="Task job: needs a task name"):
        _check(Task(payload={}))


def test_a_job_object_gets_its_model_identity() -> None:
    assert PolyJobA().kind == "a"  # the ORM sets it on a new object
    assert _check(PolyJobA()) == {}
    assert _check(PolyJobA(kind=None)) == {"kind": "a"}
    assert _check(PolyJobA1(kind=None)) == {"kind": "a1"}
    assert _check(PolyJobA(kind="a1")) == {}
    with pytest.raises(EnqueueError, match="PolyJobA job: kind='b' is not a polymorphic identity"):
        _check(PolyJobA(kind="b"))


# -- enqueue_values(): the INSERT ------------------------------------------------------------


def test_the_insert_plan_of_a_set_of_columns() -> None:
    plan = table_plan(EmailJob)
    row = {"order_id": 1, "recipient": "c@example.com"}
    made = insert_plan(plan, DIALECT, row, False)
    assert made is insert_plan(plan, DIALECT, dict(row), False)  # one plan per shape
    assert made is not insert_plan(plan, DIALECT, {"order_id": 1}, False)
    assert made.direct and not made.direct_async
    assert "pg_notify" in made.sql and "WITH sqla_queue_job AS" in made.sql
    assert "DEFAULT" in made.sql  # columns whose server default says the same: no parameter
    params = made.driver_params(row, None)
    assert params["order_id"] == 1 and params["recipient"] == "c@example.com"
    assert DELAY_PARAM not in params
    delayed = insert_plan(plan, DIALECT, row, True)
    assert DELAY_PARAM in delayed.sql
    assert delayed.driver_params(row, 2.5)[DELAY_PARAM] == 2.5


def test_the_insert_plan_checks_its_row() -> None:
    plan = table_plan(Task)
    with pytest.raises(EnqueueError, match="status is managed by the queue"):
        insert_plan(plan, DIALECT, {"task": "t", "status": "done"}, False)
    with pytest.raises(InvalidPayload):
        insert_plan(plan, DIALECT, {"task": "t", "payload": {1: float("inf")}}, False)
    with pytest.raises(EnqueueError, match="has no column 'nope'"):
        insert_plan(plan, DIALECT, {"nope": 1}, False)


def test_a_contextual_default_is_left_to_sqlalchemy() -> None:
    plan = table_plan(RoutedJob)
    left_out = InsertPlan(plan, frozenset({"customer"}), False, DIALECT)
    assert not left_out.direct  # only SQLAlchemy's execution evaluates it
    assert "WITH" not in left_out.sql and "pg_notify" in left_out.sql
    given = InsertPlan(plan, frozenset({"customer", "routing"}), False, DIALECT)
    assert given.direct


# -- the cache ---------------------------------------------------------------------------------


def test_the_cache_is_bounded_and_drops_its_oldest_entry() -> None:
    cache = PlanCache(3)
    for n in range(5):
        cache.put(n, str(n))
    assert len(cache) == 3
    assert 0 not in cache and 1 not in cache
    assert cache.get(4) == "4"
    assert cache.get(0) is None
    assert cache.get_or_build("k", lambda: "built") == "built"
    assert cache.get_or_build("k", lambda: "again") == "built"
    assert len(cache) == 3
    cache.put(3, "three")  # replacing drops nothing
    assert len(cache) == 3 and cache.get(3) == "three"
    with pytest.raises(ValueError):
        PlanCache(0)


def test_the_enqueue_side_keeps_its_plans_in_the_one_cache() -> None:
    table_plan(EmailJob)
    made = insert_plan(table_plan(EmailJob), DIALECT, {"order_id": 9}, False)
    assert plans.get(EmailJob) is table_plan(EmailJob)
    assert plans.get((EmailJob.__table__, DIALECT, None, False, False, "order_id")) is made
    assert len(plans) <= plans.max_entries
