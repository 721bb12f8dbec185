"""The listener against the in-memory operations: what a NOTIFY tells, and what a
connection made anew must look for, since the NOTIFYs sent meanwhile are gone."""

from __future__ import annotations

from typing import Any

from sqla_queue.runtime import ThreadRuntime
from sqla_queue.worker.config import WorkerConfig
from sqla_queue.worker.context import WorkerContext
from sqla_queue.worker.hooks import Hooks
from sqla_queue.worker.ledger import Held, Ledger
from sqla_queue.worker.listener import Listener
from sqla_queue.worker.stats import WorkerStats
from sqla_queue.worker.work_signal import WorkSignal

from ..fakes import FakeConn, FakeDriver, FakeOps

OWNER = "w/0.1"


class ListeningDriver(FakeDriver):
    """Connections that LISTEN, and the payloads each ``notifies`` call returns, in turn."""

    runtime = ThreadRuntime()

    def __init__(self, *payloads: list[str]) -> None:
        self.payloads = list(payloads)
        self.made: list[FakeConn] = []

    def connect(self, purpose: str, *, listen: str | None = None) -> FakeConn:
        conn = FakeConn()
        self.made.append(conn)
        return conn

    def notifies(self, conn: Any, timeout: float) -> list[str]:
        return self.payloads.pop(0) if self.payloads else []

    def listen(self, conn: Any, channel: str) -> None:
        pass


def _running(ops: FakeOps, ledger: Ledger) -> Held:
    (job_id,) = ops.add(1)
    (claimed,) = ops.fetch_claimed(None, ops.claim_request(OWNER, 1))
    held = Held(claimed.token, job=claimed.job, owner=OWNER)
    ledger.add([held])
    ledger.start(held)
    assert held.started and ops.jobs[job_id].status == "running"
    return held


def _listener(ops: FakeOps, ledger: Ledger, driver: ListeningDriver) -> Listener:
    stats = WorkerStats()
    ctx = WorkerContext(WorkerConfig(reconnect_backoff=0.01), ledger, driver, ops, WorkSignal(1), stats,  # type: ignore[arg-type]
                        "w", Hooks(stats))
    return Listener(ctx)


def test_a_cancel_notify_tells_the_running_attempt_once_its_row_says_so() -> None:
    ops, ledger = FakeOps(), Ledger()
    held = _running(ops, ledger)
    driver = ListeningDriver([], [f"sqla_queue.cancel:{held.token.job_id}"])
    listener = _listener(ops, ledger, driver)
    listener.tick()  # connected: nothing cancelled yet
    assert held.stopped is None
    ops.jobs[held.token.job_id].status = "cancelled"  # the cancel commits, its NOTIFY follows
    listener.tick()
    assert held.stopped == "cancelled"


def test_a_cancel_committed_while_the_listener_was_not_connected_is_heard_on_connecting() -> None:
    """Its NOTIFY went to no one: the listener's first connection, and every new one
    after a drop, reads the rows of the jobs it runs."""
    ops, ledger = FakeOps(), Ledger()
    held = _running(ops, ledger)
    ops.jobs[held.token.job_id].status = "cancelled"  # before the listener listens
    driver = ListeningDriver()
    listener = _listener(ops, ledger, driver)
    listener.tick()
    assert held.stopped == "cancelled"
    assert ops.calls.count("token_states") == 1


def test_a_connection_that_stays_reads_no_rows_without_a_cancel() -> None:
    ops, ledger = FakeOps(), Ledger()
    _running(ops, ledger)
    listener = _listener(ops, ledger, ListeningDriver([], [], ["jobs"]))
    for _ in range(3):
        listener.tick()
    assert ops.calls.count("token_states") == 1  # the one read of the first connection
