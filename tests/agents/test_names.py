"""Run names and session ids never lead a spool file out of its directory (wire/names.py)."""

from __future__ import annotations

import os

import pytest
import torch

import numaudit
from numaudit.agents.delivery.transport import SidecarTransport, TransportError
from numaudit.agents.sidecar import Sidecar
from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire.names import BadName, check_run_name, spool_file_name
from numaudit.wire.spool import SpoolWriter, read_spool

pytestmark = pytest.mark.timeout(60)


def _all_files(root) -> set[str]:
    return {os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs}


def _register(run: str, session_id: str) -> pb.RegisterRequest:
    return pb.RegisterRequest(schema_version=1, run=run, session_id=session_id, world_size=1)


def test_a_run_name_with_a_path_is_refused_by_the_sidecar_and_creates_nothing(tmp_path):
    spool = tmp_path / "a" / "b" / "relay"
    sock = f"unix://{tmp_path}/s.sock"
    sidecar = Sidecar(sock, spool)
    sidecar.start()
    before = _all_files(tmp_path)
    try:
        with pytest.raises(TransportError) as err:
            SidecarTransport(sock).register(_register("../../escaped", "s1"), timeout=5)
        assert err.value.code().name == "INVALID_ARGUMENT" and "run" in err.value.details()
    finally:
        sidecar.stop(grace=0)
    assert _all_files(tmp_path) - before - {str(tmp_path / "s.sock")} == set()


def test_a_session_id_with_a_path_stays_inside_the_spool_directory(tmp_path):
    spool = tmp_path / "a" / "b" / "relay"
    sock = f"unix://{tmp_path}/s.sock"
    sidecar = Sidecar(sock, spool)
    sidecar.start()
    sid = "../../../escaped-session"  # printable: the daemon accepts it as a session id
    try:
        t = SidecarTransport(sock)
        t.register(_register("ref", sid), timeout=5)
        t.close()
    finally:
        sidecar.stop(grace=0)
    (path,) = [p for p in _all_files(tmp_path) if p.endswith(".spool")]
    assert os.path.dirname(path) == str(spool)
    assert read_spool(path).register.session_id == sid  # the file still names the session


def test_spool_file_names_are_one_component_or_refused(tmp_path):
    for sid in ("../x", "/etc/passwd", ".hidden", "a/b", "..", "ok-id_1"):
        name = spool_file_name("ref", 0, sid, ".relay", ".spool")
        assert "/" not in name and not name.startswith(".")
    assert spool_file_name("ref", 0, "ok-id_1") == "ref-rank0-ok-id_1"
    assert spool_file_name("ref", 0, "../x") != spool_file_name("ref", 0, "../y")
    for run in ("../../escaped", "a/b", "", "x" * 129, "t\x00"):
        with pytest.raises(BadName):
            check_run_name(run)
        with pytest.raises(BadName):
            SpoolWriter(tmp_path, run, 0, "s1")
    for sid in ("", "x" * 65, "tab\there"):
        with pytest.raises(BadName):
            SpoolWriter(tmp_path, "ref", 0, sid)
    assert not list(tmp_path.iterdir())


def test_attach_refuses_a_run_name_the_auditor_would_refuse(tmp_path):
    with pytest.raises(ValueError, match="run"):
        numaudit.attach(None, run="../../escaped", address="127.0.0.1:1")
    agent = numaudit.attach(None, run="ok.run-1", spool_dir=str(tmp_path))  # no address: spools
    with agent.step(0), agent.microbatch(0):
        agent.capture(torch.ones(2), site="x", phase="input")
    assert agent.close()["spooled"] == 1
