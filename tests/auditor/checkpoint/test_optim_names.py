"""An optimizer saved as ``optimizer.state_dict()`` (state keyed by parameter index) against the
same optimizer saved through ``get_state_dict`` (keyed by parameter name, as DCP and torchtitan
save it): the index side is named by the other side's param_groups, so the two compare entry
for entry, and a change in one parameter's state is found under that parameter's name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from numaudit.auditor.checkpoint.optim_names import index_names
from tests.auditor.checkpoint.helpers import cli, save_dcp


def _trained(groups: bool = False):
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8),
                                torch.nn.Linear(8, 3))
    params = list(model.parameters())
    spec = ([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}] if groups
            else params)
    opt = torch.optim.AdamW(spec, lr=1e-3)
    model(torch.randn(4, 6)).square().sum().backward()
    opt.step()
    return model, opt


def _saves(tmp_path: Path, *, groups: bool = False, plant: bool = False) -> tuple[Path, Path]:
    model, opt = _trained(groups)
    msd, osd = get_state_dict(model, opt)
    save_dcp({"model": msd, "optim": osd}, tmp_path / "dcp")
    plain = opt.state_dict()
    if plant:  # parameter 4 (the second Linear's weight): one element of exp_avg moved
        with torch.no_grad():
            t = plain["state"][4]["exp_avg"]
            t[1, 2] = torch.nextafter(t[1, 2], torch.tensor(1.0))
    torch.save({"model": model.state_dict(), "optim": plain}, tmp_path / "plain.pt")
    return tmp_path / "plain.pt", tmp_path / "dcp"


@pytest.mark.parametrize("groups", [False, True])
@pytest.mark.parametrize("plain_is", ["ref", "cand"])
def test_index_keyed_state_compares_with_name_keyed_state(tmp_path, groups, plain_is):
    plain, dcp = _saves(tmp_path, groups=groups)
    ref, cand = (plain, dcp) if plain_is == "ref" else (dcp, plain)
    res = cli("checkpoint", ref, cand, "--format", "json")
    report = res.report()
    assert res.code == 0, report["summary"]
    v = report["summary"]["verdicts"]
    assert v["missing_in_ref"] == v["missing_in_cand"] == 0, v
    sites = {f["key"]["site"] for f in report["findings"]}
    assert "optim.state.2.weight.exp_avg" in sites and "optim.state.4.exp_avg" not in sites
    assert any(f"{plain_is}'s optimizer state (optim.state) is keyed by parameter index: its 6 "
               "indices were named" in w for w in report["warnings"]), report["warnings"]


def test_a_changed_state_element_is_found_under_its_parameter_name(tmp_path):
    plain, dcp = _saves(tmp_path, plant=True)
    res = cli("checkpoint", dcp, plain, "--format", "json")
    report = res.report()
    assert res.code == 1
    assert report["summary"]["breaches"] == 1
    assert report["first_divergence"]["key"]["site"] == "optim.state.2.weight.exp_avg"


def test_groups_that_do_not_line_up_are_not_renamed(tmp_path):
    """One side groups its parameters 2 + 4, the other 6: no pairing is sure, so nothing is
    renamed and the entries stay missing on both sides, as they are."""
    model, opt = _trained(groups=True)
    torch.save({"optim": opt.state_dict()}, tmp_path / "plain.pt")
    model, opt = _trained(groups=False)
    _, osd = get_state_dict(model, opt)
    save_dcp({"optim": osd}, tmp_path / "dcp")
    report = cli("checkpoint", tmp_path / "dcp", tmp_path / "plain.pt", "--format",
                 "json").report()
    assert report["summary"]["verdicts"]["missing_in_ref"] > 0
    assert not any("keyed by parameter index" in w for w in report["warnings"])


def test_only_plain_indices_pair_with_names():
    names = {"optim.": {0: ["a.weight", "a.bias"]}}
    assert index_names({"optim.": {0: [0, 1]}}, names) == {
        "optim.": {"0": "a.weight", "1": "a.bias"}}
    assert index_names({"optim.": {0: [True, False]}}, names) == {}  # bools are not indices
    assert index_names({"optim.": {0: [0, 0]}}, names) == {}  # an index listed twice
    assert index_names({"optim.": {0: [0]}}, names) == {}  # another length
    assert index_names({"other.": {0: [0, 1]}}, names) == {}  # another optimizer
    assert index_names(names, names) == {}  # names on both sides: nothing to rename


def test_a_candidate_under_a_name_map_is_not_renamed_and_says_so(tmp_path):
    """A map names CAND's entries in REF's terms: renaming them by REF's param_groups first
    would feed the map names it was not written for, so the index side is left as it is."""
    plain, dcp = _saves(tmp_path)
    (tmp_path / "map.toml").write_text('[[map]]\ncand = "model.**"\nref = "model.**"\n')
    res = cli("checkpoint", dcp, plain, "--map", tmp_path / "map.toml", "--format", "json")
    report = res.report()
    assert report["summary"]["verdicts"]["missing_in_cand"] > 0
    assert any("not renamed, because a name map is applied to cand" in w
               for w in report["warnings"]), report["warnings"]
