"""Testing code that enqueues jobs, and the handlers that run them, with pytest.

Run it with pytest (``DATABASE_URL=postgresql://… python -m pytest examples/docs/testing_jobs.py``),
or as a script, which runs pytest on itself.
The queue table is real (created in the test database, dropped afterwards); the helpers of
``sqla_queue.testing`` look at what was enqueued and run a worker until nothing is left.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, String, create_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from sqla_queue import JobMixin, QueueSession
from sqla_queue.testing import assert_enqueued, assert_not_enqueued, run_until_idle


class Base(DeclarativeBase):
    pass


class WelcomeEmail(Base, JobMixin):
    __tablename__ = "example_welcome_emails"

    recipient: Mapped[str] = mapped_column(String(200))


# -- the application code under test --------------------------------------------------

sent: list[str] = []


def sign_up(session: QueueSession, email: str) -> None:
    if not email.endswith("@example.invalid"):
        session.enqueue(WelcomeEmail(recipient=email), queue="mail")


def send_welcome(job: WelcomeEmail) -> None:
    sent.append(job.recipient)


# -- the tests ----------------------------------------------------------------------------


@pytest.fixture
def engine() -> Iterator[Engine]:
    engine = create_engine(os.environ["DATABASE_URL"].replace("postgresql://", "postgresql+psycopg://", 1))
    Base.metadata.create_all(engine)
    yield engine
    Base.metadata.drop_all(engine)
    engine.dispose()


def test_sign_up_enqueues_a_welcome_email(engine: Engine) -> None:
    with sessionmaker(engine, class_=QueueSession)() as session:
        sign_up(session, "ada@example.com")
        sign_up(session, "bot@example.invalid")
        # Seen before the commit: the lookup flushes the session, as any query does.
        assert_enqueued(session, WelcomeEmail, recipient="ada@example.com", queue="mail")
        assert_not_enqueued(session, WelcomeEmail, recipient="bot@example.invalid")


def test_the_worker_sends_it(engine: Engine) -> None:
    with sessionmaker(engine, class_=QueueSession)() as session:
        sign_up(session, "ada@example.com")
        session.commit()  # a worker sees committed jobs only
    stats = run_until_idle(engine, WelcomeEmail, send_welcome)
    assert stats.done == 1
    assert sent == ["ada@example.com"]
    assert_not_enqueued(engine, WelcomeEmail)  # nothing left pending


if __name__ == "__main__":
    # -o addopts=: in one process, whatever the pytest settings of the folder around it say
    # (this repository's run its own suite in four); these tests share one database.
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", "-o", "addopts="]))
