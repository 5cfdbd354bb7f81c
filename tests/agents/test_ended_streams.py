"""A stream the daemon ends (idle, or its receive slot or its place under the stream cap wanted)
is not an outage: the daemon says so (`wire.limits.ENDED_PREFIX`), and the agent's delivery
keeps its records, opens a new stream at once and does not report the auditor unreachable.
Before, such an end counted as a failure to reach the auditor: an agent whose first batch was
slow to arrive, ended again and again, logged "cannot reach the auditor" at close."""

from __future__ import annotations

import logging
import time

import pytest

from numaudit.agents.delivery.delivery import Delivery
from numaudit.agents.delivery.transport import GrpcTransport
from numaudit.auditor.daemon.admission import ServerLimits
from numaudit.auditor.daemon.server import BackgroundServer
from tests.auditor.builders import batch, record, register_request

pytestmark = pytest.mark.timeout(60)
IDLE_S = 0.3


def _pump(d: Delivery, until, timeout: float = 10.0) -> float:
    t0 = time.monotonic()
    while not until():
        assert time.monotonic() - t0 < timeout, (d.pending_records, d.fatal, d.reconnects)
        d.service()
        time.sleep(0.005)
    return time.monotonic() - t0


def _offer(d: Delivery, seq: int) -> None:
    b = batch(seq, [record(seq, 0, "l.0")], session_id="s")
    assert d.offer(b, 1, b.ByteSize())


def test_a_stream_the_daemon_ends_is_resumed_at_once_and_not_an_outage(tmp_path, caplog):
    limits = ServerLimits(idle_stream_s=IDLE_S)
    with BackgroundServer("127.0.0.1:0", tmp_path / "a.db", grace=1.0,
                          server_limits=limits) as server:
        transport = GrpcTransport(server.address)
        d = Delivery(transport, lambda: register_request(run="r", session_id="s"),
                     on_drop=lambda reason, n: pytest.fail(f"dropped {n} ({reason})"),
                     name="rank 0", target=server.address)
        _offer(d, 1)
        _pump(d, lambda: d.acked_seq == 1)
        time.sleep(3 * IDLE_S)  # the daemon ends the idle stream meanwhile
        _offer(d, 2)  # a batch is pending when the delivery learns of the end
        with caplog.at_level(logging.WARNING, logger="numaudit.agents.delivery.delivery"):
            d.service()
            assert d.reconnects == 1 and d.pending_records == 1  # ended, the batch kept
            d.warn_if_unreachable(force=True)  # what the sender does at a close right now
            resumed_s = _pump(d, lambda: d.acked_seq == 2)
        d.shutdown()
    assert resumed_s < 1.0, resumed_s
    assert d.pending_records == 0 and d.acked_records == 2
    assert not any("cannot reach" in r.getMessage() for r in caplog.records)
    assert not d.unreachable_warned
