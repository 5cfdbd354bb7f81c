"""`auditor --version`, the environment variables in the help, and `auditor watch --wait`
against a real daemon whose runs register after the watch started."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner

from numaudit.auditor.cli import main
from numaudit.protos import numaudit_pb2_grpc
from numaudit.wire import limits
from numaudit.wire.version import package_version
from tests.auditor.synth import mlp_run, send

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(60)
SOURCE_PACKAGES = ("agents", "auditor", "wire", "examples", "bench")


def auditor(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "numaudit.auditor", *map(str, args)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_version_names_the_package_and_the_wire_schema():
    res = CliRunner().invoke(main, ["--version"])
    assert res.exit_code == 0
    assert res.output == (f"auditor (numaudit) {package_version()}; wire schema numaudit.v1 "
                          f"(schema_version {limits.CURRENT_SCHEMA_VERSION}, accepts 1)\n")
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", package_version())


def _names_in_code() -> set[str]:
    names = set()
    for package in SOURCE_PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            names |= set(re.findall(r"\bNUMAUDIT_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    return names


def test_help_names_every_environment_variable_the_code_reads():
    names = _names_in_code()
    assert {"NUMAUDIT_DB", "NUMAUDIT_RUN", "NUMAUDIT_TOKEN", "NUMAUDIT_DEPTH"} <= names
    top = CliRunner().invoke(main, ["--help"])
    assert top.exit_code == 0
    missing = sorted(n for n in names if not re.search(rf"^\s+{n}\s+\S", top.output, re.M))
    assert missing == [], f"not in `auditor --help`: {missing}"
    for command in main.commands:  # every subcommand names the auditor's own variables
        sub = CliRunner().invoke(main, [command, "--help"])
        assert sub.exit_code == 0 and "NUMAUDIT_DB" in sub.output and \
            "NUMAUDIT_TOKEN" in sub.output, command


def _wait_for_line(stream, needle: str, timeout: float = 20.0) -> str:
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        line = stream.readline()
        seen.append(line)
        if needle in line:
            return line
        if not line:
            break
    raise AssertionError(f"{needle!r} not in {seen}")


@pytest.mark.parametrize("via", ["address", "store"])
def test_watch_waits_for_runs_that_register_after_it_started(auditor_server, via):
    source = (["--address", auditor_server.address] if via == "address"
              else ["--db", auditor_server.db_path])
    proc = auditor("watch", "ref", "cand", *source, "--wait", "--wait-timeout", "30",
                   "--poll", "0.1")
    try:
        line = _wait_for_line(proc.stderr, "waiting")
        assert line.strip() == "[watch] waiting up to 30s for ref, cand to register"
        with grpc.insecure_channel(auditor_server.address,
                                   options=limits.client_options()) as channel:
            stub = numaudit_pb2_grpc.AuditorStub(channel)
            send(stub, mlp_run("ref", world=2))
            time.sleep(0.3)  # one run registered: the watch keeps waiting for the other
            assert proc.poll() is None
            send(stub, mlp_run("cand", world=2))
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "[watch] done: both runs finished" in err


def test_watch_wait_gives_up_after_its_timeout_in_one_line(auditor_server):
    proc = auditor("watch", "ref", "cand", "--address", auditor_server.address, "--wait",
                   "--wait-timeout", "0.3", "--poll", "0.05")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert err.splitlines()[-1] == (
        f"auditor: error: run: 'ref', 'cand' not registered in {auditor_server.address} after "
        "0.3s (--wait-timeout)")
    assert len([line for line in err.splitlines() if "error" in line]) == 1
    without = auditor("watch", "ref", "cand", "--address", auditor_server.address)
    _, err = without.communicate(timeout=30)
    assert without.returncode == 2 and len(err.strip().splitlines()) == 1, err
