"""The training process SIGKILLed with records in its spool (spool_mode="always"), then replayed.

Guarantee checked: every batch the process wrote to its spool is stored exactly once after
`auditor ingest` (replay), whether or not it had also been delivered live; a torn last frame costs
only that frame; nothing else is stored.
"""

from __future__ import annotations

import signal
import time

import pytest

from numaudit.auditor.daemon.replay import replay
from numaudit.wire.batches import batch_columns, batch_record_count
from numaudit.wire.record_form import to_records
from numaudit.wire.spool import read_spool
from tests.faults.harness import Auditor, StoreView, Writer, figure, wait_until


@pytest.mark.timeout(90)
def test_killed_training_process_spool_replayed_once(tmp_path):
    auditor = Auditor(tmp_path)
    writer = None
    try:
        auditor.start()
        writer = Writer(tmp_path, records=6000, address=auditor.address,
                        extra=["--rate", "400", "--spool-mode", "always"])
        wait_until(lambda: writer.acks() and writer.progress() >= 600, 60, "a stream under way")
        # The auditor falls behind (hung), so the spool holds batches it never got...
        auditor.signal(signal.SIGSTOP)
        at = writer.progress()
        wait_until(lambda: writer.progress() >= at + 400, 30, "captures while the auditor hangs")
        writer.kill()  # ...then SIGKILL: no close, no spill, no session close
        auditor.signal(signal.SIGCONT)
        time.sleep(0.5)
        live = StoreView.read(auditor.db)
        (spool,) = writer.spool_files()
        contents = read_spool(spool)
        results = replay([spool], auditor.address)
        assert auditor.stop() == 0
    finally:
        if writer:
            writer.kill()
        auditor.close()
    spooled = {(r.key.step, r.key.microbatch, r.key.phase, r.key.site, r.key.role, r.key.index,
                r.key.call, 0) for b in contents.batches for r in to_records(batch_columns(b))}
    n_spooled = sum(batch_record_count(b) for b in contents.batches)
    (result,) = results
    view = StoreView.read(auditor.db)
    figure("training_killed.captured_before_kill", writer.progress())
    figure("training_killed.spooled", n_spooled)
    figure("training_killed.stored_live", live.count)
    figure("training_killed.replay", dict(stored=result.stored, duplicates=result.duplicates,
                                          skipped_frames=result.skipped_frames))
    assert contents.close is None  # it really died before closing
    assert result.rejected == [] and result.error is None
    assert n_spooled == len(spooled) > 0
    view.check_clean(writer.manifest())
    # Exactly the spooled records are stored: the live ones were written ahead, so they are
    # in the spool too, and replaying them stored nothing twice.
    assert set(live.rows) <= spooled
    assert set(view.rows) == spooled
    # (the auditor may still have committed some buffered batches after the snapshot)
    assert 0 < result.stored <= len(spooled) - live.count
    assert result.stored + result.duplicates == n_spooled
    assert writer.acked_keys() <= set(live.rows)
