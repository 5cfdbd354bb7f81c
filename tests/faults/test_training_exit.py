"""A rank that ends without `close()` keeps its records; a missing auditor is reported, not silent.

Real processes (tests/faults/exit_job.py), a real daemon on loopback or an address nobody serves.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from wire.packed import batch_record_count
from auditor.daemon.server import BackgroundServer
from auditor.store import Reader
from tests.faults.harness import figure, free_port
from wire.spool import read_spool

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
N = 30
FLUSH = 2.0


def _job(how: str, address: str, spool: Path) -> subprocess.Popen:
    # PYTHONFAULTHANDLER: a job that hangs is sent SIGABRT, which prints its threads' stacks.
    env = dict(os.environ, PYTHONPATH=str(ROOT), NUMAUDIT_ADDR=address, NUMAUDIT_RUN="exit",
               NUMAUDIT_SPOOL=str(spool), NUMAUDIT_FLUSH_TIMEOUT=str(FLUSH),
               PYTHONFAULTHANDLER="1")
    return subprocess.Popen([sys.executable, "-m", "tests.faults.exit_job", "--how", how,
                             "--records", str(N)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen, timeout: float = 30.0) -> tuple[str, str]:
    """The job's output once it has ended. One still running after `timeout` (far past the
    documented close bound, FLUSH + 1 s) fails the test with its threads' stacks."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        out, err = proc.communicate(timeout=20)
        pytest.fail(f"the job did not end within {timeout}s; its stderr, stacks last:\n{err}")


def _summary_line(stderr: str) -> str:
    (line,) = [ln for ln in stderr.splitlines() if "numaudit run=exit" in ln]
    return line


def test_an_exception_out_of_step_still_delivers_the_queue(tmp_path):
    with BackgroundServer("127.0.0.1:0", tmp_path / "a.db", grace=1.0) as server:
        proc = _job("raise", server.address, tmp_path / "spool")
        out, err = _finish(proc)
        assert proc.returncode == 1 and "RuntimeError: training failed" in err
        reader = Reader(server.db_path)
        try:
            stored = len(list(reader.records("exit")))
        finally:
            reader.close()
    assert stored == N, err
    line = _summary_line(err)
    assert "at interpreter exit" in line and f"acked by the auditor {N}" in line, line
    assert not list((tmp_path / "spool").glob("*.spool"))


NO_AUDITOR = ("sigterm", "exit")


@pytest.fixture(scope="module")
def jobs_without_an_auditor(tmp_path_factory):
    """One job per way of ending, all started at once: each spends most of its time importing
    torch and then waiting out its flush timeout, so side by side they cost about one."""
    jobs = {}
    for how in NO_AUDITOR:
        spool = tmp_path_factory.mktemp(f"exit_{how}") / "spool"
        address = f"127.0.0.1:{free_port()}"  # nobody listens
        jobs[how] = _job(how, address, spool), address, spool
    try:
        yield jobs
    finally:
        for proc, _, _ in jobs.values():
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


@pytest.mark.parametrize("how", NO_AUDITOR)
def test_without_an_auditor_the_queue_is_spilled_and_one_warning_says_so(
        how, jobs_without_an_auditor):
    proc, address, spool = jobs_without_an_auditor[how]
    assert proc.stdout.readline().strip() == "ready"
    if how == "sigterm":
        proc.send_signal(signal.SIGTERM)
    out, err = _finish(proc)
    assert proc.returncode == (-signal.SIGTERM if how == "sigterm" else 0), err
    warnings = [ln for ln in err.splitlines() if "cannot reach" in ln]
    assert len(warnings) == 1, err  # one line per rank, at the default log level
    assert address in warnings[0] and str(spool) in warnings[0]
    line = _summary_line(err)
    reason = "SIGTERM" if how == "sigterm" else "interpreter exit"
    assert f"at {reason}" in line and "acked by the auditor 0" in line, line
    assert f"spooled {N} in {spool}" in line, line
    close_s = float(re.search(r"closed in ([0-9.]+)s", line).group(1))
    figure(f"exit_{how}.close_s", close_s)
    assert close_s <= FLUSH + 1.0 + 0.5, line  # the documented bound (+ scheduling slack)
    (path,) = spool.glob("*.spool")
    c = read_spool(path)
    assert sum(batch_record_count(b) for b in c.batches) == N and c.clean and c.close is not None
