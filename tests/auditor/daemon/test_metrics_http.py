"""The metrics endpoint under load (issue 40, item 11): idle connections cost no thread and are
closed after a timeout, and scraping however often renders the page a bounded share of the
time."""

from __future__ import annotations

import socket
import time
import urllib.request
from pathlib import Path

import pytest

from numaudit.auditor.daemon import metrics_http
from numaudit.auditor.daemon.metrics_http import MetricsServer
from tests.auditor.daemon.daemon_proc import daemon

pytestmark = pytest.mark.timeout(60)


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise RuntimeError("no Threads line")


def _scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        return resp.read().decode()


def test_idle_connections_hold_no_thread(tmp_path):
    """1,500 idle connections held 1,499 more threads of `auditor serve` (one per connection,
    never timed out). Now: the same threads, and a scrape answers meanwhile."""
    db = tmp_path / "m.db"
    with daemon(db, "--metrics-listen", "127.0.0.1:0") as (proc, _):
        address = f"127.0.0.1:{int(db.with_suffix('.port.metrics').read_text())}"
        assert "numaudit_auditor_open_streams" in _scrape(address)
        before = _threads(proc.pid)
        idle = [socket.create_connection(address.split(":"), timeout=5) for _ in range(600)]
        try:
            time.sleep(0.5)
            started = time.monotonic()
            assert "numaudit_auditor_open_streams" in _scrape(address)
            scrape_s = time.monotonic() - started
            during = _threads(proc.pid)
        finally:
            for s in idle:
                s.close()
    assert during <= before, (before, during)
    assert scrape_s < 2.0, scrape_s
    print(f"FIGURE metrics.threads_with_600_idle {during - before:+d}; scrape {scrape_s:.3f} s")


def test_a_connection_that_sends_nothing_is_closed_after_the_timeout(monkeypatch):
    monkeypatch.setattr(metrics_http, "REQUEST_TIMEOUT_S", 0.3)
    server = MetricsServer("127.0.0.1", 0, lambda: (b"x 1\n", "text/plain"))
    try:
        s = socket.create_connection(server.server_address[:2], timeout=5)
        started = time.monotonic()
        assert s.recv(1) == b""  # closed by the server
        assert time.monotonic() - started < 3
    finally:
        server.close()


def test_scraping_faster_renders_no_more_often(monkeypatch):
    """A render that takes 10 ms is served again for 0.2 s: 100 back-to-back scrapes render a
    handful of times, and every one is answered."""

    def render() -> tuple[bytes, str]:
        time.sleep(0.01)
        return b"numaudit_auditor_x 1\n", "text/plain"

    server = MetricsServer("127.0.0.1", 0, render)
    try:
        host, port = server.server_address[:2]
        address = f"{host}:{port}"
        started = time.monotonic()
        for _ in range(100):
            assert _scrape(address) == "numaudit_auditor_x 1\n"
        seconds = time.monotonic() - started
        rendering_s = server.renders * 0.01
        assert rendering_s <= metrics_http.RENDER_SHARE * seconds + 0.02, (server.renders,
                                                                         seconds)
    finally:
        server.close()


def test_only_get_metrics_is_answered():
    server = MetricsServer("127.0.0.1", 0, lambda: (b"x 1\n", "text/plain"))
    try:
        host, port = server.server_address[:2]
        for request, status in ((b"GET /metrics HTTP/1.0\r\n\r\n", b"200"),
                                (b"GET /secret HTTP/1.0\r\n\r\n", b"404"),
                                (b"POST /metrics HTTP/1.0\r\n\r\n", b"400")):
            with socket.create_connection((host, port), timeout=5) as s:
                s.sendall(request)
                reply = b""
                while chunk := s.recv(4096):
                    reply += chunk
            assert reply.split(b" ", 2)[1] == status, reply
    finally:
        server.close()
