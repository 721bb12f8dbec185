"""A TCP proxy in front of PostgreSQL, for tests of network faults the server cannot fake.

Every connection through :class:`Proxy` gets two pump threads that forward bytes as they
come. A test can then

- **freeze** connections (:meth:`Proxy.freeze`): nothing is forwarded any more, but both
  sockets stay open, as behind a proxy, PgBouncer or NAT box that still acknowledges
  packets: TCP keepalive never fires, and a call waits for its answer forever;
- **lose an answer** (:meth:`Proxy.lose_answer`): the next statement whose text holds a
  marker reaches the server, which runs (and commits) it; the proxy keeps the server's
  answer back until it is complete (``ReadyForQuery``), then closes the connection
  without passing any of it on;
- **cut before a statement** (:meth:`Proxy.cut_before`): the next statement whose text
  holds a marker never reaches the server; the proxy closes the connection instead, as
  when the server dies just before it (the server ends that session, and rolls back the
  transaction it was in).

Connections are tagged with the markers their client sent (:attr:`Link.tags`), so a test
can pick, say, the executors' connections (those that sent a claim). The client must not
use TLS (``sslmode=disable``), and must send statement text every time
(``prepare_threshold=None``) for markers to be seen.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from typing import Any

from sqlalchemy import URL, Engine

from .helpers import Server
from .workers import engine_with

#: Text of every claim statement of the worker (the sweeper and heartbeat do not order).
CLAIM_MARKER = b"ORDER BY tasks.priority DESC"


class Trap:
    """One armed :meth:`Proxy.lose_answer`; ``fired`` is set once it dropped a connection."""

    def __init__(self, marker: bytes, with_rows: bool) -> None:
        self.marker = marker
        self.with_rows = with_rows
        self.fired = threading.Event()


class Link:
    """One client connection through the proxy and its connection to the server."""

    def __init__(self, proxy: Proxy, client: socket.socket, server: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.server = server
        #: Names of the markers this connection's client has sent.
        self.tags: set[str] = set()
        self._flowing = threading.Event()
        self._flowing.set()
        self._trap: Trap | None = None
        self.closed = False
        #: Set by thaw(): the connection flowed again after a freeze.
        self.thawed = False
        self._threads = [
            threading.Thread(target=self._upstream, name="test-proxy-up", daemon=True),
            threading.Thread(target=self._downstream, name="test-proxy-down", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @property
    def frozen(self) -> bool:
        return not self._flowing.is_set()

    def freeze(self) -> None:
        self._flowing.clear()

    def thaw(self) -> None:
        self.thawed = True
        self._flowing.set()

    def close(self) -> None:
        self.closed = True
        self._flowing.set()
        for sock in (self.client, self.server):
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with suppress(OSError):
                sock.close()

    def join(self, timeout: float) -> None:
        for thread in self._threads:
            thread.join(timeout)

    def _forward(self, sock: socket.socket, data: bytes) -> bool:
        self._flowing.wait()
        if self.closed:
            return False
        try:
            sock.sendall(data)
        except OSError:
            return False
        return True

    def _upstream(self) -> None:
        """Client to server: tag the connection, arm a trap, forward."""
        tail = b""
        try:
            while not self.closed:
                try:
                    data = self.client.recv(65536)
                except OSError:
                    break
                if not data:
                    break
                seen = tail + data
                for name, marker in self.proxy.markers.items():
                    if marker in seen:
                        self.tags.add(name)
                cut = self.proxy._take_cut(seen, len(tail))
                if cut is not None:
                    cut.fired.set()
                    break  # not forwarded: the connection closes instead
                if self._trap is None:
                    self._trap = self.proxy._take_trap(seen)
                tail = seen[-256:]
                if not self._forward(self.server, data):
                    break
        finally:
            self.close()

    def _downstream(self) -> None:
        """Server to client: forward, or hold back the answer a trap waits for."""
        held = b""
        try:
            while not self.closed:
                try:
                    data = self.server.recv(65536)
                except OSError:
                    break
                if not data:
                    break
                trap = self._trap
                if trap is None:
                    if not self._forward(self.client, data):
                        break
                    continue
                held += data
                end, rows = _answer_end(held)
                if end is None:
                    continue
                if rows or not trap.with_rows:
                    trap.fired.set()
                    break  # the server finished (and committed); the client hears nothing
                self._trap = None  # an answer without rows: pass it on, wait for the next
                self.proxy._rearm(trap)
                answer, held = held[:end], held[end:]
                if not self._forward(self.client, answer + held):
                    break
                held = b""
        finally:
            self.close()


def _answer_end(data: bytes) -> tuple[int | None, bool]:
    """Where the first ``ReadyForQuery`` message in ``data`` ends (None: not there yet),
    and whether a ``DataRow`` came before it."""
    at, rows = 0, False
    while at + 5 <= len(data):
        kind = data[at:at + 1]
        (length,) = struct.unpack("!i", data[at + 1:at + 5])
        end = at + 1 + length
        if end > len(data):
            return None, rows
        if kind == b"D":
            rows = True
        if kind == b"Z":
            return end, rows
        at = end
    return None, rows


class Proxy:
    """Listens on 127.0.0.1 and forwards each connection to ``upstream`` (``(host,
    port)``, or the path of a Unix socket)."""

    def __init__(self, upstream: tuple[str, int] | str, markers: Mapping[str, bytes] | None = None) -> None:
        self.upstream = upstream
        self.markers = dict(markers or {"claim": CLAIM_MARKER})
        self.links: list[Link] = []
        self._traps: list[Trap] = []
        self._cuts: list[Trap] = []
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port: int = self._listener.getsockname()[1]
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept, name="test-proxy-accept", daemon=True)
        self._acceptor.start()

    def _connect_upstream(self) -> socket.socket:
        if isinstance(self.upstream, str):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(self.upstream)
            return sock
        return socket.create_connection(self.upstream)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = self._connect_upstream()
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._closed:
                    client.close()
                    server.close()
                    return
                self.links.append(Link(self, client, server))

    # -- faults ------------------------------------------------------------------------

    def freeze(self, which: Callable[[Link], bool]) -> list[Link]:
        """Freeze the open connections ``which`` picks; connections made later flow."""
        with self._lock:
            chosen = [link for link in self.links if not link.closed and which(link)]
        for link in chosen:
            link.freeze()
        return chosen

    def thaw(self) -> None:
        with self._lock:
            links = list(self.links)
        for link in links:
            link.thaw()

    def lose_answer(self, marker: bytes, *, with_rows: bool = True) -> Trap:
        """Lose the answer to the next statement holding ``marker`` (with ``with_rows``:
        the next one whose answer has rows; answers without are passed on)."""
        trap = Trap(marker, with_rows)
        with self._lock:
            self._traps.append(trap)
        return trap

    def cut_before(self, marker: bytes) -> Trap:
        """Close the connection that sends the next statement holding ``marker``, without
        forwarding it."""
        trap = Trap(marker, with_rows=False)
        with self._lock:
            self._cuts.append(trap)
        return trap

    def _take_cut(self, sent: bytes, old: int) -> Trap | None:
        """The cut armed for a marker that ends in ``sent``'s new bytes (past the first
        ``old``, which were forwarded already)."""
        if not self._cuts:
            return None
        with self._lock:
            for trap in self._cuts:
                if trap.marker in sent[max(0, old - len(trap.marker) + 1):]:
                    self._cuts.remove(trap)
                    return trap
        return None

    def _take_trap(self, sent: bytes) -> Trap | None:
        with self._lock:
            for trap in self._traps:
                if trap.marker in sent:
                    self._traps.remove(trap)
                    return trap
        return None

    def _rearm(self, trap: Trap) -> None:
        with self._lock:
            self._traps.insert(0, trap)

    # -- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links = list(self.links)
        with suppress(OSError):
            self._listener.close()
        for link in links:
            link.close()
        self._acceptor.join(5)
        for link in links:
            link.join(5)

    def url_for(self, url: URL) -> URL:
        """``url`` through this proxy."""
        return url.difference_update_query(["host"]).set(host="127.0.0.1", port=self.port)


def upstream_of(url: URL) -> tuple[str, int] | str:
    """Where the server of ``url`` listens: a TCP address or a Unix socket's path."""
    socket_dir = url.query.get("host")
    if isinstance(socket_dir, str) and socket_dir.startswith("/"):
        return f"{socket_dir}/.s.PGSQL.{url.port or 5432}"
    if url.host and url.host.startswith("/"):
        return f"{url.host}/.s.PGSQL.{url.port or 5432}"
    return (url.host or "127.0.0.1", url.port or 5432)


@contextmanager
def proxied(
    server: Server, app_name: str, markers: Mapping[str, bytes] | None = None
) -> Iterator[tuple[Proxy, Engine]]:
    """A proxy to the test server (tagging connections by ``markers``, default: the
    claim's) and an engine whose every connection goes through it (tagged
    ``app_name``); both closed after."""
    proxy = Proxy(upstream_of(server.url), markers)
    connect_args: dict[str, Any] = {
        "application_name": app_name, "sslmode": "disable", "gssencmode": "disable", "prepare_threshold": None,
    }
    engine = engine_with(proxy.url_for(server.url), **connect_args)
    try:
        yield proxy, engine
    finally:
        proxy.thaw()
        engine.dispose()
        proxy.close()
