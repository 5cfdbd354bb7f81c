"""A daemon at its stream cap answers RESOURCE_EXHAUSTED "busy": agents wait, they never drop.

RESOURCE_EXHAUSTED also means "this batch is too large" (final for that batch), so the daemon
marks capacity refusals with `wire.limits.BUSY_PREFIX` and the agent's delivery treats those as
"try again later". Real daemon, real agents, real SQLite.
"""

from __future__ import annotations

import time

import pytest
import torch

import numaudit
from numaudit.auditor.daemon.admission import ServerLimits
from numaudit.auditor.daemon.server import BackgroundServer
from numaudit.auditor.store import Reader

pytestmark = pytest.mark.timeout(90)


def _send(agent, model, steps=2):
    for step in range(steps):
        with agent.step(step):
            with agent.microbatch(0):
                loss = model(torch.ones(2, 4)).sum()
                agent.capture(loss, site="loss", phase="loss")
                loss.backward()


def test_an_agent_refused_for_capacity_waits_and_delivers_everything(tmp_path):
    limits = ServerLimits(max_ingest_streams=1)
    with BackgroundServer("127.0.0.1:0", tmp_path / "audit.db", grace=1.0,
                          server_limits=limits) as server:
        model = torch.nn.Linear(4, 2)
        first = numaudit.attach(model, run="first", address=server.address)
        _send(first, model)
        first.capturer.flush()
        deadline = time.monotonic() + 30
        while first.summary()["acked"] < first.summary()["captured"]:  # its stream is open
            assert time.monotonic() < deadline
            time.sleep(0.05)
        second = numaudit.attach(model, run="second", address=server.address, flush_timeout_s=20)
        _send(second, model)
        second.capturer.flush()
        time.sleep(1.0)  # the second agent is refused for capacity meanwhile
        a = first.close()   # frees the only stream: the second agent gets in
        b = second.close()
        assert a["dropped"] == 0 and b["dropped"] == 0, (a, b)
        assert b["acked"] == b["captured"] > 0
        assert b["reconnects"] > 0  # it was refused (busy) and came back
        reader = Reader(server.db_path)
        try:
            assert len(list(reader.records("second"))) == b["captured"]
        finally:
            reader.close()
