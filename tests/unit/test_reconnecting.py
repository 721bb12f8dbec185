"""The one reconnecting connection every service holds, against a driver stand-in."""

from __future__ import annotations

from sqla_queue.worker.service import Reconnecting, Service

from ..fakes import FakeConn


class CountingDriver:
    def __init__(self) -> None:
        self.made: list[tuple[str, str | None, FakeConn]] = []

    def connect(self, purpose: str, *, listen: str | None = None) -> FakeConn:
        conn = FakeConn()
        self.made.append((purpose, listen, conn))
        return conn


def test_the_connection_is_made_once_and_again_only_after_it_broke() -> None:
    driver = CountingDriver()
    link = Reconnecting(driver, "sqla_queue test", listen="jobs")  # type: ignore[arg-type]
    link.connect()
    first = driver.made[-1][2]
    assert id(link.connect()) == id(first) and link.connections == 1
    first.broken = True
    link.connect()
    second = driver.made[-1][2]
    assert id(link.conn) == id(second) and second is not first and first.closed and link.connections == 2
    assert [(p, listen) for p, listen, _ in driver.made] == [("sqla_queue test", "jobs")] * 2
    link.reset()
    assert second.closed and link.conn is None
    link.reset()  # nothing to close: no error


def test_a_service_drops_its_connection_after_an_error_and_closes_it_at_the_end() -> None:
    service = Service(1.0)
    driver = CountingDriver()
    service.link = Reconnecting(driver, "sqla_queue test")  # type: ignore[arg-type]
    service.link.connect()
    conn = driver.made[-1][2]
    service.on_error(RuntimeError("the round failed"))
    assert conn.closed and service.link.conn is None
    service.link.connect()
    again = driver.made[-1][2]
    service.close()
    assert again.closed and service.link.connections == 2
