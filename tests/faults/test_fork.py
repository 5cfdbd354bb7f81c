"""DataLoader workers forked (start method "fork") after the agent's gRPC channel is live.

grpc/grpc#32992: a process holding a gRPC channel that forks can hang or crash its children.
Guarantee checked: no hang (bounded), no crash (exit 0), and every record still delivered once.
"""

from __future__ import annotations

import pytest

from tests.faults.harness import Auditor, StoreView, Writer, figure


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dataloader_fork_workers_after_channel_is_live(tmp_path):
    n = 1000
    auditor = Auditor(tmp_path)
    writer = None
    try:
        auditor.start()
        writer = Writer(tmp_path, records=n, address=auditor.address,
                        extra=["--dataloader-workers", "2", "--wait-first-ack", "30",
                               "--flush-timeout", "10"])
        rep = writer.finish(90)
        assert auditor.stop() == 0
    finally:
        if writer:
            writer.kill()
        auditor.close()
    s = rep["summary"]
    figure("fork.loader_s", round(rep["loader"]["loader_s"], 2))
    figure("fork.acked_before_fork", rep["loader"]["acked_before_fork"])
    figure("fork.worker_forks", rep["loader"]["forks"])
    assert rep["loader"]["acked_before_fork"] > 0, "the channel was not live when workers forked"
    view = StoreView.read(auditor.db)
    view.check_clean(writer.manifest())
    assert s["dropped"] == 0 and s["acked"] == s["captured"] == n, s
    assert set(view.rows) == writer.expected_keys(n)
