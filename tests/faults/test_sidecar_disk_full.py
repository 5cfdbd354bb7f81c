"""A node sidecar whose spool filesystem refuses writes mid-frame acks nothing it did not write.

The sidecar runs as its own process with RLIMIT_FSIZE lowered (prlimit(2)) so a batch is cut in
two by the write; it answers UNAVAILABLE, truncates the torn frame, and the rank resends. Once
the limit is lifted every batch is acked, and the spool reads back whole.
"""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import numaudit
from numaudit.agents.delivery.transport import wait_for_socket
from numaudit.auditor.daemon.replay import replay_into_db
from numaudit.wire.spool import read_spool

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
BATCHES, PER_BATCH = 8, 10


def _wait(predicate, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_full_spool_acks_nothing_it_did_not_write(tmp_path):
    sock = f"unix://{tmp_path}/s.sock"
    spool = tmp_path / "relay"
    with open(tmp_path / "sidecar.log", "ab") as log:  # the sidecar writes its own copy of it
        proc = subprocess.Popen([sys.executable, "-m", "numaudit.agents.sidecar", "--listen", sock,
                                 "--spool", str(spool)], cwd=ROOT, stdout=log, stderr=log)
    try:
        assert wait_for_socket(sock, 60)
        # room for the registration and about three batches of ~21 KB
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (70000, resource.RLIM_INFINITY))
        agent = numaudit.attach(None, run="full", sidecar=sock, batch_records=PER_BATCH,
                              flush_timeout_s=30, spool_dir=str(tmp_path / "agent-spool"))
        for mb in range(BATCHES):
            with agent.step(0), agent.microbatch(mb):
                for i in range(PER_BATCH):
                    agent.capture(torch.randn(64), site=f"t{i}", phase="input")
        assert _wait(lambda: agent._sender.reconnects >= 2)  # refused at least twice
        refused_at = agent._sender.delivery.acked_records
        assert refused_at < BATCHES * PER_BATCH
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE,
                         (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        s = agent.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert (s["acked"], s["held_by_sidecar"], s["dropped"]) == (0, BATCHES * PER_BATCH, 0), s
    (path,) = spool.glob("*.spool")
    c = read_spool(path)
    assert c.clean, c.problems
    assert [b.seq for b in c.batches] == list(range(1, BATCHES + 1))
    (result,) = replay_into_db([path], tmp_path / "late.db")
    assert (result.stored, result.rejected) == (BATCHES * PER_BATCH, [])
    print(f"acked by the sidecar before the limit was lifted: {refused_at} records")
