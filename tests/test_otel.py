"""OpenTelemetry: the enqueuing span's context stored on the row by every enqueue path, and
one span per job run linked to it, in this process and across processes; read from the
SDK's in-memory exporter. Real PostgreSQL; the worker on both runtimes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import produce_migrations, render_python_code
from alembic.migration import MigrationContext
from alembic.operations import Operations
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from sqlalchemy import Engine, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, sessionmaker

from sqla_queue import AsyncQueueSession, JobMixin, QueueSession, enqueue_many, enqueue_values
from sqla_queue.otel import TracingObserver
from sqla_queue.tracing import current_trace_context

from .helpers import Server, table_of, wait_for
from .models import Task

TASKS = table_of(Task)
REPO = Path(__file__).resolve().parent.parent


class Tracing:
    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("tests")

    def spans(self, name_prefix: str = "sqla_queue.job") -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if s.name.startswith(name_prefix)]


@pytest.fixture
def tracing() -> Iterator[Tracing]:
    found = Tracing()
    yield found
    found.provider.shutdown()


def stored(engine: Engine) -> dict[int, Any]:
    with engine.connect() as conn:
        return {row[0]: row[1] for row in conn.execute(select(TASKS.c.id, TASKS.c.trace_context).order_by(TASKS.c.id))}


def traceparent_of(span: Any) -> str:
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


def test_every_enqueue_path_stores_the_current_context(
    engine: Engine, Sessions: sessionmaker[QueueSession], tracing: Tracing
) -> None:
    with tracing.tracer.start_as_current_span("request") as request, Sessions() as session:
        session.enqueue(Task(task="work"))
        session.enqueue_many(Task, [{"task": "work"}] * 3, method="copy")
        session.enqueue_many(Task, [{"task": "work"}] * 2, method="insert")
        enqueue_values(session, Task, {"task": "work"})
        session.commit()
    with engine.begin() as conn, tracing.tracer.start_as_current_span("another"):
        enqueue_values(conn, Task, {"task": "work"})
    contexts = list(stored(engine).values())
    assert len(contexts) == 8
    assert contexts[:7] == [{"traceparent": traceparent_of(request)}] * 7
    assert contexts[7]["traceparent"] != contexts[0]["traceparent"]


def test_the_async_paths_store_it_too(engine: Engine, server: Server, tracing: Tracing) -> None:
    async def body(async_engine: AsyncEngine) -> str:
        Sessions = async_sessionmaker(async_engine, class_=AsyncQueueSession)
        with tracing.tracer.start_as_current_span("request") as request:
            async with Sessions() as session:
                session.enqueue(Task(task="work"))
                await session.enqueue_many(Task, [{"task": "work"}] * 2, method="copy")
                await enqueue_many(session, Task, [{"task": "work"}], method="insert")
                await enqueue_values(session, Task, {"task": "work"})
                await session.commit()
        return traceparent_of(request)

    async def main() -> str:
        async_engine = create_async_engine(server.url)
        try:
            return await body(async_engine)
        finally:
            await async_engine.dispose()

    parent = asyncio.run(main())
    assert list(stored(engine).values()) == [{"traceparent": parent}] * 5


def test_no_span_no_context(engine: Engine, Sessions: sessionmaker[QueueSession], tracing: Tracing) -> None:
    assert current_trace_context() is None
    with Sessions() as session:
        session.enqueue(Task(task="work"))
        session.enqueue_many(Task, [{"task": "work"}] * 2)
        enqueue_values(session, Task, {"task": "work"})
        session.commit()
    assert list(stored(engine).values()) == [None] * 4
    with engine.connect() as conn:  # SQL NULL, not JSON null
        assert conn.scalar(text("SELECT count(*) FROM tasks WHERE trace_context IS NULL")) == 4


def test_a_given_context_is_kept(engine: Engine, Sessions: sessionmaker[QueueSession], tracing: Tracing) -> None:
    mine = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    with tracing.tracer.start_as_current_span("request"), Sessions() as session:
        session.enqueue(Task(task="work", trace_context=mine))
        session.enqueue_many(Task, [{"task": "work", "trace_context": mine}])
        enqueue_values(session, Task, {"task": "work", "trace_context": mine})
        session.commit()
    assert list(stored(engine).values()) == [mine] * 3


def test_a_span_per_run_linked_to_the_enqueuing_span(
    engine: Engine, Sessions: sessionmaker[QueueSession], start_worker: Callable[..., Any], tracing: Tracing
) -> None:
    with tracing.tracer.start_as_current_span("request") as request, Sessions() as session:
        done = session.enqueue(Task(task="work"), queue="mail")
        flaky = session.enqueue(Task(task="flaky", payload={"succeed_on": 2}))
        session.commit()
        done_id, flaky_id = done.id, flaky.id
    with Sessions() as session:  # enqueued outside any span: no link
        alone = session.enqueue(Task(task="work"))
        session.commit()
        alone_id = alone.id
    start_worker(observers=[TracingObserver(tracing.provider)])
    wait_for(lambda: len(tracing.spans()) == 4, what="four job spans")
    by_run = {(dict(s.attributes or {})["sqla_queue.job_id"], dict(s.attributes or {})["sqla_queue.attempt"]): s
              for s in tracing.spans()}
    assert set(by_run) == {(str(done_id), 1), (str(flaky_id), 1), (str(flaky_id), 2), (str(alone_id), 1)}
    span = by_run[(str(done_id), 1)]
    assert span.name == "sqla_queue.job work" and span.kind is SpanKind.CONSUMER
    attributes = dict(span.attributes or {})
    assert {k: attributes[k] for k in ("sqla_queue.table", "sqla_queue.queue", "sqla_queue.task",
                                       "sqla_queue.outcome")} == {
        "sqla_queue.table": "tasks", "sqla_queue.queue": "mail", "sqla_queue.task": "work",
        "sqla_queue.outcome": "done",
    }
    assert span.start_time is not None and span.end_time is not None and span.end_time >= span.start_time
    [link] = span.links
    assert link.context.trace_id == request.get_span_context().trace_id
    assert link.context.span_id == request.get_span_context().span_id
    retried = by_run[(str(flaky_id), 1)]
    assert retried.attributes is not None and retried.attributes["sqla_queue.outcome"] == "retried"
    assert retried.status.status_code is StatusCode.ERROR
    assert "flaky failure on attempt 1" in (retried.status.description or "")
    assert by_run[(str(flaky_id), 2)].status.status_code is StatusCode.UNSET
    assert by_run[(str(alone_id), 1)].links == ()


ENQUEUER = """
import sys
from opentelemetry.sdk.trace import TracerProvider
from sqlalchemy import create_engine
from sqlalchemy.orm import Session
from sqla_queue import QueueSession
from tests.models import Task

