"""A TCP fault proxy for the tests: sits between an agent and the auditor on loopback.

    with FaultProxy(("127.0.0.1", daemon_port)) as proxy:
        agent = attach(..., address=proxy.address)
        proxy.delay_s = 0.02            # added to every chunk, each way
        proxy.rate_bps = 100_000        # throttle, each way
        proxy.corrupt_p = 0.05          # flip one byte in 5% of the chunks (client -> server)
        proxy.reset_all()               # RST every open connection now
        proxy.pause(); proxy.resume()   # stop forwarding (a hung peer), then carry on

Every knob can be changed while traffic flows; counters (`stats`) say what the proxy did, so a
test can check that its fault was really injected. Threads only, no asyncio: each connection has
one pump thread per direction, and every blocking call has a short timeout so `close()` is prompt.
"""

from __future__ import annotations

import random
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

UP, DOWN = "up", "down"
"""UP: client (agent) -> server (auditor); DOWN: server -> client."""
_CHUNK = 16 << 10
_POLL_S = 0.05


@dataclass
class ProxyStats:
    """What the proxy did; read with the proxy's lock or after traffic stopped."""

    connections: int = 0
    attempts: list = field(default_factory=list)
    """Monotonic time of every connection the proxy accepted (refused ones included)."""
    resets: int = 0
    corrupted_chunks: int = 0
    broken_frames: int = 0
    bytes: dict = field(default_factory=lambda: {UP: 0, DOWN: 0})


