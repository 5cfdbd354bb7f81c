"""The metrics endpoint's HTTP server: one thread, bounded connections, a cached page.

prometheus_client's own server starts a thread per connection and never times one out: 1,500
idle connections held 1,499 threads, and 275 scrapes a second, each rendering the registry
under the GIL, cut the daemon's acks by 40 %. This one is a single thread running a selector:

- a connection must send its request within `REQUEST_TIMEOUT_S` and take its answer within the
  same time again, else it is closed; at most `MAX_CONNECTIONS` are open (the oldest is closed
  for a new one), so idle or slow clients cost a socket each and never a thread;
- rendering the page takes at most `RENDER_SHARE` of the time (after a render that took t
  seconds, scrapes for the next t / RENDER_SHARE seconds get the same bytes: ~20 ms for this
  registry), so the cost to the daemon's GIL is bounded whatever the scrape rate;
- only ``GET /metrics`` (and ``/``) is answered; anything else is 404 or 400.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 5.0
"""Time a connection has to send its request, and again to read the answer."""
MAX_CONNECTIONS = 256
"""Connections open at once; a new one closes the oldest past this."""
MAX_REQUEST_BYTES = 8192
RENDER_SHARE = 0.05
"""Most of the time spent rendering the page: a render that took t seconds is served again
for t / RENDER_SHARE seconds."""


class _Conn:
    __slots__ = ("sock", "inbox", "outbox", "deadline")

    def __init__(self, sock: socket.socket, now: float) -> None:
        self.sock, self.inbox, self.outbox = sock, b"", b""
        self.deadline = now + REQUEST_TIMEOUT_S


class MetricsServer:
    """Serves `render()` (bytes, content type) as ``/metrics`` on (host, port) from one thread."""

    def __init__(self, host: str, port: int, render: Callable[[], tuple[bytes, str]]) -> None:
        self._render = render
        self._page: tuple[bytes, str] | None = None
        self._fresh_until = 0.0
        self.renders = 0
        """Times the page was rendered (a test counts them)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self.server_address = self._listener.getsockname()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._conns: dict[socket.socket, _Conn] = {}
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._run, name="numaudit-metrics-http",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(10)
        for sock in list(self._conns):
            self._drop(sock)
        self._selector.close()
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()

    # -- the loop ---------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            soonest = min((c.deadline for c in self._conns.values()), default=now + 1.0)
            for key, events in self._selector.select(max(0.0, min(1.0, soonest - now))):
                try:
                    if key.data == "wake":
                        self._wake_r.recv(64)
                    elif key.data is None:
                        self._accept()
                    elif events & selectors.EVENT_READ:
                        self._read(key.fileobj)  # type: ignore[arg-type]
                    else:
                        self._write(key.fileobj)  # type: ignore[arg-type]
                except Exception:  # one connection's trouble never stops the endpoint
                    log.debug("metrics connection failed", exc_info=True)
                    if key.data not in (None, "wake"):
                        self._drop(key.fileobj)  # type: ignore[arg-type]
            now = time.monotonic()
            for sock in [s for s, c in self._conns.items() if c.deadline <= now]:
                self._drop(sock)

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            sock.setblocking(False)
            if len(self._conns) >= MAX_CONNECTIONS:
                self._drop(next(iter(self._conns)))  # the oldest
            self._conns[sock] = _Conn(sock, time.monotonic())
            self._selector.register(sock, selectors.EVENT_READ, "conn")

    def _read(self, sock: socket.socket) -> None:
        conn = self._conns[sock]
        data = sock.recv(4096)
        if not data:
            self._drop(sock)
            return
        conn.inbox += data
        if b"\r\n\r\n" not in conn.inbox and b"\n\n" not in conn.inbox:
            if len(conn.inbox) > MAX_REQUEST_BYTES:
                self._answer(conn, 400, b"request too large\n", "text/plain")
            return
        line = conn.inbox.split(b"\n", 1)[0].split()
        if len(line) < 2 or line[0] != b"GET":
            self._answer(conn, 400, b"GET /metrics only\n", "text/plain")
        elif line[1].split(b"?", 1)[0] not in (b"/metrics", b"/"):
            self._answer(conn, 404, b"not found: GET /metrics\n", "text/plain")
        else:
            body, content_type = self._page_now()
            self._answer(conn, 200, body, content_type)

    def _page_now(self) -> tuple[bytes, str]:
        now = time.monotonic()
        if self._page is None or now >= self._fresh_until:
            self._page = self._render()
            took = time.monotonic() - now
            self._fresh_until = now + took / RENDER_SHARE
            self.renders += 1
        return self._page

    def _answer(self, conn: _Conn, status: int, body: bytes, content_type: str) -> None:
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}[status]
        conn.outbox = (f"HTTP/1.0 {status} {reason}\r\nContent-Type: {content_type}\r\n"
                       f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                       ).encode() + body
        conn.inbox = b""
        conn.deadline = time.monotonic() + REQUEST_TIMEOUT_S
        self._selector.modify(conn.sock, selectors.EVENT_WRITE, "conn")
        self._write(conn.sock)

    def _write(self, sock: socket.socket) -> None:
        conn = self._conns.get(sock)
        if conn is None:
            return
        try:
            sent = sock.send(conn.outbox)
        except (BlockingIOError, InterruptedError):
            return
        conn.outbox = conn.outbox[sent:]
        if not conn.outbox:
            self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        self._conns.pop(sock, None)
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()
