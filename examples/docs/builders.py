"""The statement builders' snippet: a claim and its fenced completion, run in your own
transactions, and printed."""

from __future__ import annotations

from sqlalchemy import create_engine
from sqlalchemy.orm import sessionmaker

from sqla_queue import QueueSession

from _db import database_url
from shop_models import Base, EmailJob, Order


def main(url: str) -> None:
    engine = create_engine(url)
    Base.metadata.create_all(engine)
    try:
        with sessionmaker(engine, class_=QueueSession)() as session:
            order = Order(customer="ada")
            session.add(order)
            session.flush()
            session.enqueue(EmailJob(order_id=order.id, recipient="ada@example.com"), queue="emails")
            session.commit()

        # --8<-- [start:claim]
        from sqlalchemy.dialects import postgresql

        from sqla_queue import ClaimToken
        from sqla_queue import sql as q

        with engine.begin() as conn:
            jobs = conn.execute(q.claim(EmailJob, owner="worker-1", limit=10, queues=["emails"])).all()
        with engine.begin() as conn:
            done = conn.scalars(q.complete_if_owner(
                EmailJob, owner="worker-1", tokens=[ClaimToken(j.id, j.attempts) for j in jobs])).all()

        stmt = q.claim(EmailJob, owner="worker-1", limit=10, queues=["emails"])
        print(stmt.compile(dialect=postgresql.dialect()))  # type: ignore[no-untyped-call]
        # --8<-- [end:claim]
        print(f"claimed {[j.id for j in jobs]}, completed {list(done)}")
        assert [j.id for j in jobs] == list(done) == [1]
    finally:
        Base.metadata.drop_all(engine)
        engine.dispose()


if __name__ == "__main__":
    with database_url() as url:
        main(url)
