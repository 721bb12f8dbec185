"""sqla_queue with plain SQLAlchemy: a queue table of your own, an enqueue beside a
business write, a worker, and the statements it runs, printed.

    python examples/plain_sqlalchemy.py      # embedded PostgreSQL if DATABASE_URL is unset
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from sqlalchemy import ForeignKey, String, create_engine, func, select
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from sqla_queue import JobMixin, QueueSession, Worker
from sqla_queue import sql as q
from sqla_queue.urls import psycopg_url


class Base(DeclarativeBase):
    pass


class Invoice(Base):
    __tablename__ = "example_invoices"

    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str] = mapped_column(String(100))
    amount_cents: Mapped[int]
    pdf_ready: Mapped[bool] = mapped_column(default=False)


class RenderInvoice(Base, JobMixin):
    """A typed queue table: one row per invoice to render, with a real foreign key."""

    __tablename__ = "example_render_invoice"

    invoice_id: Mapped[int] = mapped_column(ForeignKey(Invoice.id))
    paper: Mapped[str] = mapped_column(String(10), default="A4")


def render(job: RenderInvoice, session: Session) -> None:
    """Transactional handler: marks the invoice in the same transaction as the job."""
    invoice = session.get(Invoice, job.invoice_id)
    assert invoice is not None
    invoice.pdf_ready = True


def main(url: str) -> None:
    engine = create_engine(url)
    Base.metadata.create_all(engine)
    try:
        Sessions = sessionmaker(engine, class_=QueueSession)
        with Sessions() as session:
            for customer, cents in [("ada", 1200), ("bob", 4500), ("cy", 990)]:
                invoice = Invoice(customer=customer, amount_cents=cents)
                session.add(invoice)
                session.flush()
                session.enqueue(RenderInvoice(invoice_id=invoice.id), queue="pdf", priority=cents // 1000)
            session.commit()  # invoices, jobs and the worker wake-up: all or nothing

        dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
        print("-- the claim a worker runs:")
        print(q.claim(RenderInvoice, owner="worker-1", limit=10, queues=["pdf"]).compile(dialect=dialect))
        print("-- its fenced completion:")
        print(q.complete_if_owner(RenderInvoice, owner="worker-1", tokens=[(1, 1)]).compile(dialect=dialect))

        # One at a time, so the finishing order shows the claim order.
        worker = Worker(engine, RenderInvoice, render, queues=("pdf",), concurrency=1, poll_interval=0.2)
        worker.run(install_signal_handlers=False, until_idle=True)

        with engine.connect() as conn:
            ready = conn.scalar(select(func.count()).where(Invoice.pdf_ready))
            order = conn.scalars(select(RenderInvoice.invoice_id).order_by(RenderInvoice.finished_at)).all()
        print(f"-- {ready} invoices rendered, highest priority first: invoice ids {list(order)}")
        print(f"-- worker stats: {worker.stats}")
    finally:
        Base.metadata.drop_all(engine)
        engine.dispose()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if os.environ.get("DATABASE_URL"):
        main(psycopg_url(os.environ["DATABASE_URL"]).render_as_string(hide_password=False))
    else:
        from sqla_queue.embedded import EmbeddedPostgres

        with EmbeddedPostgres() as pg:
            main(pg.url.render_as_string(hide_password=False))
