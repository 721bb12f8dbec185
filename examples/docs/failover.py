"""A queue set up for failover to a standby (docs/operations/failover.md): one engine URL
naming every server, and the idempotency key handed to an external API instead of the
job's id.

    DATABASE_URL=postgresql://user@host/db python examples/docs/failover.py

With one server at hand, it names an address nothing listens on first, as a primary that
went down would be: libpq tries the hosts in order and settles on the one that takes
writes. A job is then charged twice (a second run, as after a failover), and the provider
charges it once, because both runs send the same key.
"""

from __future__ import annotations

from sqlalchemy import String, create_engine, make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from sqla_queue import IdempotencyKeyMixin, JobMixin, QueueSession, Worker

from _db import database_url


class Base(DeclarativeBase):
    pass


# --8<-- [start:model]
class ChargeJob(Base, JobMixin, IdempotencyKeyMixin):
    __tablename__ = "example_charge_jobs"

    customer: Mapped[str] = mapped_column(String(100))
    cents: Mapped[int]
# --8<-- [end:model]


class PaymentProvider:
    """Stands in for a payment API: a request with a key it has seen is not charged again."""

    def __init__(self) -> None:
        self.requests = 0
        self.charges: dict[str, tuple[str, int]] = {}

    def charge(self, customer: str, cents: int, *, idempotency_key: str) -> None:
        self.requests += 1
        self.charges.setdefault(idempotency_key, (customer, cents))


payments = PaymentProvider()


# --8<-- [start:handler]
def charge(job: ChargeJob) -> None:
    payments.charge(job.customer, job.cents, idempotency_key=str(job.idempotency_key))
# --8<-- [end:handler]


def multi_host_url(url: str, down: str = "127.0.0.1:9") -> str:
    """``url``'s server named second, after ``down`` (a port nothing answers on). A
    server on a Unix socket (the embedded one) is used as it is: there is no TCP address
    to put second."""
    single = make_url(url)
    if not single.host:
        return single.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    host = f"{single.host or '127.0.0.1'}:{single.port or 5432}"
    user = single.username or "postgres"
    password = f":{single.password}" if single.password else ""
    return (
        f"postgresql+psycopg://{user}{password}@/{single.database}"
        f"?host={down}&host={host}&target_session_attrs=read-write&connect_timeout=5"
    )


def main(given: str) -> None:
    url = multi_host_url(given)
    # --8<-- [start:engine]
    engine = create_engine(url, pool_pre_ping=True)
    # --8<-- [end:engine]
    Base.metadata.create_all(engine)
    Sessions = sessionmaker(engine, class_=QueueSession)
    try:
        with Sessions() as session:
            job = session.enqueue(ChargeJob(customer="ada", cents=1250))
            session.flush()
            job_id = job.id
            print(f"job {job_id} enqueued with idempotency key {job.idempotency_key}")
            session.commit()
        Worker(engine, ChargeJob, charge, concurrency=1).run(until_idle=True, install_signal_handlers=False)
        with Sessions() as session:
            again = session.get(ChargeJob, job_id)
            assert again is not None
            charge(again)  # a second run of the same job, as after a failover
        print(f"requests to the provider: {payments.requests}, charges made: {len(payments.charges)}")
    finally:
        Base.metadata.drop_all(engine)
        engine.dispose()


if __name__ == "__main__":
    with database_url() as url:
        main(url)
