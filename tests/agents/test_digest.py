"""Digests: exact against a pure-Python reference, mergeable across any tiling, position-aware."""

from __future__ import annotations

import itertools
import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from numaudit.agents.digest import digest as D
from numaudit.agents.digest import hashing
from numaudit.agents.digest.digest import (
    DEFAULT_SKETCH_K,
    _digest,
    digest_batch_to_host,
    digest_piece,
    has_moments,
    release_workspaces,
)
from numaudit.agents.layout import PieceLayout, complex_real_layout
from numaudit.auditor.compare.digests.algebra import DigestValues, merge_disjoint, merge_partial

pytestmark = pytest.mark.usefixtures("one_thread")

M64 = (1 << 64) - 1
M32 = (1 << 32) - 1
K = 16  # small sketches keep the pure-Python reference fast


# ----------------------------------------------------------------- pure-Python reference


def ref_bits(v, dtype: torch.dtype) -> int:
    """Raw bits zero-extended (floats), value mod 2**64 (integers)."""
    if dtype == torch.float64:
        return struct.unpack("<Q", struct.pack("<d", v))[0]
    if dtype == torch.float32:
        return struct.unpack("<I", struct.pack("<f", v))[0]
    if dtype in (torch.float16, torch.bfloat16):
        return int(torch.tensor([v], dtype=dtype).view(torch.int16)[0]) & 0xFFFF
    return int(v) & M64


def ref_digest(t: torch.Tensor, layout: PieceLayout, k: int):
    """Digest from the definition, with Python's unbounded ints reduced mod 2**64."""
    gstrides = [math.prod(layout.logical_shape[d + 1:]) for d in range(len(layout.shape))]
    fp, sketch = 0, [0.0] * k
    vals = []
    for c in itertools.product(*(range(s) for s in layout.shape)):
        v = t[c].item() if t.dim() else t.item()
        g = sum((o + ci) * s for o, ci, s in zip(layout.offsets, c, gstrides))
        term = hashing.value_term(ref_bits(v, t.dtype), hashing.mixed_dtype(t.dtype))
        fp = (fp + hashing.key(g) * term) & M64
        bucket, minus = hashing.bucket_sign(g, k)
        if t.dtype.is_floating_point and math.isfinite(v):
            sketch[bucket] += -v if minus else v
            vals.append(v)
    return fp, np.array(sketch), vals


