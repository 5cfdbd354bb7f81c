"""Ranks whose pieces of one key hold different row counts, captured without declaring them
ragged (auditor.compare.uneven): the tokens each dp rank routed to an expert. The auditor places
each rank's rows after those of the ranks before it and compares from payloads; without the
bytes it never passes.

Real tensors digested by the agent's code with the agent's own batch layout
(`agents.layout.batch_layout`, what an ordinary module hook records), stored through the ingest
path (tests/auditor/synth)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agents.layout import batch_layout
from auditor.compare.engine import compare_runs
from auditor.compare.policy import preset_policy
from auditor.report.json_report import to_json
from tests.auditor.synth import RunBuilder, write_runs

SITE = "layers.0.moe.experts.3"
# rows the expert got from each dp rank's share of the batch: rank 1 routed none to it
COUNTS = (5, 0, 2)


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randn(sum(COUNTS), 6, generator=torch.Generator().manual_seed(seed))


def _runs(db: Path, *, payload: bool = True, cand_rows: torch.Tensor | None = None,
          skip_empty: bool = False) -> Path:
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
    return write_runs(db, ref, cand)


def _report(db: Path) -> dict:
    import json
    return json.loads(to_json(compare_runs(db, "ref", "dp", preset_policy("fp32"))))


@pytest.mark.parametrize("skip_empty", [False, True])
def test_uneven_rows_compare_exactly_from_payloads(tmp_path, skip_empty):
    report = _report(_runs(tmp_path / "a.db", skip_empty=skip_empty))
    (f,) = report["findings"]
    assert f["verdict"] == "identical", f
    assert f["shape"] == [7, 6]
    assert f["metrics"]["payload"]["max_abs"] == 0.0
    warning = " ".join(report["warnings"])
    assert f"dp: 1 key at {SITE} holds different row counts on their dp ranks" in warning
    assert "compared from their payloads" in warning


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


def test_without_payloads_uneven_rows_never_pass(tmp_path):
    """The fingerprints were made for the even split: moments alone cannot vouch for the rows."""
    report = _report(_runs(tmp_path / "d.db", payload=False))
    (f,) = report["findings"]
    assert f["breach"] and f["uncertain"], f
    assert f["verdict"] != "identical"
