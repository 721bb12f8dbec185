"""Where COPY starts to beat multi-row INSERTs in ``enqueue_many`` (sets ``COPY_MIN_ROWS``).

    DATABASE_URL=postgresql://user@host/db python benchmarks/bulk_crossover.py [--runs 30]
        [--proxy-delay-ms D]

Creates a scratch database beside the one in ``DATABASE_URL`` (default: the local test
server, dropped at the end), times whole ``enqueue_many(..., method="copy")`` and
``method="insert"`` calls of N rows, each in a fresh transaction that is rolled back (so
the table stays the same size), interleaving the two methods, and prints the median per N
for a typed queue table (user columns, a foreign key, the four partial indexes) and a task
table (JSONB payload).

COPY costs one round trip more than an INSERT (the server must answer the COPY before
data may be sent), so the crossover depends on the latency to the server.
``--proxy-delay-ms`` routes the connections through a local TCP proxy that delays every
chunk by D ms each way (``0``: the proxy alone, which already adds ~0.3 ms of round trip),
to see the crossover of a server further away than localhost.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import threading
import time
import uuid
from typing import Any

from sqlalchemy import ForeignKey, String, create_engine, make_url, text
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from sqla_queue import JobMixin, TaskMixin, enqueue_many

SIZES = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000)


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)


class EmailJob(Base, JobMixin):
    __tablename__ = "email_jobs"
    order_id: Mapped[int | None] = mapped_column(ForeignKey("orders.id"))
    recipient: Mapped[str] = mapped_column(String(200), default="someone@example.com")


class Task(Base, TaskMixin):
    __tablename__ = "tasks"


def rows_for(model: Any, n: int) -> list[dict[str, Any]]:
    if model is Task:
        return [
            {"task": "resize", "payload": {"image": i, "w": 640, "tags": ["a", "é"]}}
            for i in range(n)
        ]
    return [{"order_id": 1, "recipient": f"user{i}@example.com"} for i in range(n)]


def time_call(engine: Any, model: Any, rows: list[dict[str, Any]], method: str) -> float:
    with Session(engine) as session:
        session.execute(text("SELECT 1"))  # the transaction and connection exist already
        start = time.perf_counter()
        enqueue_many(session, model, rows, method=method)  # type: ignore[arg-type]
        elapsed = time.perf_counter() - start
        session.rollback()
    return elapsed


def start_delay_proxy(target_host: str, target_port: int, delay: float) -> int:
    """A TCP proxy on localhost adding ``delay`` seconds each way; returns its port."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    writer.close()
                    return
                if due > loop.time():
                    await asyncio.sleep(due - loop.time())
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(send())
        while True:
            data = await reader.read(65536)
            await queue.put((loop.time() + delay, data))
            if not data:
                break
        await sender

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(target_host, target_port)
        await asyncio.gather(
            pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True
        )

    ready = threading.Event()
    port: list[int] = []

    async def serve() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port.append(server.sockets[0].getsockname()[1])
        ready.set()
        async with server:
            await server.serve_forever()

    threading.Thread(target=lambda: asyncio.run(serve()), daemon=True).start()
    ready.wait()
    return port[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--proxy-delay-ms", type=float, default=None)
    args = parser.parse_args()
    admin = make_url(os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test"))
    admin = admin.set(drivername="postgresql+psycopg")
    name = f"sqla_queue_bench_{uuid.uuid4().hex[:8]}"
    admin_engine = create_engine(admin, isolation_level="AUTOCOMMIT")
    with admin_engine.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = admin.set(database=name)
    if args.proxy_delay_ms is not None:
        proxy = start_delay_proxy(
            url.host or "127.0.0.1", url.port or 5432, args.proxy_delay_ms / 1e3
        )
        url = url.set(host="127.0.0.1", port=proxy)
    engine = create_engine(url)
    try:
        Base.metadata.create_all(engine)
        with Session(engine) as session:
            session.add(Order(id=1))
            session.commit()
            start = time.perf_counter()
            for _ in range(50):
                session.execute(text("SELECT 1"))
            rtt = (time.perf_counter() - start) / 50
            session.rollback()
        print(f"round trip (SELECT 1): {rtt * 1e3:.2f} ms")
        for model in (EmailJob, Task):
            for _ in range(3):  # warm up connections, caches, prepared statements
                time_call(engine, model, rows_for(model, 100), "copy")
                time_call(engine, model, rows_for(model, 100), "insert")
            print(f"\n{model.__tablename__}: median ms per call ({args.runs} runs)")
            print(f"{'rows':>6} {'copy':>9} {'insert':>9}  faster")
            for n in SIZES:
                rows = rows_for(model, n)
                runs = max(3, args.runs if n <= 1000 else args.runs // 5)
                copy, ins = [], []
                for _ in range(runs):
                    copy.append(time_call(engine, model, rows, "copy"))
                    ins.append(time_call(engine, model, rows, "insert"))
                c, i = statistics.median(copy) * 1e3, statistics.median(ins) * 1e3
                print(f"{n:>6} {c:>9.2f} {i:>9.2f}  {'copy' if c < i else 'insert'}")
    finally:
        engine.dispose()
        with admin_engine.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin_engine.dispose()


if __name__ == "__main__":
    main()
