"""Ranks whose pieces of one key hold different row counts, captured without declaring them
ragged (auditor.compare.merge.uneven): the tokens each dp rank routed to an expert. The auditor
places each rank's rows after those of the ranks before it, moving each piece's fingerprint with it
(fingerprint version 3), so equal bits are identical with or without payloads; a difference is
measured from payloads, and without the bytes it never passes.

Real tensors digested by the agent's code with the agent's own batch layout
(`agents.layout.batch_layout`, what an ordinary module hook records), stored through the ingest
path (tests/auditor/synth)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from numaudit.agents.layout import batch_layout
from numaudit.auditor.compare.engine import compare_runs
from numaudit.auditor.compare.measure.findings import measure_text
from numaudit.auditor.compare.policy.load import preset_policy
from numaudit.auditor.report.json_report import to_json
from tests.auditor.synth import RunBuilder, write_runs

SITE = "layers.0.moe.experts.3"
# rows the expert got from each dp rank's share of the batch: rank 1 routed none to it
COUNTS = (5, 0, 2)


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randn(sum(COUNTS), 6, generator=torch.Generator().manual_seed(seed))


def _runs(db: Path, *, payload: bool = True, cand_rows: torch.Tensor | None = None,
          skip_empty: bool = False, builders=None) -> Path:
    """A single process holding the expert's 7 rows, and 3 dp ranks holding 5, 0 and 2 of them
    under the even-split layout the agent assumes (rows x 3, offset rows x dp rank)."""
    whole = _tokens()
    ref = RunBuilder("ref")
    key = dict(step=0, microbatch=0, phase="fwd", site=SITE, payload=payload)
    ref.add_full(whole, **key)
    cand = RunBuilder("dp", world_size=len(COUNTS))
    rows = whole if cand_rows is None else cand_rows
    start = 0
    for rank, n in enumerate(COUNTS):
        part = rows[start:start + n]
        start += n
        if n == 0 and skip_empty:
            continue  # the expert did not run on this rank
        cand.add(rank, part, batch_layout(tuple(part.shape), rank, len(COUNTS)), **key)
    if builders is not None:
        builders(ref, cand)
    return write_runs(db, ref, cand)


def _report(db: Path) -> dict:
    import json
    return json.loads(to_json(compare_runs(db, "ref", "dp", preset_policy("fp32"))))


@pytest.mark.parametrize("skip_empty", [False, True])
@pytest.mark.parametrize("payload", [True, False])
def test_uneven_rows_are_identical_by_their_moved_fingerprints(tmp_path, skip_empty, payload):
    report = _report(_runs(tmp_path / "a.db", skip_empty=skip_empty, payload=payload))
    (f,) = report["findings"]
    assert f["verdict"] == "identical" and not f["breach"], f
    assert f["shape"] == [7, 6]
    warning = " ".join(report["warnings"])
    assert f"dp: 1 key at {SITE} holds different row counts on their dp ranks" in warning
    assert "their fingerprints moved with them" in warning
    # what to rerun with for keys whose bits differ: one glob for every layer and expert
    assert "run both with NUMAUDIT_PAYLOAD=fwd:layers.*.moe.experts.* " in warning


def test_a_store_before_fingerprint_version_3_keeps_payload_comparison(tmp_path):
    """Version-2 fingerprints cannot move: the key is compared from its payloads, as before,
    and the warning says why."""
    db = tmp_path / "v2.db"
    _runs(db, payload=True, builders=lambda ref, cand: _as_version_2(ref, cand))
    report = _report(db)
    (f,) = report["findings"]
    assert f["verdict"] == "identical", f
    assert f["metrics"]["payload"]["max_abs"] == 0.0
    assert "could not all move with them" in " ".join(report["warnings"])


def _as_version_2(*runs: RunBuilder) -> None:
    from numaudit.agents.digest.hashing import FINGERPRINT_SEED_V2

    for run in runs:
        for recs in run.records.values():
            for rec in recs:
                rec.digest.fingerprint_seed = FINGERPRINT_SEED_V2


def test_one_changed_row_is_a_divergence_localized_to_its_rank(tmp_path):
    rows = _tokens().clone()
    rows[6, 2] += 1e-3  # the last row: rank 2's second
    report = _report(_runs(tmp_path / "b.db", cand_rows=rows))
    first = report["first_divergence"]
    assert first["verdict"] == "diverged" and first["breach"], first
    assert first["metrics"]["payload"]["worst"]["index"] == [6, 2]
    pieces = first["pieces"]
    assert pieces["differ_count"] == 1 and pieces["differ"][0]["ranks"] == [2], pieces
    assert pieces["differ"][0]["box"].startswith("[5:7,"), pieces


def test_rows_in_another_order_are_not_the_same_tensor(tmp_path):
    """The same rows dealt in another rank order concatenate to another tensor: a breach."""
    whole = _tokens()
    report = _report(_runs(tmp_path / "c.db", cand_rows=torch.cat([whole[5:], whole[:5]])))
    assert report["summary"]["breaches"] == 1, report["summary"]


@pytest.mark.parametrize("change", ["value", "order"])
def test_without_payloads_a_difference_never_passes(tmp_path, change):
    """Without the bytes, a moved fingerprint says the rows differ but nothing measures by how
    much (the sketches describe the even split): a breach, flagged uncertain, never a pass."""
    whole = _tokens()
    if change == "value":
        rows = whole.clone()
        rows[6, 2] += 1e-6
    else:
        rows = torch.cat([whole[5:], whole[:5]])
    report = _report(_runs(tmp_path / "d.db", payload=False, cand_rows=rows))
    (f,) = report["findings"]
    assert f["breach"] and f["uncertain"], f
    assert f["verdict"] != "identical"
    # the moments' bound is said as a bound (rows in another order have equal moments: >= 0)
    text = measure_text(f)
    assert text.startswith("rel_l2 >= ") and "a lower bound: nothing measures it" in text, text


def test_without_payloads_version_2_rows_never_pass(tmp_path):
    """Fingerprints made for the even split that cannot move: moments alone cannot vouch."""
    db = tmp_path / "e.db"
    _runs(db, payload=False, builders=lambda ref, cand: _as_version_2(ref, cand))
    (f,) = _report(db)["findings"]
    assert f["breach"] and f["uncertain"], f
    assert f["verdict"] != "identical"
