"""Mixed precision as training code writes it: `torch.autocast` around the forward (bfloat16
activations and gradients, float32 weights), and loss scaling with `torch.amp.GradScaler`,
against a real daemon and SQLite store (docs/parallelisms.md, "Mixed precision").

Two identical autocast runs compare bitwise identical, forward and backward captures included;
an autocast run against the same model in float32 breaches the bitwise policy, and its findings
carry both dtypes, so the report says why (an unflagged dtype change would read as numerics).
Two runs whose scalers scale by different powers of two agree bitwise wherever the gradients
are unscaled (the optimizer's side) and differ where they are not (`bwd`, `grad`); a declared
`grad_scale` brings `bwd` within tolerance."""

from __future__ import annotations

import pytest
import torch

import numaudit
from numaudit.auditor.compare.engine import compare_runs
from numaudit.auditor.compare.policy.load import preset_policy
from numaudit.auditor.store import RECORD_COLUMNS, Reader

pytestmark = pytest.mark.timeout(120)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(32, 16)
        self.a = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.b = torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.b(self.norm(torch.relu(self.a(self.emb(x)))))


PHASES = ("fwd", "bwd", "grad", "loss", "param")


def _job(address: str, run: str, *, amp: bool = False, scale: float | None = None) -> dict:
    """Two steps of two microbatches: the forward under autocast when `amp`, the loss scaled by
    a GradScaler of fixed `scale` (declared as the run's grad_scale) when given."""
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if scale is None:
        agent = numaudit.attach(model, run=run, address=address, optimizer=opt, phases=PHASES)
        scaler = None
    else:
        agent = numaudit.attach(model, run=run, address=address, optimizer=opt, grad_scale=scale,
                              phases=PHASES + ("optim_grad", "update"))
        scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=1000)  # stays
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        with agent.step(step):
            for j in range(2):
                with agent.microbatch(j):
                    x = torch.randint(0, 32, (4, 6), generator=gen)
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                        logits = model(x)
                        loss = torch.nn.functional.cross_entropy(
                            logits.flatten(0, 1).float(), x.flatten())
                    agent.capture(loss, site="loss", phase="loss")
                    (loss / 2 if scaler is None else scaler.scale(loss / 2)).backward()
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
    return agent.close()


def test_autocast_runs_compare_bitwise_and_a_dtype_change_is_named(auditor_server):
    addr, db = auditor_server.address, auditor_server.db_path
    for run, amp in (("amp1", True), ("amp2", True), ("fp32", False)):
        summary = _job(addr, run, amp=amp)
        assert summary["acked"] == summary["captured"] > 0 and summary["errors"] == 0
    reader = Reader(db)
    try:
        col = {name: i for i, name in enumerate(RECORD_COLUMNS)}
        dtypes = {r[col["dtype"]] for r in reader.records("amp1")}
    finally:
        reader.close()
    assert {"bfloat16", "float32"} <= dtypes  # activations and their gradients, and weights
    same = compare_runs(db, "amp1", "amp2", preset_policy("bitwise"))
    assert same.exit_code == 0 and same.first is None
    assert {f.verdict for f in same.findings()} == {"identical"}
    phases = {f.key.phase for f in same.findings()}
    assert {"fwd", "bwd", "grad", "loss", "param"} <= phases
    mixed = compare_runs(db, "fp32", "amp1", preset_policy("bitwise"))
    assert mixed.exit_code == 1
    first = mixed.first
    assert (first.key.step, first.key.microbatch, first.key.phase, first.key.site) == \
        (0, 0, "fwd", "a")
    assert first.as_dict()["dtype"] == {"ref": "float32", "cand": "bfloat16"}


def test_loss_scaling_differs_only_where_gradients_are_scaled(auditor_server):
    addr, db = auditor_server.address, auditor_server.db_path
    for run, scale in (("s1024", 1024.0), ("s16", 16.0)):
        summary = _job(addr, run, scale=scale)
        assert summary["acked"] == summary["captured"] > 0 and summary["errors"] == 0
    verdicts, warnings = {}, {}
    for preset in ("bitwise", "fp32"):
        report = compare_runs(db, "s1024", "s16", preset_policy(preset))
        assert report.exit_code == 1  # `grad` holds scaled gradients in both presets
        verdicts[preset], warnings[preset] = {}, report.warnings
        for f in report.findings():
            verdicts[preset].setdefault(f.key.phase, set()).add(f.verdict)
    bitwise, fp32 = verdicts["bitwise"], verdicts["fp32"]
    for phase in ("fwd", "loss", "optim_grad", "update", "param"):
        assert bitwise[phase] == {"identical"}, phase  # unscaled before the optimizer runs
    # the declared scales' x1/64 is exact (a power of two): the bitwise preset passes it, said
    assert bitwise["bwd"] == {"close"} and bitwise["grad"] == {"diverged"}
    assert any("compared by the exact metric are exactly s1024's x0.0156 in s16" in w
               for w in warnings["bitwise"]), warnings["bitwise"]
    assert fp32["bwd"] == {"close"}  # normalized by the declared grad_scale
    assert fp32["grad"] == {"diverged"}  # compared as captured
