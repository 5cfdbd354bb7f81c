"""What `auditor checkpoint` says beyond the comparison (issue 41): a DCP checkpoint saved as
``dcp.save({"model": sd})`` against a flat safetensors file of ``sd`` is paired by the
``model.`` prefix (applied, and said; suggested as a `--map` when it does not pair every name);
a bitwise breach says how much and where; nothing is said to have been left out "as asked"."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from numaudit.auditor.checkpoint.prefix import prefix_match
from tests.auditor.cli.three_runs import cli

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("prefix")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        dcp.save({"model": sd}, checkpoint_id=str(d / "dcp"))
    save_file(sd, str(d / "flat.safetensors"))
    one_ulp = dict(sd)
    w = sd["0.weight"].clone()
    w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(2.0))
    one_ulp["0.weight"] = w
    save_file(one_ulp, str(d / "ulp.safetensors"))
    save_file({**sd, "extra.weight": torch.ones(2)}, str(d / "extra.safetensors"))
    return d


def test_a_nested_dcp_checkpoint_pairs_with_a_flat_file(files):
    res = cli("checkpoint", files / "dcp", files / "flat.safetensors", "--format", "json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output[res.output.index("{"):])
    assert doc["summary"]["verdicts"]["identical"] == doc["summary"]["keys"] == 4
    [said] = [w for w in doc["warnings"] if w.startswith("names:")]
    assert said.startswith("names: every name in ref is 'model.' + a name in cand: compared "
                           'through the map `[[map]]`, `cand = "**"`, `ref = "model.**"` '
                           "(applied")
    assert not any("as asked" in w for w in doc["warnings"]), doc["warnings"]


def test_a_prefix_that_does_not_pair_every_name_is_suggested(files):
    res = cli("checkpoint", files / "dcp", files / "extra.safetensors")
    assert res.exit_code == 1
    text = " ".join(res.output.split())
    assert ("names: 4 of the names in ref are 'model.' + a name in cand: a map file of the "
            'lines `[[map]]`, `cand = "**"`, `ref = "model.**"` pairs them (auditor checkpoint '
            "REF CAND --map FILE)") in text


def test_a_bitwise_breach_says_how_much_and_where(files):
    res = cli("checkpoint", files / "dcp", files / "ulp.safetensors")
    assert res.exit_code == 1
    text = " ".join(res.output.split())
    assert ("diverged: state model.0.weight value @ step 0 — fingerprints differ; max_abs "
            in text) and "1 ulp, 1 of 256 elements differ" in text
    assert "largest difference at [3, 5]:" in text


def test_prefix_match_directions_and_ambiguity():
    flat = ["a.weight", "a.bias", "b.weight"]
    nested = ["model." + n for n in flat]
    m = prefix_match(nested, flat)
    assert (m.prefix, m.ref_has_prefix, m.complete) == ("model.", True, True)
    assert m.toml() == '[[map]]\ncand = "**"\nref = "model.**"\n'
    m = prefix_match(flat, nested + ["optim.x"])
    assert (m.cand_glob, m.ref_glob, m.complete) == ("model.**", "**", True)
    assert prefix_match(flat, ["x." + n for n in flat[:1]] + ["y." + n for n in flat[1:2]]) \
        is None  # one name each: no prefix explains two
    partial = prefix_match(nested, flat + ["a.weight2"])
    assert not partial.complete and partial.matched == 3
