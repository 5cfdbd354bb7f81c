"""The capture fast path (cached plans, descriptors straight to the fused kernel) records exactly
what the general path records: same keys, layouts, dtypes, payload bytes; fingerprints and counts
bitwise, moments and sketches within float64 rounding (the eager digest is the reference)."""

from __future__ import annotations

import torch

from agents.capture import Capturer, Counters
from agents.columns import payload_bytes
from agents.hooks import add_grad_hook
from agents.config import AgentConfig
from agents.identity import RankIdentity
from agents.kernels import cpu

K = 64


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.ReLU(inplace=True),
                                        torch.nn.Linear(48, 16))
        self.pair = torch.nn.LSTM(16, 8, batch_first=True)  # a tuple of outputs
        self.out = torch.nn.Linear(8, 32).to(torch.bfloat16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.body(self.emb(tokens))
        y, _ = self.pair(h)
        return self.out(y.to(torch.bfloat16)).float()


def _records(digest: str) -> dict[tuple, tuple]:
    """Key -> (layout, dtype, flags, payload, i64 row, f64 row) of two steps, two microbatches."""
    torch.manual_seed(0)
    model = _Net()
    batches = []
    cfg = AgentConfig(digest=digest, sketch_k=K, phases=("fwd", "bwd", "grad", "param", "loss"),
                      payload=("fwd:out",), device_batch=8)
    cap = Capturer(cfg, RankIdentity(), batches.append, Counters())
    cap.hook_modules(model)
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        cap.start_step(step)
        for mb in range(2):
            cap.microbatch = mb
            tokens = torch.randint(0, 32, (3, 5), generator=g)
            loss = model(tokens).square().mean()
            cap.capture(loss, phase="loss", site="loss")
            loss.backward()
            cap.flush()
        cap.capture_parameters(model, grads=True)
        cap.capture_parameters(model, grads=False)
        model.zero_grad(set_to_none=True)
    fast_plans = sum(p is not None for p in cap._plans.values())
    assert (fast_plans > 10) if digest == "auto" else fast_plans == 0, fast_plans
    out = {}
    for b in batches:
        for c in b.captures:
            key = (c.step, c.microbatch, c.phase, c.site, c.role, c.index, c.call, c.stage)
            assert key not in out, key
            rows = (None, None) if c.is_none else (b.i64[c.row].clone(), b.f64[c.row].clone())
            payload = None if c.payload is None else bytes(payload_bytes(c.payload))
            out[key] = (c.layout, c.dtype, (c.is_none, c.moments, c.complex_as_real), payload,
                        *rows)
    return out


def test_fast_path_records_what_the_eager_path_records():
    assert cpu.load() is not None, cpu.load_error()
    fast, ref = _records("auto"), _records("eager")
    assert fast.keys() == ref.keys() and len(fast) > 60
    phases = {k[2] for k in fast}
    assert len(phases) == 5, phases  # fwd, bwd, grad, param, loss all compared
    for key, (layout, dtype, flags, payload, i64, f64) in fast.items():
        r_layout, r_dtype, r_flags, r_payload, r_i64, r_f64 = ref[key]
        assert (layout, dtype, flags) == (r_layout, r_dtype, r_flags), key
        assert payload == r_payload, key
        if i64 is None:
            assert r_i64 is None, key
            continue
        assert torch.equal(i64, r_i64), key  # counts and fingerprint, bitwise
        assert torch.equal(f64[2:5], r_f64[2:5]), key  # min, max, abs-max
        assert torch.allclose(f64, r_f64, rtol=1e-9, atol=1e-9), key


def test_add_grad_hook_sees_what_register_hook_sees():
    """Same gradients, same order beside a user's hook, and the old value's gradient after an
    in-place change, as Tensor.register_hook."""
    def run(register):
        x = torch.arange(6.0, requires_grad=True)
        y = x * 2
        seen = []
        y.register_hook(lambda g: seen.append(("user", g.clone())))
        register(y, lambda g: seen.append(("agent", g.clone())))
        y.mul_(3)  # in place after the hooks: they get the gradient of the value they saw
        y.sum().backward()
        return seen, x.grad

    ours, grad = run(add_grad_hook)
    ref, ref_grad = run(lambda t, h: t.register_hook(h))
    assert [n for n, _ in ours] == [n for n, _ in ref] == ["user", "agent"]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(ours, ref))
    assert torch.equal(ours[1][1], torch.full((6,), 3.0)) and torch.equal(grad, ref_grad)