def as_values(t: torch.Tensor, layout: PieceLayout, k: int = K, **kw) -> DigestValues:
    f, i = (_digest(t, layout, k, **kw) if kw else digest_piece(t, layout, sketch_k=k))
    return DigestValues.from_rows(f.tolist(), i.tolist(), has_moments(t.dtype))


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 8 elements, so small tensors cross many chunk boundaries."""
    monkeypatch.setattr(D, "CHUNK_ELEMENTS_CPU", 8)
    release_workspaces()
    yield
    release_workspaces()


# ----------------------------------------------------------------- exactness


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16,
                                   torch.int64, torch.int32, torch.int8, torch.bool])
@pytest.mark.parametrize("chunked", [False, True])
def test_matches_python_reference_wrapping_mod_2_64(dtype, chunked, request):
    """int64 multiply and sum wrap on CPU exactly like arithmetic mod 2**64."""
    if chunked:
        request.getfixturevalue("small_chunks")
    g = torch.Generator().manual_seed(1)
    full = (torch.randn(5, 6, generator=g) * 50).to(dtype)
    # a Shard(1)-like piece: not a contiguous range of the logical tensor
    layout = PieceLayout(logical_shape=(5, 9), offsets=(0, 3), shape=(5, 6))
    fp, sketch, vals = ref_digest(full, layout, K)
    d = as_values(full, layout)
    assert d.fingerprint == fp
    assert d.numel == 30
    if dtype.is_floating_point:
        np.testing.assert_allclose(d.sketch, sketch, rtol=1e-12, atol=1e-9)
        assert d.sum == pytest.approx(math.fsum(vals), rel=1e-12, abs=1e-9)
        assert d.sum_sq == pytest.approx(math.fsum(v * v for v in vals), rel=1e-12)
        assert (d.min, d.max) == (min(vals), max(vals))
        assert d.abs_max == max(abs(v) for v in vals)
    else:
        assert d.sketch.size == 0 and (d.min, d.max) == (math.inf, -math.inf)


def test_zero_extension_of_negative_bits():
    """Negative floats have their sign bit set: the bits enter zero-extended, not sign-extended."""
    t = torch.tensor([-1.5, -0.0, 2.0])
    layout = PieceLayout.full((3,))
    assert as_values(t, layout).fingerprint == ref_digest(t, layout, K)[0]


@pytest.mark.parametrize("offsets,shape,logical", [
    ((2**32 - 3,), (6,), (2**33,)),             # contiguous run across 2**32
    ((2**31 - 2, 5), (4, 3), (2**31 + 7, 11)),  # Shard(1)-like piece at indices > 2**32
    ((2**40,), (5,), (2**41,)),                 # far beyond int32
])
def test_indices_beyond_32_bits(offsets, shape, logical, small_chunks):
    """Logical tensors with more than 2**32 elements keep exact keys (pieces stay small)."""
    t = torch.randn(shape, dtype=torch.float64)
    layout = PieceLayout(logical, offsets, shape)
    fp, sketch, _ = ref_digest(t, layout, K)
    d = as_values(t, layout)
    assert d.fingerprint == fp
    np.testing.assert_allclose(d.sketch, sketch, rtol=1e-12, atol=1e-12)


def test_mixed_int_widths_fingerprint_by_value():
    vals = [-3, 0, 7, 127]
    layout = PieceLayout.full((4,))
    fps = {as_values(torch.tensor(vals, dtype=dt), layout).fingerprint
           for dt in (torch.int8, torch.int16, torch.int32, torch.int64)}
    assert len(fps) == 1


# ----------------------------------------------------------------- mergeability


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64,
          torch.bool, torch.complex64]


def make_tensor(shape, dtype, seed, nonfinite):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not (dtype.is_floating_point or dtype.is_complex):
        return torch.randint(-1000, 1000, shape, generator=g).to(dtype)
    x = torch.randn(shape, generator=g, dtype=torch.complex64 if dtype.is_complex else None) * 3
    x = torch.where(torch.rand(shape, generator=g) < 0.15, torch.zeros_like(x), x)
    if nonfinite and x.numel():
        flat = x.view(-1)
        for j, v in zip(torch.randint(0, x.numel(), (3,), generator=g).tolist(),
                        (math.nan, math.inf, -math.inf)):
            flat[j] = v
    return x.to(dtype)


@st.composite
def tilings(draw):
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.integers(0, 6)) for _ in range(ndim))
    cuts = []
    for s in shape:
        inner = sorted(draw(st.lists(st.integers(0, s), max_size=2)))
        cuts.append([0, *inner, s])
    return shape, cuts


def boxes(shape, cuts):
    ranges = [list(zip(c[:-1], c[1:])) for c in cuts]
    for combo in itertools.product(*ranges):
        yield tuple(a for a, _ in combo), tuple(b - a for a, b in combo)


def assert_same_digest(merged: DigestValues, whole: DigestValues, scale: float):
    assert (merged.numel, merged.nan, merged.posinf, merged.neginf, merged.zeros) == (
        whole.numel, whole.nan, whole.posinf, whole.neginf, whole.zeros)
    assert merged.fingerprint == whole.fingerprint
    assert (merged.min, merged.max, merged.abs_max) == (whole.min, whole.max, whole.abs_max)
    tol = 1e-12 * scale + 1e-300
    assert abs(merged.sum - whole.sum) <= tol
    assert abs(merged.sum_sq - whole.sum_sq) <= 1e-12 * whole.sum_sq + 1e-300
    np.testing.assert_allclose(merged.sketch, whole.sketch, rtol=0, atol=tol)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tilings(), st.sampled_from(DTYPES), st.integers(0, 2**31), st.booleans(),
       st.booleans(), st.booleans())
def test_pieces_merge_to_whole(tiling, dtype, seed, nonfinite, sync_free, replicas):
    """Any box tiling (uneven, empty, 2-D/3-D splits), replicas deduplicated, equals the whole."""
    shape, cuts = tiling
    x = make_tensor(shape, dtype, seed, nonfinite)
    logical = PieceLayout.full(shape)
    whole = as_values(x, logical, sync_free=sync_free)
    pieces = []
    for off, size in boxes(shape, cuts):
        sl = tuple(slice(o, o + s) for o, s in zip(off, size))
        layout = PieceLayout(shape, off, size, replica=replicas)
        piece = x[sl] if sl else x
        d = as_values(piece, layout, sync_free=sync_free)
        if replicas:  # another rank's copy: bitwise the same digest
            copy = as_values(piece.clone(), layout, sync_free=sync_free)
            assert copy.fingerprint == d.fingerprint and np.array_equal(copy.sketch, d.sketch)
        pieces.append(d)
    merged = merge_disjoint(pieces)
    real = torch.view_as_real(x) if x.is_complex() else x
    scale = (float(real.double().nan_to_num(0, 0, 0).abs().sum())
             if has_moments(x.dtype) and x.numel() else 0.0)
    assert_same_digest(merged, whole, scale)
    if x.is_complex():
        assert whole.numel == 2 * x.numel()


@settings(max_examples=40, deadline=None)
@given(tilings(), st.integers(0, 2**31), st.integers(2, 4))
def test_partial_addends_merge_to_sum(tiling, seed, n_addends):
    """Partial addends: the sum and the sketch of the region are exact, the rest is marked."""
    shape, cuts = tiling
    g = torch.Generator().manual_seed(seed)
    addends = [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(n_addends)]
    total = sum(addends[1:], addends[0])
    whole = as_values(total, PieceLayout.full(shape))
    boxes_digests = []
    for off, size in boxes(shape, cuts):
        sl = tuple(slice(o, o + s) for o, s in zip(off, size))
        layout = PieceLayout(shape, off, size, partial=True)
        parts = [as_values(a[sl] if sl else a, layout) for a in addends]
        boxes_digests.append(merge_partial(parts))
    merged = merge_disjoint(boxes_digests)
    scale = float(sum(a.abs().sum() for a in addends))
    assert merged.numel == whole.numel
    assert abs(merged.sum - whole.sum) <= 1e-12 * scale + 1e-300
    np.testing.assert_allclose(merged.sketch, whole.sketch, rtol=0, atol=1e-12 * scale + 1e-300)
    assert not merged.exact and math.isnan(merged.sum_sq) if whole.numel else True


def test_large_noncontiguous_piece_crosses_chunks(small_chunks):
    """Chunking of a transposed 2-D piece inside a 3-D tensor changes nothing."""
    x = torch.randn(4, 7, 9)
    whole = as_values(x, PieceLayout.full(x.shape))
    pieces = []
    for a, b in ((0, 3), (3, 7)):
        piece = x[:, a:b, :].transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous view
        assert not piece.is_contiguous()
        pieces.append(as_values(piece, PieceLayout(tuple(x.shape), (0, a, 0), tuple(piece.shape))))
    assert_same_digest(merge_disjoint(pieces), whole, float(x.abs().sum()))


# ----------------------------------------------------------------- position awareness


def test_fingerprint_detects_one_ulp_and_sign_of_zero():
    x = torch.randn(1000)
    layout = PieceLayout.full((1000,))
    base = as_values(x, layout).fingerprint
    y = x.clone()
    y[517] = torch.nextafter(y[517], torch.tensor(math.inf))
    assert as_values(y, layout).fingerprint != base
    z = torch.zeros(4)
    nz = z.clone()
    nz[2] = -0.0
    d0, d1 = as_values(z, PieceLayout.full((4,))), as_values(nz, PieceLayout.full((4,)))
    assert d0.fingerprint != d1.fingerprint
    assert d0.zeros == d1.zeros == 4


@pytest.mark.parametrize("dtype,n", [(torch.float64, 4096), (torch.int64, 1 << 12),
                                     (torch.float32, 1 << 16), (torch.bfloat16, 1 << 16)])
def test_fingerprint_sees_a_uniform_change_of_a_power_of_two_count(dtype, n):
    """Geometric keys sum to a multiple of 2**t over 2**t consecutive indices, so a change that
    adds one multiple of a high power of two to every bit pattern (doubling float64 values adds
    2**52; an int64 offset of 2**60) would cancel; V = mix64(bits) for 64-bit elements is what
    keeps it visible. 16/32-bit floats enter unmixed: their differences stay below 2**32."""
    g = torch.Generator().manual_seed(5)
    x = (torch.rand(n, generator=g, dtype=torch.float64) + 1.0)
    if dtype == torch.int64:
        a, b = (x * 1000).to(dtype), (x * 1000).to(dtype) + (1 << 60)
    else:
        a, b = x.to(dtype), (x * 2).to(dtype)
    layout = PieceLayout.full((n,))
    assert as_values(a, layout).fingerprint != as_values(b, layout).fingerprint


def test_fingerprint_detects_swap_hash_tensor_does_not():
    x = torch.randn(64)
    y = x.clone()
    y[[3, 40]] = y[[40, 3]]
    layout = PieceLayout.full((64,))
    assert as_values(x, layout).fingerprint != as_values(y, layout).fingerprint
    # torch.hash_tensor: XOR of float64-upcast bits, blind to order and to pairs that cancel
    assert torch.hash_tensor(x) == torch.hash_tensor(y)
    pair = torch.tensor([1.25, 1.25])
    assert int(torch.hash_tensor(pair)) == 0
    assert as_values(pair, PieceLayout.full((2,))).fingerprint != 0


def test_fingerprint_depends_on_place_in_logical_tensor():
    """Same values at another offset are another piece of the tensor."""
    x = torch.randn(3, 4)
    a = as_values(x, PieceLayout((6, 4), (0, 0), (3, 4))).fingerprint
    b = as_values(x, PieceLayout((6, 4), (3, 0), (3, 4))).fingerprint
    assert a != b


# ----------------------------------------------------------------- inputs users pass


def test_does_not_modify_input_and_handles_requires_grad():
    x = torch.randn(10, 10, requires_grad=True)
    x_nan = x.detach().clone()
    x_nan[0, 0] = math.nan
    before = x_nan.clone()
    f, i = digest_piece(x_nan, PieceLayout.full((10, 10)))
    assert torch.equal(before.nan_to_num(7.0), x_nan.nan_to_num(7.0))
    assert i[1] == 1
    f, i = digest_piece(x * 2, PieceLayout.full((10, 10)))  # inside a graph
    assert not f.requires_grad and not i.requires_grad


def test_noncontiguous_equals_contiguous():
    x = torch.randn(33, 17)
    t = x.t()
    layout = PieceLayout.full(tuple(t.shape))
    a = as_values(t, layout)
    b = as_values(t.contiguous(), layout)
    assert a.fingerprint == b.fingerprint
    np.testing.assert_allclose(a.sketch, b.sketch, rtol=0, atol=1e-12 * float(x.abs().sum()))


def test_zero_dim_and_empty():
    loss = torch.tensor(2.5)
    d = as_values(loss, PieceLayout.full(()))
    assert (d.numel, d.sum, d.min, d.max, d.abs_max) == (1, 2.5, 2.5, 2.5, 2.5)
    # a per-rank scalar as element dp_rank of a logical vector (batch_layout)
    d1 = as_values(loss, PieceLayout((4,), (1,), (1,)))
    assert d1.sum == 2.5 and d1.fingerprint != d.fingerprint
    e = as_values(torch.empty(0, 5), PieceLayout.full((0, 5)))
    assert (e.numel, e.fingerprint, e.min, e.max, e.abs_max) == (0, 0, math.inf, -math.inf, 0.0)
    assert not e.sketch.any()


def test_all_nonfinite_piece():
    t = torch.tensor([math.nan, math.inf, -math.inf, math.nan])
    for sync_free in (False, True):
        d = as_values(t, PieceLayout.full((4,)), sync_free=sync_free)
        assert (d.nan, d.posinf, d.neginf, d.zeros) == (2, 1, 1, 0)
        assert (d.sum, d.sum_sq, d.min, d.max, d.abs_max) == (0.0, 0.0, math.inf, -math.inf, 0.0)
        assert not d.sketch.any()


def test_int_and_bool_rows():
    f, i = digest_piece(torch.tensor([True, False, False]), PieceLayout.full((3,)))
    assert f.shape == (5 + DEFAULT_SKETCH_K,)
    assert f[:5].tolist() == [0.0, 0.0, math.inf, -math.inf, 0.0] and not f[5:].any()
    assert i[:5].tolist() == [3, 0, 0, 0, 2]
    assert not has_moments(torch.int64) and has_moments(torch.bfloat16)
    assert has_moments(torch.complex64)


def test_complex_accepts_either_layout():
    z = torch.randn(4, 3, dtype=torch.complex64)
    layout = PieceLayout((8, 3), (4, 0), (4, 3))
    a = digest_piece(z, layout)
    b = digest_piece(torch.view_as_real(z), complex_real_layout(layout))
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])
    assert a[1][0] == 24


def test_rejects_mismatched_shape_and_bad_k():
    with pytest.raises(ValueError, match="shape"):
        digest_piece(torch.zeros(3, 4), PieceLayout.full((4, 3)))
    with pytest.raises(ValueError, match="sketch_k"):
        digest_piece(torch.zeros(3), PieceLayout.full((3,)), sketch_k=100)
    # size-1 dims may differ: a [1, n] view of an [n] piece reads the same order
    a = digest_piece(torch.arange(6.0).view(1, 6), PieceLayout.full((6,)))
    b = digest_piece(torch.arange(6.0), PieceLayout.full((6,)))
    assert torch.equal(a[1], b[1])


def test_sync_free_path_agrees_with_cpu_path():
    """The accelerator path (no host reads, index_add_) gives the same digest on CPU."""
    x = torch.randn(3000)
    x[10] = math.nan
    x[20] = -math.inf
    layout = PieceLayout((5000,), (1000,), (3000,))
    a = as_values(x, layout, sync_free=False)
    b = as_values(x, layout, sync_free=True)
    assert_same_digest(a, b, float(x.nan_to_num(0, 0, 0).abs().sum()))


def test_batch_to_host():
    rows = [digest_piece(torch.randn(5), PieceLayout.full((5,))) for _ in range(3)]
    f, i, event = digest_batch_to_host([r[0] for r in rows], [r[1] for r in rows])
    assert f.shape == (3, 5 + DEFAULT_SKETCH_K) and i.shape == (3, 6) and event is None
    assert f.device.type == "cpu" and torch.equal(i[1], rows[1][1])
    with pytest.raises(ValueError, match="sketch_k"):
        digest_batch_to_host([rows[0][0], torch.zeros(5 + 8, dtype=torch.float64)],
                             [rows[0][1], rows[1][1]])
