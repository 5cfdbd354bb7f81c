"""Synthetic runs of a reference whose backward is nondeterministic on rank 0, for the noise-band
tests (tests/auditor/compare/noise/test_noise.py, tests/auditor/cli/test_calibrate.py).

Two ranks, one step, one microbatch, float32. Every run holds the same tensors but for its
noise: a seeded random 1/16 of the elements of rank 0's share of the attention's activation
gradient moved one bfloat16 ulp up or down (what a GPU's atomic accumulation does), and the
query weight's gradient (computed from it, so noisy too, replicated on both ranks). Rank 1's
share and every other key are bitwise equal from run to run. Values are large enough (|x| ~ 1)
that one bfloat16 ulp breaches the fp32 preset's elementwise test.
"""

from __future__ import annotations

import torch

from tests.auditor.synth import RunBuilder

WIDTH, ROWS = 32, 8
NOISE_SHARE = 1 / 16


def one_bf16_ulp(t: torch.Tensor, seed: int, share: float = NOISE_SHARE) -> torch.Tensor:
    """``t`` with a seeded random ``share`` of its elements moved one bfloat16 ulp."""
    g = torch.Generator().manual_seed(seed)
    hit = torch.rand(t.shape, generator=g) < share
    sign = torch.where(torch.rand(t.shape, generator=g) < 0.5, -1.0, 1.0)
    _, exp = torch.frexp(t)
    ulp = torch.ldexp(torch.ones_like(t), (exp - 8).to(torch.int32))
    return torch.where(hit & (t != 0), t + sign * ulp, t)


def base_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=g) for name, shape in (
        ("act", (ROWS, WIDTH)), ("dq", (ROWS, WIDTH)), ("wq", (WIDTH, WIDTH)),
        ("w1", (WIDTH, WIDTH)), ("x", (ROWS, WIDTH)))}


def noisy_run(name: str, seed: int, *, noisy_ranks=(0,), payload: bool = True,
              scale: dict[str, float] | None = None, world: int = 2,
              sketch_k: int = 64) -> RunBuilder:
    """One run: ``seed`` draws its noise (on the ranks ``noisy_ranks``), ``scale`` multiplies a
    key's tensor ("dq", "wq", "w1"): a planted bug. ``world`` 1 holds every tensor whole."""
    t = base_tensors()
    scale = scale or {}
    half = ROWS // 2
    dq = t["dq"].clone()
    for r in noisy_ranks:
        rows = slice(r * half, (r + 1) * half)
        dq[rows] = one_bf16_ulp(dq[rows], seed * 10 + r)
    dq = dq * scale.get("dq", 1.0)
    wq = (t["x"].T @ dq) * scale.get("wq", 1.0)
    w1 = t["w1"] * scale.get("w1", 1.0)
    b = RunBuilder(name, world_size=world, sketch_k=sketch_k)
    key = dict(step=0, payload=payload)
    ranks = list(range(world))
    for site, phase, role, value in (("layers.0", "fwd", "output", t["act"]),
                                     ("layers.0.attn", "bwd", "grad_output", dq)):
        if world > 1:
            b.add_sharded(value, ranks, microbatch=0, phase=phase, site=site, role=role, **key)
        else:
            b.add_full(value, microbatch=0, phase=phase, site=site, role=role, **key)
    for site, value in (("layers.0.attn.q.weight", wq), ("layers.0.mlp.w1.weight", w1)):
        b.add_full(value, ranks=ranks, microbatch=-1, phase="grad", site=site, role="value", **key)
    return b


def noisy_runs(payload: bool = True, prefix: str = "") -> list[RunBuilder]:
    """ref, ref2, ref3 (the reference's runs), clean (another run), scaled (w1's gradient x1.01,
    where every run is bitwise equal), x125 (the noisy gradient x1.25), rank1 (rank 1's share
    noisy too, as much as rank 0's), single (one process: every tensor whole, clean), same (ref's
    noise drawn again: bitwise equal to ref)."""
    p = prefix
    return [noisy_run(p + "ref", 1, payload=payload), noisy_run(p + "ref2", 2, payload=payload),
            noisy_run(p + "ref3", 3, payload=payload), noisy_run(p + "clean", 4, payload=payload),
            noisy_run(p + "scaled", 5, payload=payload, scale={"w1": 1.01}),
            noisy_run(p + "x125", 6, payload=payload, scale={"dq": 1.25}),
            noisy_run(p + "rank1", 7, payload=payload, noisy_ranks=(0, 1)),
            noisy_run(p + "single", 8, payload=payload, world=1),
            noisy_run(p + "same", 1, payload=payload)]
