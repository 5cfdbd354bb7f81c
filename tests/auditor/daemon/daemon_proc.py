"""`auditor serve` as a subprocess on 127.0.0.1:0, for tests that measure the daemon alone
(latency, RSS, logs) without the test's own threads sharing its GIL."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


@contextlib.contextmanager
def daemon(db: Path, *args: str,
           log_level: str = "warning") -> Iterator[tuple[subprocess.Popen, str]]:
    """Yields (process, "127.0.0.1:PORT"); stderr goes to `db`.log (read it after the block)."""
    port_file = db.with_suffix(".port")
    with open(db.with_suffix(".log"), "w") as err:  # the daemon writes its own copy of the fd
        proc = subprocess.Popen(
            [sys.executable, "-m", "numaudit.auditor", "serve", "--listen", "127.0.0.1:0",
             "--db", str(db), "--port-file", str(port_file), "--grace", "1",
             "--log-level", log_level, *args],
            cwd=REPO, stderr=err, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                log = db.with_suffix(".log").read_text()
                raise RuntimeError(f"auditor serve did not start: {log}")
            time.sleep(0.05)
        yield proc, f"127.0.0.1:{port_file.read_text().strip()}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def rss_bytes(pid: int) -> int:
    """Resident set size of one process (not its children)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")
