"""The application's models: a business table and a queue table of its own."""

from __future__ import annotations

from sqlalchemy import ForeignKey, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqla_queue import JobMixin


class Base(DeclarativeBase):
    pass


class Customer(Base):
    __tablename__ = "customers"

    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(String(200))


class WelcomeEmail(Base, JobMixin):
    __tablename__ = "welcome_emails"

    customer_id: Mapped[int] = mapped_column(ForeignKey(Customer.id))
