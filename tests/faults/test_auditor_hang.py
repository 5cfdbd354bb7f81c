"""A hung auditor (SIGSTOP): mid-stream and before the agent ever connected.

Guarantees checked: training steps never wait on it; `agent.close()` returns within its flush
timeout + 1 s and the training process exits; what was not acked is spilled, so after SIGCONT and
a replay stored + reported dropped == sent; SIGCONT corrupts nothing (integrity, no duplicates, no
garbage) and the daemon serves again.
"""

from __future__ import annotations

import signal
import time

import pytest

from numaudit.auditor.daemon.replay import replay
from tests.faults.harness import Auditor, StoreView, Writer, figure, wait_until

FLUSH_S = 2.0
SLACK_S = 0.3
"""Scheduling slack on a loaded 2-core machine, on top of the documented flush timeout + 1 s."""


def _resume_and_replay(auditor: Auditor, writer: Writer) -> list:
    auditor.signal(signal.SIGCONT)
    time.sleep(1.0)  # let it work through whatever the kernel buffered while it was stopped
    assert auditor.alive()
    results = replay(writer.spool_files(), auditor.address)  # it serves again
    assert auditor.stop() == 0
    return results


def _check_accounting(auditor: Auditor, writer: Writer, rep: dict, results: list) -> StoreView:
    s = rep["summary"]
    view = StoreView.read(auditor.db)
    view.check_clean(writer.manifest())
    assert all(r.rejected == [] and r.error is None for r in results), results
    assert view.count + s["dropped"] == s["captured"] == rep["records"], (view.count, s)
    assert writer.acked_keys() <= set(view.rows)
    return view


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_sigstop_mid_stream(tmp_path):
    auditor = Auditor(tmp_path)
    writer = None
    try:
        auditor.start()
        writer = Writer(tmp_path, records=100_000, address=auditor.address,
                        extra=["--rate", "400", "--flush-timeout", str(FLUSH_S),
                               "--until-file", str(tmp_path / "stop")])
        wait_until(lambda: writer.acks(), 60, "first acks")
        auditor.signal(signal.SIGSTOP)
        hung_at, progress_at_hang = time.monotonic(), writer.progress()
        wait_until(lambda: writer.progress() >= progress_at_hang + 400, 30,
                   "captures while the auditor hangs")
        (tmp_path / "stop").touch()
        rep = writer.finish(60)
        exited = time.monotonic()
        results = _resume_and_replay(auditor, writer)
    finally:
        if writer:
            writer.kill()
        auditor.close()
    s = rep["summary"]
    figure("sigstop_mid.close_s", round(rep["close_s"], 3))
    figure("sigstop_mid.max_step_s", round(rep["max_step_s"], 3))
    figure("sigstop_mid.hung_for_s", round(exited - hung_at, 2))
    figure("sigstop_mid.spooled_replayed", sum(r.stored for r in results))
    assert rep["records"] - progress_at_hang >= 300, "the hang did not happen mid-stream"
    assert rep["close_s"] <= FLUSH_S + 1.0 + SLACK_S, rep["close_s"]
    assert rep["max_step_s"] < 1.0, rep["max_step_s"]  # no step waited on the hung auditor
    assert s["acked"] < s["captured"] and s["spooled"] > 0, s
    _check_accounting(auditor, writer, rep, results)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_sigstop_before_connecting(tmp_path):
    """Stopped before the agent's first Register: default connect timeout (5 s) > flush (2 s)."""
    auditor = Auditor(tmp_path)
    writer = None
    try:
        auditor.start()
        auditor.signal(signal.SIGSTOP)
        writer = Writer(tmp_path, records=100_000, address=auditor.address,
                        extra=["--rate", "200", "--flush-timeout", str(FLUSH_S),
                               "--until-file", str(tmp_path / "stop")])
        # The first batch starts the first Register (5 s deadline); close() right after it, so
        # that it comes while that call is in flight.
        wait_until(lambda: writer.batches(), 60, "the first batch")
        (tmp_path / "stop").touch()
        rep = writer.finish(60)
        results = _resume_and_replay(auditor, writer)
    finally:
        if writer:
            writer.kill()
        auditor.close()
    s = rep["summary"]
    figure("sigstop_before.close_s", round(rep["close_s"], 3))
    figure("sigstop_before.max_step_s", round(rep["max_step_s"], 3))
    figure("sigstop_before.summary", s)
    assert rep["close_s"] <= FLUSH_S + 1.0 + SLACK_S, rep["close_s"]
    assert rep["max_step_s"] < 1.0, rep["max_step_s"]
    assert s["acked"] == 0
    _check_accounting(auditor, writer, rep, results)
