"""Which host names the stand-alone dashboard trusts: pure logic, no database."""

from __future__ import annotations

import pytest

pytest.importorskip("flask")

from sqla_queue.dashboard import LOOPBACK_HOSTS, _host_trusted, served_hosts


def test_a_loopback_bind_trusts_the_loopback_names() -> None:
    assert served_hosts("127.0.0.1") == LOOPBACK_HOSTS
    assert served_hosts("localhost") == LOOPBACK_HOSTS
    assert served_hosts("::1") == LOOPBACK_HOSTS
    assert served_hosts("127.0.0.2") == (*LOOPBACK_HOSTS, "127.0.0.2")


def test_another_address_trusts_itself_and_a_wildcard_needs_names() -> None:
    assert served_hosts("10.0.0.5") == ("10.0.0.5",)
    assert served_hosts("Queue.Internal") == ("queue.internal",)
    for wildcard in ("0.0.0.0", "::", ""):
        with pytest.raises(ValueError, match="name the hosts it is reached by"):
            served_hosts(wildcard)
    assert served_hosts("0.0.0.0", ["Queue.Internal:8787", ".Example.com", "[::1]"]) == (
        "queue.internal", ".example.com", "::1"
    )
    with pytest.raises(ValueError, match="at least one name"):
        served_hosts("0.0.0.0", [])


@pytest.mark.parametrize(
    ("host", "trusted"),
    [
        ("localhost", True), ("LocalHost:8787", True), ("127.0.0.1:1", True), ("[::1]:8787", True),
        ("attacker.example", False), ("localhost.attacker.example", False), ("127.0.0.1.nip.io", False),
        ("localhost:99999", False), ("user@localhost", False), ("", False), ("[::2]", False),
    ],
)
def test_host_header_matching(host: str, trusted: bool) -> None:
    assert _host_trusted(host, served_hosts("127.0.0.1")) is trusted


def test_a_leading_dot_takes_subdomains_only_of_that_name() -> None:
    names = served_hosts("0.0.0.0", [".example.com"])
    assert _host_trusted("example.com", names) and _host_trusted("a.b.example.com:443", names)
    assert not _host_trusted("badexample.com", names) and not _host_trusted("example.com.evil", names)