def _rst(sock: socket.socket) -> None:
    """Close so that the peer sees a connection reset (RST), not an orderly FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class _FrameCursor:
    """Where the client->server byte stream is in HTTP/2 framing (preface, then frames)."""

    PREFACE = 24
    HEADER = 9

    def __init__(self) -> None:
        self.preface_left = self.PREFACE
        self.header = bytearray()
        self.header_at: list[int] = []  # positions of the header bytes in the current chunk
        self.payload_left = 0

    def walk(self, data: bytearray, on_header: Callable[[bytearray, list[int]], None]) -> None:
        """Advance over `data`; call on_header(data, positions) for each complete frame header
        whose 9 bytes all lie in this chunk (so they can be rewritten in place)."""
        i, n = 0, len(data)
        while i < n:
            if self.preface_left:
                step = min(self.preface_left, n - i)
                self.preface_left -= step
                i += step
            elif self.payload_left:
                step = min(self.payload_left, n - i)
                self.payload_left -= step
                i += step
            else:
                self.header.append(data[i])
                self.header_at.append(i)
                i += 1
                if len(self.header) == self.HEADER:
                    length = int.from_bytes(self.header[:3], "big")
                    if self.header_at[0] >= 0:
                        on_header(data, list(self.header_at))
                    self.payload_left = length
                    self.header.clear()
                    self.header_at.clear()
        # header bytes of a frame split across chunks cannot be rewritten any more
        self.header_at = [-1] * len(self.header_at)


class _Conn:
    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client, self.server = client, server
        self.closed = threading.Event()
        self.forwarded = {UP: 0, DOWN: 0}
        self.frames = _FrameCursor()

    def close(self, reset: bool = False) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for s in (self.client, self.server):
            if reset:
                _rst(s)
            else:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()


class FaultProxy:
    """Forwards 127.0.0.1:<port> to `target`, injecting the faults its attributes ask for."""

    def __init__(self, target: tuple[str, int], *, seed: int = 0) -> None:
        self.target = target
        self.delay_s = 0.0
        """Seconds added before forwarding each chunk (both directions)."""
        self.rate_bps = 0.0
        """Bytes per second per direction and connection; 0 = unlimited."""
        self.corrupt_p = 0.0
        """Probability that a forwarded chunk has one byte flipped."""
        self.corrupt_directions: tuple[str, ...] = (UP,)
        self.corrupt_after = 0
        """Bytes of each connection (per direction) left intact first: 0 corrupts the preface
        too."""
        self.rewrite: Callable[[str, bytes], bytes] | None = None
        """A deterministic mutation hook (direction, chunk) -> chunk."""
        self.break_frames_p = 0.0
        """Probability that an HTTP/2 DATA frame from the client gets an impossible length
        (FRAME_SIZE_ERROR at the server): a corruption that framing is sure to catch."""
        self.refuse = False
        """Accept new connections but reset them at once (an auditor that is down)."""
        self.stats = ProxyStats()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._running = threading.Event()  # set = forwarding; cleared = paused
        self._running.set()
        self._stop = threading.Event()
        self._conns: list[_Conn] = []
        self._threads: list[threading.Thread] = []
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self._spawn(self._accept_loop, "proxy-accept")

    # -- controls ---------------------------------------------------------------------------------

    def pause(self) -> None:
        """Stop forwarding in both directions; connections stay open (a hung peer)."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def reset_all(self) -> int:
        """Reset every open connection; returns how many were reset."""
        with self._lock:
            conns, self._conns = self._conns, []
        n = 0
        for c in conns:
            if not c.closed.is_set():
                c.close(reset=True)
                n += 1
        with self._lock:
            self.stats.resets += n
        return n

    def open_connections(self) -> int:
        with self._lock:
            return sum(1 for c in self._conns if not c.closed.is_set())

    def close(self) -> None:
        self._stop.set()
        self._running.set()
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            c.close()
        for t in self._threads:
            t.join(2.0)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------------

    def _spawn(self, fn, name: str, *args) -> None:
        t = threading.Thread(target=fn, args=args, name=name, daemon=True)
        t.start()
        self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self._listener], [], [], _POLL_S)
                if not ready:
                    continue
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.stats.attempts.append(time.monotonic())
            if self.refuse:
                _rst(client)
                continue
            try:
                server = socket.create_connection(self.target, timeout=2.0)
            except OSError:
                _rst(client)  # the auditor is down: the agent sees a reset, as without a proxy
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.settimeout(_POLL_S)
            conn = _Conn(client, server)
            with self._lock:
                self._conns.append(conn)
                self.stats.connections += 1
            self._spawn(self._pump, "proxy-up", conn, client, server, UP)
            self._spawn(self._pump, "proxy-down", conn, server, client, DOWN)

    def _pump(self, conn: _Conn, src: socket.socket, dst: socket.socket, direction: str) -> None:
        try:
            while not (conn.closed.is_set() or self._stop.is_set()):
                if not self._running.wait(_POLL_S):
                    continue  # paused: read nothing, so the sender's buffers fill up
                try:
                    data = src.recv(_CHUNK)
                except TimeoutError:
                    continue
                if not data:
                    break
                if self.delay_s:
                    time.sleep(self.delay_s)
                data = self._mutate(conn, direction, data)
                self._send(conn, dst, data)
                conn.forwarded[direction] += len(data)
                with self._lock:
                    self.stats.bytes[direction] += len(data)
                if self.rate_bps:
                    time.sleep(len(data) / self.rate_bps)
        except OSError:
            pass
        finally:
            conn.close()

    def _send(self, conn: _Conn, dst: socket.socket, data: bytes) -> None:
        view = memoryview(data)
        while view and not conn.closed.is_set():
            if not self._running.is_set():
                self._running.wait(_POLL_S)
                continue
            try:
                n = dst.send(view)
            except TimeoutError:
                continue
            view = view[n:]

    def _mutate(self, conn: _Conn, direction: str, data: bytes) -> bytes:
        if self.rewrite is not None:
            data = self.rewrite(direction, data)
        if direction == UP:
            buf = bytearray(data)

            def on_header(chunk: bytearray, at: list[int]) -> None:
                if chunk[at[3]] != 0 or not self.break_frames_p:  # type 0: DATA
                    return
                with self._lock:
                    hit = self._rng.random() < self.break_frames_p
                    if hit:
                        self.stats.broken_frames += 1
                if hit:
                    chunk[at[0]] = 0xFF  # length >= 16 MiB: over any SETTINGS_MAX_FRAME_SIZE

            conn.frames.walk(buf, on_header)
            data = bytes(buf)
        if (self.corrupt_p and direction in self.corrupt_directions
                and conn.forwarded[direction] + len(data) > self.corrupt_after):
            with self._lock:
                hit = self._rng.random() < self.corrupt_p
                if hit:
                    lo = max(0, self.corrupt_after - conn.forwarded[direction])
                    pos = self._rng.randrange(lo, len(data))
                    flip = self._rng.randrange(1, 256)
                    self.stats.corrupted_chunks += 1
            if hit:
                b = bytearray(data)
                b[pos] ^= flip
                data = bytes(b)
        return data
