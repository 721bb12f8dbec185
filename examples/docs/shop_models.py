"""The models the documentation's snippets share: a business table and two queue tables."""

from __future__ import annotations

# --8<-- [start:models]
from sqlalchemy import ForeignKey
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqla_queue import JobMixin, TaskMixin


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str]


class EmailJob(Base, JobMixin):  # typed columns: one table per kind of work
    __tablename__ = "email_jobs"
    __table_args__ = ({"comment": "your own table args are kept"},)
    order_id: Mapped[int] = mapped_column(ForeignKey("orders.id"))
    recipient: Mapped[str]


class Task(Base, TaskMixin):  # or one generic table: task name + JSONB payload
    __tablename__ = "tasks"
# --8<-- [end:models]


class Charge(Base):
    """What a transactional handler writes, in the worker guide."""

    __tablename__ = "charges"
    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[int] = mapped_column(ForeignKey("orders.id"))