tracer = TracerProvider().get_tracer("web")
engine = create_engine(sys.argv[1])
with tracer.start_as_current_span("POST /orders") as span, QueueSession(engine) as session:
    job = session.enqueue(Task(task="work"))
    session.commit()
    ctx = span.get_span_context()
    print(job.id, f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}")
"""


@pytest.mark.system
def test_the_link_crosses_processes(
    engine: Engine, server: Server, start_worker: Callable[..., Any], tracing: Tracing
) -> None:
    """Enqueued by another process inside its request's span: the job's span here links to it."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(ENQUEUER), server.url.render_as_string(hide_password=False)],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stderr
    job_id, trace_id, span_id = result.stdout.split()
    start_worker(observers=[TracingObserver(tracing.provider)])
    [span] = wait_for(tracing.spans, what="the job's span")
    assert span.attributes is not None and span.attributes["sqla_queue.job_id"] == job_id
    [link] = span.links
    assert (f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}") == (trace_id, span_id)


def test_autogenerate_adds_the_column_to_an_existing_table(engine: Engine) -> None:
    """A table made before the column existed: autogenerate writes one nullable
    ``add_column`` of JSONB, which runs on a table with rows."""

    class Before(DeclarativeBase):
        pass

    class After(DeclarativeBase):
        pass

    class Old(Before, JobMixin):
        __tablename__ = "trace_migration"

    class New(After, JobMixin):
        __tablename__ = "trace_migration"

    try:
        with engine.begin() as conn:
            Before.metadata.create_all(conn)
            conn.execute(text("ALTER TABLE trace_migration DROP COLUMN trace_context"))
            conn.execute(text("INSERT INTO trace_migration (queue) SELECT 'q' FROM generate_series(1, 20)"))
            context = MigrationContext.configure(conn, opts={
                "target_metadata": After.metadata,
                "include_name": lambda name, kind, parent: kind != "table" or name == "trace_migration",
            })
            ops = produce_migrations(context, After.metadata).upgrade_ops
            assert ops is not None
            (change,) = ops.as_diffs()
            assert change[0] == "add_column" and change[3].name == "trace_context", change
            code = render_python_code(ops)
            assert "postgresql.JSONB" in code and "nullable=True" in code
            operations = Operations(context)
            for table_ops in ops.ops:
                for op in getattr(table_ops, "ops", [table_ops]):
                    operations.invoke(op)
            assert conn.scalar(text("SELECT count(*) FROM trace_migration WHERE trace_context IS NULL")) == 20
    finally:
        with engine.begin() as conn:
            Before.metadata.drop_all(conn)
