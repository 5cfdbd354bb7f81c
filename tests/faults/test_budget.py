"""Past the memory budget: records are dropped and counted, and the counts reach the auditor.

The link to the auditor turns into a black hole (the proxy stops forwarding) while training goes
on, so batches pile up unacked until `max_unacked_bytes` is reached; past it the agent drops new
records (reason `buffer_full`) instead of waiting or growing. Guarantees checked: training is not
slowed, sent = stored + reported dropped exactly, and `auditor show` reports the same drops.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.faults.harness import ROOT, Auditor, StoreView, Writer, figure, wait_until
from tests.faults.proxy import FaultProxy


@pytest.mark.timeout(90)
def test_memory_budget_drops_are_counted_and_reported(tmp_path):
    auditor = Auditor(tmp_path)
    writer = None
    try:
        auditor.start()
        with FaultProxy(("127.0.0.1", auditor.port)) as proxy:
            writer = Writer(tmp_path, records=100_000, address=proxy.address, inprocess=True,
                            extra=["--rate", "1000", "--max-unacked-bytes", str(64 << 10),
                                   "--until-file", str(tmp_path / "stop"),
                                   "--flush-timeout", "15"])
            wait_until(lambda: writer.acks(), 60, "first acks")
            proxy.pause()
            at = writer.progress()
            wait_until(lambda: writer.progress() >= at + 1200, 30, "captures past the budget")
            proxy.resume()
            (tmp_path / "stop").touch()
            rep = writer.finish(60)
        assert auditor.stop() == 0
    finally:
        if writer:
            writer.kill()
        auditor.close()
    s = rep["summary"]
    dropped = s["dropped_by_reason"].get("buffer_full", 0)
    view = StoreView.read(auditor.db)
    shown = json.loads(subprocess.run(
        [sys.executable, "-m", "numaudit.auditor", "show", "faults", "--db", str(auditor.db),
         "--format", "json"], cwd=ROOT, capture_output=True, text=True, check=True,
        timeout=60).stdout)
    (rank,) = shown["ranks"]
    figure("budget.captured", s["captured"])
    figure("budget.dropped_buffer_full", dropped)
    figure("budget.stored", view.count)
    figure("budget.max_step_s", round(rep["max_step_s"], 3))
    assert dropped > 0 and s["dropped_by_reason"] == {"buffer_full": dropped}, s
    assert rep["max_step_s"] < 1.0
    view.check_clean(writer.manifest())
    assert view.count + dropped == s["captured"] == rep["records"]
    assert (rank["stored"], rank["sent"], rank["dropped"]) == (view.count, s["captured"], dropped)
    assert rank["dropped_by_reason"] == {"buffer_full": dropped}
    assert shown["dropped"] == dropped
