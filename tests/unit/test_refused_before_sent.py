"""One set of rules on every enqueue path: a value the database would refuse is refused
before anything is sent, on a session bound to an engine that is never connected.

The unit tier refuses database connections (``tests/conftest.py``), so each case here
proves more than "nothing was written": nothing reached the server at all, and the
session began no transaction, so the caller's own transaction cannot have been touched.
The integration suites (``test_enqueue``, ``test_values``, ``test_bulk``,
``test_async_enqueue``, ``test_async_values``) check on the real server, for a sample of
these cases, that the caller's transaction commits whole after the refusal.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from sqla_queue import (
    AsyncQueueSession,
    BulkRowError,
    EnqueueError,
    QueueSession,
    TaskArgumentError,
    Tasks,
    enqueue_many,
    enqueue_values,
)

from ..bad_values import COLUMN_CASES, OPTION_CASES, row_values
from ..models import EmailJob, Task

#: Port 1 on loopback: nothing listens there, and the unit tier refuses the attempt first.
NOWHERE = "postgresql+psycopg://nobody@127.0.0.1:1/nowhere"
METHODS = ["copy", "insert"]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    engine = create_engine(NOWHERE)
    yield engine
    engine.dispose()


def _async_engine() -> AsyncEngine:
    return create_async_engine(NOWHERE)


async def _rows(rows: list[Any]) -> AsyncIterator[Any]:
    for row in rows:
        await asyncio.sleep(0)
        yield row


# -- session.enqueue(job) -------------------------------------------------------------------


@pytest.mark.parametrize(("model", "column", "value", "error", "message"), COLUMN_CASES)
def test_enqueue_refuses_bad_attributes_before_anything_is_sent(
    engine: Engine, model: Any, column: str, value: Any, error: type[Exception], message: str
) -> None:
    with QueueSession(engine) as session:
        job = model(**row_values(model, column, value))
        with pytest.raises(error, match=message) as raised:
            session.enqueue(job)
        assert type(raised.value) is error
        assert job not in session and not session.in_transaction()


@pytest.mark.parametrize(("options", "message"), OPTION_CASES)
def test_enqueue_refuses_bad_options_before_anything_is_sent(
    engine: Engine, options: dict[str, Any], message: str
) -> None:
    with QueueSession(engine) as session:
        job = EmailJob()
        with pytest.raises(EnqueueError, match=message):
            session.enqueue(job, **options)
        assert job not in session and not session.in_transaction()


# -- enqueue_values(session, Model, values) ---------------------------------------------------


@pytest.mark.parametrize(("model", "column", "value", "error", "message"), COLUMN_CASES)
def test_enqueue_values_refuses_bad_values_before_anything_is_sent(
    engine: Engine, model: Any, column: str, value: Any, error: type[Exception], message: str
) -> None:
    with Session(engine) as session:
        with pytest.raises(error, match=message):
            enqueue_values(session, model, row_values(model, column, value))
        assert not session.in_transaction()


@pytest.mark.parametrize(("options", "message"), OPTION_CASES)
def test_enqueue_values_refuses_bad_options_before_anything_is_sent(
    engine: Engine, options: dict[str, Any], message: str
) -> None:
    with Session(engine) as session:
        with pytest.raises(EnqueueError, match=message):
            enqueue_values(session, EmailJob, **options)
        assert not session.in_transaction()


# -- enqueue_many(session, Model, rows, method=...) ---------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("form", ["dict", "instance"])
@pytest.mark.parametrize(("model", "column", "value", "error", "message"), COLUMN_CASES)
def test_enqueue_many_refuses_a_bad_row_as_a_bulk_row_error(
    engine: Engine, method: str, form: str, model: Any, column: str, value: Any, error: type[Exception], message: str
) -> None:
    values = row_values(model, column, value)
    rows: list[Any] = [values] if form == "dict" else [model(**values)]
    with QueueSession(engine) as session:
        with pytest.raises(BulkRowError, match=message) as raised:
            session.enqueue_many(model, rows, method=method)  # type: ignore[arg-type]
        assert raised.value.index == 0
        assert type(raised.value.__cause__) is error
        assert not session.in_transaction()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("options", "message"), OPTION_CASES)
def test_enqueue_many_refuses_bad_options_before_any_row_is_read(
    engine: Engine, method: str, options: dict[str, Any], message: str
) -> None:
    pulled = 0

    def rows() -> Iterator[dict[str, Any]]:
        nonlocal pulled
        for _ in range(5):
            pulled += 1
            yield {}

    with Session(engine) as session:
        with pytest.raises(EnqueueError, match=message) as raised:
            enqueue_many(session, EmailJob, rows(), method=method, **options)  # type: ignore[call-overload]
        assert not isinstance(raised.value, BulkRowError)
        assert pulled == 0 and not session.in_transaction()


# -- the async paths ------------------------------------------------------------------------------


@pytest.mark.parametrize(("model", "column", "value", "error", "message"), COLUMN_CASES)
def test_async_enqueue_refuses_as_enqueue_does(
    model: Any, column: str, value: Any, error: type[Exception], message: str
) -> None:
    async def body() -> None:
        async_engine = _async_engine()
        try:
            async with AsyncQueueSession(async_engine) as session:
                job = model(**row_values(model, column, value))
                with pytest.raises(error, match=message):
                    session.enqueue(job)
                assert job not in session and not session.in_transaction()
        finally:
            await async_engine.dispose()

    asyncio.run(body())


@pytest.mark.parametrize(("model", "column", "value", "error", "message"), COLUMN_CASES)
def test_async_enqueue_values_refuses_from_the_await(
    model: Any, column: str, value: Any, error: type[Exception], message: str
) -> None:
    async def body() -> None:
        async_engine = _async_engine()
        try:
            async with AsyncSession(async_engine) as session:
                with pytest.raises(error, match=message):
                    await enqueue_values(session, model, row_values(model, column, value))
                assert not session.in_transaction()
        finally:
            await async_engine.dispose()

    asyncio.run(body())


@pytest.mark.parametrize(("options", "message"), OPTION_CASES)
def test_async_enqueue_values_refuses_bad_options_from_the_await(options: dict[str, Any], message: str) -> None:
    async def body() -> None:
        async_engine = _async_engine()
        try:
            async with AsyncSession(async_engine) as session:
                with pytest.raises(EnqueueError, match=message):
                    await enqueue_values(session, EmailJob, **options)
                assert not session.in_transaction()
        finally:
            await async_engine.dispose()

    asyncio.run(body())


@pytest.mark.parametrize(("model", "column", "value", "error", "message"), COLUMN_CASES)
def test_async_enqueue_many_refuses_a_bad_row_as_the_sync_load_does(
    model: Any, column: str, value: Any, error: type[Exception], message: str
) -> None:
    rows = [row_values(model, column, value)]

    async def body() -> None:
        async_engine = _async_engine()
        try:
            async with AsyncQueueSession(async_engine) as session:
                with pytest.raises(BulkRowError, match=message) as raised:
                    await session.enqueue_many(model, _rows(rows), method="copy")
                assert (raised.value.index, type(raised.value.__cause__)) == (0, error)
                assert not session.in_transaction()
        finally:
            await async_engine.dispose()

    asyncio.run(body())


@pytest.mark.parametrize(("options", "message"), OPTION_CASES)
def test_async_enqueue_many_refuses_bad_options_before_any_row_is_read(options: dict[str, Any], message: str) -> None:
    pulled = 0

    async def rows() -> AsyncIterator[dict[str, Any]]:
        nonlocal pulled
        for _ in range(5):
            pulled += 1
            yield {}

    async def body() -> None:
        async_engine = _async_engine()
        try:
            async with AsyncQueueSession(async_engine) as session:
                with pytest.raises(EnqueueError, match=message) as raised:
                    await session.enqueue_many(EmailJob, rows(), **options)
                assert not isinstance(raised.value, BulkRowError)
                assert pulled == 0 and not session.in_transaction()
        finally:
            await async_engine.dispose()

    asyncio.run(body())


# -- a task's function: task.enqueue(session, **payload) ----------------------------------------

tasks = Tasks(Task)


@tasks.task
def anything(job: Task, /, **payload: Any) -> None:
    """Takes any payload: what is refused is the value, not the call."""


@tasks.task
def mail(job: Task, *, to: str) -> None:
    """Takes one payload keyword."""


PAYLOAD_CASES = [case for case in COLUMN_CASES if case.values[1] == "payload"]


@pytest.mark.parametrize(("model", "column", "value", "error", "message"), PAYLOAD_CASES)
def test_a_task_function_refuses_a_bad_payload_before_anything_is_sent(
    engine: Engine, model: Any, column: str, value: Any, error: type[Exception], message: str
) -> None:
    with Session(engine) as session:
        with pytest.raises(error, match=message):
            anything.enqueue(session, **value)
        assert not session.new and not session.in_transaction()


@pytest.mark.parametrize(("options", "message"), OPTION_CASES)
def test_a_task_function_refuses_bad_options_before_anything_is_sent(
    engine: Engine, options: dict[str, Any], message: str
) -> None:
    with Session(engine) as session:
        with pytest.raises(EnqueueError, match=message):
            anything.with_options(**options).enqueue(session, a=1)
        assert not session.new and not session.in_transaction()


@pytest.mark.parametrize(("model", "column", "value", "error", "message"), PAYLOAD_CASES[:2])
def test_a_task_function_refuses_on_an_async_session_at_the_call(
    model: Any, column: str, value: Any, error: type[Exception], message: str
) -> None:
    async def body() -> None:
        async_engine = _async_engine()
        try:
            async with AsyncQueueSession(async_engine) as session:
                with pytest.raises(error, match=message):
                    anything.enqueue(session, **value)
                with pytest.raises(TaskArgumentError, match="unexpected keyword argument 'cc'"):
                    mail.enqueue(session, to="a@example.com", cc="b@example.com")  # type: ignore[call-overload]
                with pytest.raises(TaskArgumentError, match="unexpected keyword argument 'cc'"):
                    mail.with_options(unique_key="k").enqueue(session, to="a", cc="b")  # type: ignore[call-overload]
                assert not session.new and not session.in_transaction()
        finally:
            await async_engine.dispose()

    asyncio.run(body())
