"""Per-sample digests (agents/digest/sample_digest.py): each unit's digest is the definition's
(Python, unbounded integers mod 2**64), whichever implementation made it, and what the hooks
record."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from numaudit.agents.capture.capture import Capturer, Counters
from numaudit.agents.config import AgentConfig
from numaudit.agents.digest import digest as D
from numaudit.agents.digest import hashing
from numaudit.agents.digest.fastpath import Digester
from numaudit.agents.digest.sample_digest import (
    MAX_SAMPLES,
    MAX_UNITS,
    _combine,
    _Torch,
    combine_units,
    digest_samples_eager,
    sample_layout,
    unit_plan,
)
from numaudit.agents.identity import RankIdentity
from numaudit.agents.kernels import cpu
from numaudit.agents.layout import PieceLayout
from tests.agents.test_digest import ref_digest
from tests.agents.test_fast_path import _Net

pytestmark = pytest.mark.usefixtures("one_thread")

M64 = (1 << 64) - 1


def ref_units(t: torch.Tensor, layout: PieceLayout, dim: int, unit: int, k: int):
    """The definition: unit g's fingerprint is that of its samples as a tensor of its own
    (sample t of the unit t samples in), its sketch sum_t of sample t's within-sample sketch
    with bucket b moved to c = b ^ t and the sign (-1)^popcount(t & c)."""
    slayout = sample_layout(layout, dim)
    numel_s = math.prod(slayout.logical_shape)
    n = t.shape[dim]
    out = []
    for g0 in range(0, n, unit):
        fp, sketch, vals = 0, np.zeros(k), []
        for s in range(g0, min(n, g0 + unit)):
            f, sk, v = ref_digest(t.select(dim, s), slayout, k)
            fp = (fp + f * hashing.shift(1, (s - g0) * numel_s)) & M64
            c, slot = np.arange(k), s - g0
            sketch += sk[c ^ slot] * (-1.0) ** np.bitwise_count(c & slot)
            vals += v
        out.append((fp, sketch, vals))
    return out


def check_rows(f64, fps, want) -> None:
    assert f64.shape[0] == len(want)
    for row, fp, (wfp, sketch, vals) in zip(np.asarray(f64).tolist(), np.asarray(fps).tolist(),
                                            want):
        assert fp & M64 == wfp
        np.testing.assert_allclose(row[D.N_MOMENTS:], sketch, rtol=1e-12, atol=1e-9)
        assert row[0] == pytest.approx(math.fsum(vals), rel=1e-12, abs=1e-9)
        assert row[1] == pytest.approx(math.fsum(v * v for v in vals), rel=1e-12, abs=1e-9)
        assert (row[2], row[3]) == (min(vals, default=math.inf), max(vals, default=-math.inf))


def test_unit_plan_keeps_records_small_and_units_nested():
    """Up to MAX_UNITS samples: one unit each, k * n about the budget (never below 8);
    beyond: power-of-two units, at most MAX_UNITS of them, each with k >= its size (a unit's
    samples then never share a bucket at the same index); none beyond MAX_SAMPLES."""
    for n in range(1, MAX_SAMPLES + 1):
        unit, k = unit_plan(n)
        assert unit & (unit - 1) == 0 and k & (k - 1) == 0 and k >= max(unit, 8)
        assert -(-n // unit) <= MAX_UNITS
        assert (unit == 1) == (n <= MAX_UNITS)
        if n <= MAX_UNITS:
            assert 64 <= n * k <= 256 or k == 8
    assert unit_plan(MAX_SAMPLES + 1) is None and unit_plan(0) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_sample_digests_match_the_definition_whatever_the_implementation(dtype):
    """A tensor-parallel shard (columns 3..8 of 11) of 5 samples at batch offset 5 of 10,
    batch on dim 0 and on dim 1 (sequence-first), with NaN/Inf: the fused kernel, the eager
    path and the accelerator path (sync-free) give each sample the digest of the definition,
    and units of 2 samples combine to theirs."""
    g = torch.Generator().manual_seed(3)
    for dim in (0, 1):
        shape = (5, 4, 6) if dim == 0 else (4, 5, 6)
        logical = (10, 4, 11) if dim == 0 else (4, 10, 11)
        offsets = (5, 0, 3) if dim == 0 else (0, 5, 3)
        t = (torch.randn(shape, generator=g) * 3).to(dtype)
        t.view(-1)[7], t.view(-1)[30] = float("nan"), float("inf")
        layout = PieceLayout(logical, offsets, shape)
        slayout = sample_layout(layout, dim)
        k = 16
        per_sample = ref_units(t, layout, dim, 1, k)
        runs = [digest_samples_eager(t, slayout, dim, k),
                digest_samples_eager(t, slayout, dim, k, sync_free=True)]
        if cpu.load() is not None:
            runs.append(Digester("auto").digest_samples([(t, slayout, dim, k)])[0])
        for f64, i64 in runs:
            check_rows(f64, i64[:, 5], per_sample)
            assert i64[:, 1].sum() == 1 and i64[:, 2].sum() == 1
            numel_s = math.prod(slayout.logical_shape)
            check_rows(*combine_units(f64, i64, 2, numel_s, k), ref_units(t, layout, dim, 2, k))
            # digested with more buckets and folded: the same units
            check_rows(*combine_units(f64, i64, 2, numel_s, k // 2),
                       ref_units(t, layout, dim, 2, k // 2))
            # the accelerator's combination (torch) is the host's (numpy)
            host = combine_units(f64, i64, 2, numel_s, k // 2)
            dev = _combine(_Torch, f64, i64[:, 5], 2, numel_s, k // 2)
            np.testing.assert_array_equal(host[1], dev[1].numpy())
            np.testing.assert_allclose(host[0], dev[0].numpy(), rtol=1e-15)


def test_samples_over_a_chunk_and_chunks_of_samples(monkeypatch):
    """Samples larger than a chunk are digested chunk by chunk, smaller ones several a chunk:
    the same rows either way."""
    t = torch.randn(7, 3, 5, dtype=torch.float32).transpose(1, 2)  # not contiguous
    layout = PieceLayout.full(tuple(t.shape))
    slayout = sample_layout(layout, 0)
    want = digest_samples_eager(t, slayout, 0, 8)
    for chunk in (4, 15, 40):
        monkeypatch.setattr(D, "CHUNK_ELEMENTS_CPU", chunk)
        D.release_workspaces()
        f64, i64 = digest_samples_eager(t, slayout, 0, 8)
        assert torch.equal(i64, want[1])
        assert torch.allclose(f64, want[0], rtol=1e-12, atol=1e-12)
    D.release_workspaces()


def _sample_records(digest: str, dp: tuple[int, int] = (0, 1), batch: int = 3):
    torch.manual_seed(0)
    model = _Net()
    batches = []
    cfg = AgentConfig(digest=digest, sketch_k=64, phases=("fwd", "bwd", "loss"), device_batch=8)
    cap = Capturer(cfg, RankIdentity(dp_rank=dp[0], dp_size=dp[1]), batches.append, Counters())
    cap.hook_modules(model)
    cap.start_step(0)
    cap.microbatch = 0
    tokens = torch.randint(0, 32, (batch, 5), generator=torch.Generator().manual_seed(1))
    outputs = {}
    for name, module in model.named_modules():
        if name:
            module.register_forward_hook(
                lambda m, i, o, name=name: outputs.__setitem__(name, torch.utils._pytree.tree_map(
                    lambda x: x.detach().clone(), o)))
    loss = model(tokens).square().mean()
    cap.capture(loss, phase="loss", site="loss")
    loss.backward()
    cap.flush()
    out = {}
    for b in batches:
        b.wait()
        for c in b.captures:
            out[(c.phase, c.site, c.role, c.index)] = (c, outputs.get(c.site))
    return out


def test_hooks_record_sample_digests_of_batch_holding_captures_on_either_path():
    """Activations and activation gradients carry sample digests along their batch dim (an
    LSTM's hidden states on dim 1, as torch says), the loss none; the fast path records what
    the eager path records, and each forward output's units are the definition's."""
    fast, eager = _sample_records("auto"), _sample_records("eager", dp=(1, 2))
    assert fast.keys() == eager.keys()
    for key, (c, out) in fast.items():
        e = eager[key][0]
        if key[0] == 5:  # the loss: a reduction, no samples
            assert c.samples is None and e.samples is None
            continue
        s, se = c.samples, e.samples
        assert (s.dim, s.unit, s.count, s.sketch_k) == (se.dim, se.unit, se.count, se.sketch_k)
        assert s.dim == (1 if key[1] == "pair" and key[3] > 0 else 0), key
        assert (s.count, s.unit, s.sketch_k) == (3, 1, 32)
        # the dp split changes nothing
        np.testing.assert_array_equal(s.fingerprint, se.fingerprint)
        np.testing.assert_allclose(s.f64, se.f64, rtol=1e-9, atol=1e-9)
        if key[0] == 1 and out is not None:
            t = torch.utils._pytree.tree_leaves(out)[key[3]]
            check_rows(s.f64, s.fingerprint, ref_units(t.detach(), c.layout, s.dim, 1, 32))


def test_sample_digests_can_be_switched_off():
    from numaudit.agents.config import apply_env
    assert apply_env(AgentConfig(), {"NUMAUDIT_SAMPLE_DIGESTS": "0"}).sample_digests is False
    assert apply_env(AgentConfig(), {}).sample_digests is True


_TRITON = """
import os, torch
os.environ["TRITON_INTERPRET"] = "1"
from numaudit.agents.digest.fastpath import Digester
from numaudit.agents.kernels.accel import term_magnitudes, within_contract
from numaudit.agents.layout import PieceLayout
from numaudit.agents.digest.sample_digest import digest_samples_eager, sample_layout
d = Digester("auto", triton_devices=("cpu",))
d._cpu = None  # CPU pieces to Triton (under its interpreter), as accelerator pieces would go
g = torch.Generator().manual_seed(5)
items = []
for dtype in (torch.float32, torch.bfloat16):
    t = (torch.randn(3, 2, 300, generator=g) * 2).to(dtype)
    t[1, 1, 7] = float("nan")
    layout = PieceLayout((6, 2, 600), (3, 0, 300), (3, 2, 300))  # a dp share of a tp shard
    items.append((t, sample_layout(layout, 0), 0, 32))
    items.append((t.transpose(0, 1), sample_layout(PieceLayout.full((2, 3, 300)), 1), 1, 16))
for (t, layout, dim, k), got in zip(items, d.digest_samples(items)):
    want = digest_samples_eager(t, layout, dim, k)
    for s in range(t.shape[dim]):  # the Triton contract (float32 within a tile), per sample
        sample = t.select(dim, s)
        assert within_contract((got[0][s], got[1][s]), (want[0][s], want[1][s]),
                               term_magnitudes(sample, layout, k)), (t.dtype, dim, s)
assert all(d._triton._trusted.values()), d._triton._trusted
print("ok", len(items))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (optional: pip install triton)")
def test_triton_digests_samples_as_the_eager_path_does():
    """Samples of accelerator pieces go to Triton as a list of pieces (one call per k): the
    same rows as the eager path (under the interpreter, in a child: TRITON_INTERPRET must be
    set before triton is first imported)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _TRITON], env=env, capture_output=True,
                         text=True, timeout=600, cwd=str(Path(__file__).resolve().parents[2]))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok 4")
