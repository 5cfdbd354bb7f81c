"""A rank that ends without `close()` keeps its records; a missing auditor is reported, not silent.

Real processes (tests/faults/exit_job.py), a real daemon on loopback or an address nobody serves.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from numaudit.agents.shutdown import WATCHER_GRACE_S
from numaudit.auditor.daemon.server import BackgroundServer
from numaudit.auditor.store import Reader
from numaudit.wire.batches import batch_record_count
from numaudit.wire.spool import read_spool
from tests.faults.exit_job import UNSENT
from tests.faults.harness import figure, free_port

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
N = 30
FLUSH = 1.0


def _job(how: str, address: str, spool: Path) -> subprocess.Popen:
    # PYTHONFAULTHANDLER: a job that hangs is sent SIGABRT, which prints its threads' stacks.
    env = dict(os.environ, PYTHONPATH=str(ROOT), NUMAUDIT_ADDR=address, NUMAUDIT_RUN="exit",
               NUMAUDIT_SPOOL=str(spool), NUMAUDIT_FLUSH_TIMEOUT=str(FLUSH),
               PYTHONFAULTHANDLER="1")
    return subprocess.Popen([sys.executable, "-m", "tests.faults.exit_job", "--how", how,
                             "--records", str(N)], cwd=ROOT, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


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
SIGTERM_CASES = ("sigterm-blocked-midstep", "sigterm-user", "sigterm-user-blocked",
                 "sigterm-user-after-blocked", "fork")


@pytest.fixture(scope="module")
def jobs_without_an_auditor(tmp_path_factory):
    """One job per way of ending, all started at once: each spends most of its time importing
    torch and then waiting out its flush timeout, so side by side they cost about one."""
    jobs = {}
    for how in NO_AUDITOR + SIGTERM_CASES:
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


def _spilled(err: str, address: str, spool: Path, reason: str) -> str:
    """Check what every case without an auditor must show; returns the summary line."""
    warnings = [ln for ln in err.splitlines() if "cannot reach" in ln]
    assert len(warnings) == 1, err  # one line per rank, at the default log level
    assert address in warnings[0] and str(spool) in warnings[0]
    line = _summary_line(err)
    assert f"at {reason}" in line and "acked by the auditor 0" in line, line
    assert f"spooled {N} in {spool}" in line, line
    (path,) = spool.glob("*.spool")
    c = read_spool(path)
    assert sum(batch_record_count(b) for b in c.batches) == N and c.clean and c.close is not None
    return line


@pytest.mark.parametrize("how", NO_AUDITOR)
def test_without_an_auditor_the_queue_is_spilled_and_one_warning_says_so(
        how, jobs_without_an_auditor):
    proc, address, spool = jobs_without_an_auditor[how]
    assert proc.stdout.readline().strip() == "ready"
    if how == "sigterm":
        proc.send_signal(signal.SIGTERM)
    out, err = _finish(proc)
    assert proc.returncode == (-signal.SIGTERM if how == "sigterm" else 0), err
    line = _spilled(err, address, spool, "SIGTERM" if how == "sigterm" else "interpreter exit")
    close_s = float(re.search(r"closed in ([0-9.]+)s", line).group(1))
    figure(f"exit_{how}.close_s", close_s)
    assert close_s <= FLUSH + 1.0 + 0.5, line  # the documented bound (+ scheduling slack)


WATCHER = "SIGTERM came while the main thread was blocked"


def test_sigterm_while_the_main_thread_is_blocked_still_spills_and_ends_the_rank(
        jobs_without_an_auditor):
    """The main thread never returns to Python (a rank in a collective, mid-step): Python's
    handler cannot run, so the watcher thread closes the agent and the rank dies of SIGTERM
    within the grace, the close deadline and its second. It leaves the training thread's
    capturer alone: what it held is counted (unsent_at_close), so captured = spooled + dropped
    still holds exactly. (Before the watcher: the rank slept on, its queue unsent.)"""
    proc, address, spool = jobs_without_an_auditor["sigterm-blocked-midstep"]
    assert proc.stdout.readline().strip() == "ready"
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = _finish(proc)
    ended_s = time.monotonic() - sent
    assert proc.returncode == -signal.SIGTERM, err
    assert sum(WATCHER in ln for ln in err.splitlines()) == 1, err
    line = _spilled(err, address, spool, "SIGTERM")
    assert f"captured {N + UNSENT}:" in line, line
    assert f"dropped {UNSENT} (unsent_at_close {UNSENT})" in line, line
    figure("exit_sigterm_blocked.end_s", ended_s)
    assert ended_s <= WATCHER_GRACE_S + FLUSH + 1.0 + 3.0, err  # + slack for a busy machine


@pytest.mark.parametrize("how", ("sigterm-user", "sigterm-user-blocked"))
def test_a_scripts_own_sigterm_handler_still_runs_after_the_agent_is_closed(
        how, jobs_without_an_auditor):
    """A handler the script installed before attach (a checkpoint on preemption) is called
    after the agent is closed and decides how the process ends; with the main thread blocked,
    the watcher closes the agent but leaves the ending to that handler."""
    proc, address, spool = jobs_without_an_auditor[how]
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    out, err = _finish(proc)
    assert proc.returncode == 3 and out.strip() == "user handler ran", (out, err)
    assert sum(WATCHER in ln for ln in err.splitlines()) == (how.endswith("blocked")), err
    _spilled(err, address, spool, "SIGTERM")


def test_a_handler_installed_after_attach_decides_alone(jobs_without_an_auditor):
    """The script replaced the agent's SIGTERM handler after attach: the watcher must not end
    the process (nor close the agent) behind that handler's back, even with the main thread
    blocked past the grace. The script's handler exits, and the agent is closed at exit."""
    proc, address, spool = jobs_without_an_auditor["sigterm-user-after-blocked"]
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    time.sleep(WATCHER_GRACE_S + 1.0)  # the main thread stays blocked past the grace
    proc.stdin.write("go\n")
    proc.stdin.flush()
    out, err = _finish(proc)
    assert proc.returncode == 3 and out.strip() == "user handler ran", (out, err)
    assert not any(WATCHER in ln for ln in err.splitlines()), err
    _spilled(err, address, spool, "interpreter exit")


def test_a_forked_worker_killed_by_sigterm_leaves_the_parents_agent_alone(
        jobs_without_an_auditor):
    """A DataLoader-style forked child shares the watcher's pipe and the agent's memory: its
    SIGTERM must neither close the parent's agent (through the pipe) nor report it."""
    proc, address, spool = jobs_without_an_auditor["fork"]
    out, err = _finish(proc)
    assert proc.returncode == 0, err
    assert out.strip() == f"child {-signal.SIGTERM} parent_open True", (out, err)
    assert not any(WATCHER in ln for ln in err.splitlines()), err
    _spilled(err, address, spool, "interpreter exit")  # one summary: the parent's, at its exit
