"""Direct and sidecar mode tell the same story: what the auditor stored, rejected or refused.

Each case runs once with the rank talking to the auditor itself and once through a node sidecar;
the agent's summary and the session row the daemon stores (what `auditor show` prints) must
agree, and must say what really happened upstream.
"""

from __future__ import annotations

import pytest
import torch

import numaudit
from numaudit.agents.sidecar import Sidecar
from numaudit.auditor.daemon.server import BackgroundServer
from numaudit.auditor.daemon.tokens import Tokens
from numaudit.auditor.store import Reader, UnknownRun

pytestmark = pytest.mark.timeout(120)

TOKENS = {"writer": "w" * 24, "other-run": "o" * 24, "read-only": "r" * 24}
N, PER_BATCH = 40, 10


@pytest.fixture(scope="module")
def auditor(tmp_path_factory):
    d = tmp_path_factory.mktemp("auditor")
    tokens = Tokens.parse({"token": [
        {"name": "writer", "token": TOKENS["writer"], "write": ["*"], "read": ["*"]},
        {"name": "other-run", "token": TOKENS["other-run"], "write": ["somebody-else"]},
        {"name": "read-only", "token": TOKENS["read-only"], "read": ["*"]},
    ]}, "tokens")
    with BackgroundServer("127.0.0.1:0", d / "audit.db", grace=1.0, tokens=tokens) as server:
        yield server


def _run(case: str, mode: str, auditor, tmp_path) -> tuple[dict, dict | None]:
    run = f"{case}-{mode}"
    token = TOKENS["other-run" if case == "other_run" else
                   "read-only" if case == "read_only" else "writer"]
    opts = dict(run=run, batch_records=PER_BATCH, flush_timeout_s=20,
                spool_dir=str(tmp_path / "agent-spool"))
    sidecar = None
    if mode == "sidecar":
        sock = f"unix://{tmp_path}/s.sock"
        sidecar = Sidecar(sock, tmp_path / "relay", auditor=auditor.address, token=token)
        sidecar.start()
        opts["sidecar"] = sock
    else:
        opts.update(address=auditor.address, token=token)
    try:
        agent = numaudit.attach(None, **opts)
        with agent.step(0):
            for mb in range(N // PER_BATCH):
                with agent.microbatch(mb):
                    for i in range(PER_BATCH):
                        # the auditor refuses a site of more than 512 characters: the whole
                        # batch of microbatch 2 is rejected, the others are stored
                        site = "x" * 600 if case == "rejected" and mb == 2 else f"t{i}"
                        agent.capture(torch.full((4,), float(i)), site=site, phase="input")
        summary = agent.close()
    finally:
        if sidecar is not None:
            sidecar.stop(grace=10)
    reader = Reader(auditor.db_path)
    try:
        (row,) = reader.sessions(run)
        stored = {k: row[k] for k in ("records_sent", "records_dropped", "dropped_by_reason",
                                      "records_stored")}
        stored["closed"] = bool(row["closed"])
    except UnknownRun:
        stored = None
    finally:
        reader.close()
    return summary, stored


def _counts(s: dict) -> dict:
    return {k: s[k] for k in ("captured", "acked", "spooled", "dropped", "dropped_by_reason")}


@pytest.mark.parametrize("case", ["ok", "rejected", "other_run", "read_only"])
def test_direct_and_sidecar_report_the_same_outcome(case, auditor, tmp_path):
    direct, direct_row = _run(case, "direct", auditor, tmp_path / "d")
    relayed, relayed_row = _run(case, "sidecar", auditor, tmp_path / "s")
    if case == "ok":
        assert _counts(direct) == _counts(relayed) == {
            "captured": N, "acked": N, "spooled": 0, "dropped": 0, "dropped_by_reason": {}}
        assert direct_row == relayed_row == {"records_sent": N, "records_dropped": 0,
                                             "dropped_by_reason": {}, "records_stored": N,
                                             "closed": True}
    elif case == "rejected":
        assert _counts(direct) == _counts(relayed) == {
            "captured": N, "acked": N - PER_BATCH, "spooled": 0, "dropped": PER_BATCH,
            "dropped_by_reason": {"rejected": PER_BATCH}}
        assert direct_row == relayed_row == {
            "records_sent": N, "records_dropped": PER_BATCH,
            "dropped_by_reason": {"rejected": PER_BATCH}, "records_stored": N - PER_BATCH,
            "closed": True}
    else:  # the auditor refused the session (a token that may not write this run)
        assert _counts(direct) == _counts(relayed) == {
            "captured": N, "acked": 0, "spooled": 0, "dropped": N,
            "dropped_by_reason": {"refused": N}}
        assert direct_row is None and relayed_row is None  # nothing registered, nothing stored
