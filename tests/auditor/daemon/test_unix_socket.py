"""The daemon on a unix socket (`listen="unix:/PATH"`): who may connect is decided by the file's
permissions, not by who can reach a TCP port. `auditor checkpoint` runs its in-process daemon so,
in a directory only its user can enter, so no other local user can add records to the runs it
is about to compare."""

from __future__ import annotations

import stat
from pathlib import Path

import torch

import numaudit
from numaudit.auditor.cli.checkpoint import _private_listen
from numaudit.auditor.daemon.server import BackgroundServer
from numaudit.auditor.store import Reader


def test_agents_deliver_through_a_unix_socket(tmp_path):
    sock = tmp_path / "auditor.sock"
    with BackgroundServer(f"unix:{sock}", tmp_path / "u.db", grace=1.0) as server:
        assert server.address == f"unix:{sock}"
        assert stat.S_ISSOCK(sock.stat().st_mode)
        agent = numaudit.attach(None, run="over-unix", address=server.address, spool_mode="off")
        agent.capture_state_dict({"w": torch.arange(6.0), "lr": 0.1}, step=0)
        summary = agent.close(timeout=30)
    assert (summary["acked"], summary["dropped"]) == (2, 0), summary
    reader = Reader(tmp_path / "u.db")
    try:
        assert "over-unix" in reader.run_names()
    finally:
        reader.close()


def test_the_checkpoint_daemon_listens_only_inside_its_private_directory(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    listen = _private_listen(private)
    assert listen == f"unix:{private / 'auditor.sock'}"
    # a directory too deep for a socket's 108-byte path: loopback TCP, never another address
    deep = tmp_path / ("d" * 100)
    assert _private_listen(Path(deep)) == "127.0.0.1:0"
