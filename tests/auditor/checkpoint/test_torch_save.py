"""`auditor checkpoint` on torch.save files: the same state dict saved as one .pt and as a DCP
directory compares name for name; a .pt that needs code to load is refused, not run."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from numaudit.agents.capture.state import flatten
from tests.auditor.checkpoint.helpers import all_identical, auditor, cli, input_error, save_dcp


def _state() -> dict:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 8)).sum().backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "epoch": 7,
            "view": torch.arange(12.0).reshape(3, 4).t()}  # saved as a non-contiguous view


def test_torch_save_matches_its_dcp_save(tmp_path: Path):
    sd = _state()
    torch.save(sd, tmp_path / "ckpt.pt")
    save_dcp(sd, tmp_path / "dcp")
    sites = {name for name, _ in flatten(sd)}
    res = cli("checkpoint", tmp_path / "dcp", tmp_path / "ckpt.pt", "--format", "json",
              "--max-memory", "8KiB")
    all_identical(res.report(), sites)


def test_torch_save_finds_the_changed_element(tmp_path: Path):
    sd = _state()
    torch.save(sd, tmp_path / "a.pt")
    w = sd["model"]["2.weight"]
    with torch.no_grad():
        w[1, 3] = torch.nextafter(w[1, 3], torch.tensor(10.0))
    torch.save(sd, tmp_path / "b.pt")
    res = cli("checkpoint", tmp_path / "a.pt", tmp_path / "b.pt", "--format", "json")
    report = res.report()
    assert res.code == 1
    assert report["first_divergence"]["key"]["site"] == "model.2.weight"
    assert report["summary"]["breaches"] == 1


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {_Payload.marker}",))


def test_a_pickle_that_runs_code_is_refused(tmp_path: Path):
    _Payload.marker = tmp_path / "pwned"
    torch.save({"model": {"w": torch.ones(2)}, "evil": _Payload()}, tmp_path / "evil.pt")
    err = input_error(auditor("checkpoint", tmp_path / "evil.pt", tmp_path / "evil.pt"),
                      "evil.pt", "weights_only")
    assert "not loadable" in err
    assert not _Payload.marker.exists()


def test_two_names_mapped_to_one_are_named(tmp_path: Path):
    torch.save({"a.weight": torch.ones(2), "b.weight": torch.zeros(2)}, tmp_path / "c.pt")
    torch.save({"w": torch.ones(2)}, tmp_path / "r.pt")
    (tmp_path / "map.toml").write_text('[[map]]\ncand = "a.weight"\nref = "w"\n'
                                       '[[map]]\ncand = "b.weight"\nref = "w"\n')
    input_error(cli("checkpoint", tmp_path / "r.pt", tmp_path / "c.pt", "--map",
                    tmp_path / "map.toml"), "a.weight", "b.weight", "both read as w")
