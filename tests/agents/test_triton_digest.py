"""The Triton digest (agents/kernels/digest_triton.py) against the eager reference, under
Triton's CPU interpreter when there is no GPU: fingerprints, counts, min/max/abs-max bitwise
equal; float64 sums and sketch buckets within float64 rounding.

Skipped when triton is not installed (it is optional: `pip install triton`); the interpreter
is slow, so the pieces are small.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (optional: pip install triton)", allow_module_level=True)
if not torch.cuda.is_available():
    # Triton reads TRITON_INTERPRET when its own library and our kernels are decorated, i.e.
    # when triton is first imported: it must be set before that.
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported without TRITON_INTERPRET=1 and there is no GPU",
                    allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"

from agents.digest import N_MOMENTS, _digest  # noqa: E402
from agents.layout import PieceLayout, batch_layout  # noqa: E402

K = 16


@pytest.fixture(scope="module")
def triton_digest():
    import agents.kernels.digest_triton as mod

    return mod


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _values(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        t = (torch.randn(n, generator=g, dtype=torch.float64) * 3).to(dtype)
        for j, p in enumerate((3, 17, 40, 41, 90)):
            if p < n:
                t[p] = (math.nan, math.inf, -math.inf, 0.0, -0.0)[j]
        return t
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2 ** 62)), min(info.max, 2 ** 62), (n,), generator=g,
                         dtype=torch.int64).to(dtype)


def _assert_same(mod, t: torch.Tensor, layout: PieceLayout) -> None:
    ref64, ref_i64 = _digest(t, layout, K, sync_free=None)
    got64, got_i64 = mod.digest_piece_triton(t.to(_device()), layout, sketch_k=K)
    got64, got_i64 = got64.cpu(), got_i64.cpu()
    assert torch.equal(got_i64, ref_i64), (got_i64.tolist(), ref_i64.tolist())
    assert torch.equal(got64[2:N_MOMENTS], ref64[2:N_MOMENTS]), (got64[:5], ref64[:5])
    if t.is_floating_point() and t.numel():
        f = t.reshape(-1).to(torch.float64)
        f = torch.where(torch.isfinite(f), f, 0.0)
        bound = 4 * t.numel() * 2.0 ** -52 * f.abs().sum().item() + 1e-300
        assert abs(got64[0] - ref64[0]) <= bound
        assert abs(got64[1] - ref64[1]) <= 4 * t.numel() * 2.0 ** -52 * (f * f).sum().item() + 1e-300
        assert (got64[N_MOMENTS:] - ref64[N_MOMENTS:]).abs().max().item() <= bound
    else:
        assert torch.equal(got64, ref64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool])
@pytest.mark.parametrize("n", [0, 1, 97, 2500])
def test_triton_equals_eager(triton_digest, dtype, n):
    t = _values(dtype, n, n)
    _assert_same(triton_digest, t, PieceLayout.full((n,)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_noncontiguous_pieces_of_larger_tensors(triton_digest, dtype):
    t = _values(dtype, 30 * 40, 5).reshape(30, 40).t()  # column-major, 40 x 30
    _assert_same(triton_digest, t, PieceLayout((50, 90), (3, 60), (40, 30)))
    u = _values(dtype, 2 * 61, 6).reshape(2, 61)[:, ::2]  # strided rows
    _assert_same(triton_digest, u, batch_layout((2, 31), dp_rank=1, dp_size=3))


def test_index_crossing_2_to_the_32(triton_digest):
    layout = PieceLayout((4, 2 ** 31 + 64), (1, 2 ** 31 - 84), (2, 40))
    _assert_same(triton_digest, _values(torch.float32, 80, 9).reshape(2, 40), layout)


def test_complex_is_digested_as_its_real_view(triton_digest):
    t = torch.complex(_values(torch.float32, 12, 1), _values(torch.float32, 12, 2)).reshape(4, 3)
    ref64, ref_i64 = _digest(t, PieceLayout.full((4, 3)), K, sync_free=None)
    got64, got_i64 = triton_digest.digest_piece_triton(t.to(_device()), PieceLayout.full((4, 3)),
                                                       sketch_k=K)
    assert torch.equal(got_i64.cpu(), ref_i64)
    assert torch.equal(got64.cpu()[2:N_MOMENTS], ref64[2:N_MOMENTS])
