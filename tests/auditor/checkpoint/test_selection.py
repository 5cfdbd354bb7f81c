"""`KeySelection.parse_steps` and `auditor compare --steps`: a comparison of some steps only,
saying so in the report's warnings."""

from __future__ import annotations

import pytest
import torch

import numaudit
from numaudit.auditor.compare.read.selection import KeySelection
from numaudit.auditor.daemon.server import BackgroundServer
from tests.auditor.checkpoint.helpers import cli

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("text,first,stop", [("3:", 3, None), ("3:5", 3, 5), (":5", None, 5),
                                             ("3", 3, 4), (" 3 : 5 ", 3, 5)])
def test_parse_steps_accepts(text, first, stop):
    sel = KeySelection.parse_steps(text)
    assert (sel.first, sel.stop, sel.phases) == (first, stop, frozenset())


@pytest.mark.parametrize("text", [
    "5:3", "3:3", "a:", ":b", "1.5:", "3:5:7",
    "", ":",
])
def test_parse_steps_refuses_naming_steps(text):
    with pytest.raises(ValueError, match=r"^steps: "):
        KeySelection.parse_steps(text)


def test_compare_from_a_step_leaves_the_earlier_difference_out(tmp_path):
    """ref and cand capture a state dict at steps 1 and 2, different only at step 1."""
    db = tmp_path / "audit.db"
    w = torch.arange(12.).reshape(3, 4)
    with BackgroundServer("127.0.0.1:0", db, grace=1.0) as server:
        for run in ("ref", "cand"):
            agent = numaudit.attach(None, run=run, address=server.address, spool_mode="off")
            for step in (1, 2):
                bumped = run == "cand" and step == 1
                agent.capture_state_dict({"model": {"w": w + 1 if bumped else w},
                                          "lr": 0.1 * step}, step=step)
            summary = agent.close(timeout=30)
            assert summary["acked"] == summary["captured"] == 4, summary
    res = cli("compare", "ref", "cand", "--db", db, "--format", "json")
    report = res.report()
    assert res.code == 1
    assert report["first_divergence"]["key"]["step"] == 1
    assert report["summary"]["keys"] == 4
    res = cli("compare", "ref", "cand", "--db", db, "--steps", "2:", "--format", "json")
    report = res.report()
    assert res.code == 0, report["summary"]
    assert report["summary"]["keys"] == report["summary"]["verdicts"]["identical"] == 2
    assert {f["key"]["step"] for f in report["findings"]} == {2}
    assert any("from step 2" in w for w in report["warnings"]), report["warnings"]
    res = cli("compare", "ref", "cand", "--db", db, "--steps", "5:3")
    assert res.code == 2 and "auditor: error: steps: " in res.stderr, res.stderr
