"""The fused CPU kernel against the eager reference (agents/digest/digest.py): fingerprints, counts,
min/max/abs-max bitwise equal; float64 moments and sketch buckets equal within float64 rounding.

Hypothesis runs derandomized (fixed examples every run) so the suite is deterministic.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from numaudit.agents.digest.digest import N_MOMENTS, _digest
from numaudit.agents.digest.fastpath import Digester
from numaudit.agents.digest.rows import RowBatch
from numaudit.agents.kernels import build, cpu
from numaudit.agents.layout import PieceLayout, batch_layout, complex_real_layout

K = 16
FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
INTS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool, torch.uint16,
        torch.uint32, torch.uint64]
COMPLEX = [torch.complex64, torch.complex128]
PROFILE = settings(derandomize=True, max_examples=150, deadline=None,
                   suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    """`make test` builds the kernel first; a missing library is a failure here, not a skip."""
    assert cpu.load() is not None, cpu.load_error()


def assert_same(t: torch.Tensor, layout: PieceLayout, k: int = K) -> None:
    ref64, ref_i64 = _digest(t, layout, k, sync_free=None)
    got64, got_i64 = cpu.digest_piece_fused(t, layout, sketch_k=k)
    assert torch.equal(got_i64, ref_i64), (got_i64.tolist(), ref_i64.tolist())
    # min, max, abs-max: exact values (+0.0 and -0.0 tie in both implementations)
    assert torch.equal(got64[2:N_MOMENTS], ref64[2:N_MOMENTS]), (got64[:5], ref64[:5])
    # sums: float64 rounding of sums in another order, bounded by n * eps * sum|terms|
    x = (torch.view_as_real(t) if t.is_complex() else t).detach().reshape(-1)
    if x.is_floating_point() and x.numel():
        f = x.to(torch.float64)
        f = torch.where(torch.isfinite(f), f, 0.0)
        bound = 4 * max(x.numel(), 1) * 2.0 ** -52
        abs_sum, sq_sum = f.abs().sum().item(), (f * f).sum().item()
        assert abs(got64[0] - ref64[0]) <= bound * abs_sum + 1e-300
        assert abs(got64[1] - ref64[1]) <= bound * sq_sum + 1e-300
        err = (got64[N_MOMENTS:] - ref64[N_MOMENTS:]).abs().max().item()
        assert err <= bound * abs_sum + 1e-300, err
    else:
        assert torch.equal(got64, ref64)


def _values(dtype: torch.dtype, shape: tuple[int, ...], seed: int,
            specials: list[int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype.is_floating_point or dtype.is_complex:
        base = torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** (seed % 7 - 3)
        if dtype.is_complex:
            base = torch.complex(base, torch.randn(n, generator=g, dtype=torch.float64))
        t = base.to(dtype)
        view = torch.view_as_real(t) if t.is_complex() else t
        flat = view.reshape(-1)
        for j, p in enumerate(specials):
            if flat.numel():
                flat[p % flat.numel()] = (math.nan, math.inf, -math.inf, 0.0, -0.0)[j % 5]
    elif dtype == torch.bool:
        t = torch.randint(0, 2, (n,), generator=g).bool()
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(max(info.min, -(2 ** 62)), min(info.max, 2 ** 62), (n,), generator=g,
                          dtype=torch.int64).to(dtype)
    return t.reshape(shape)


@st.composite
def pieces(draw):
    """A piece tensor (possibly non-contiguous) and its layout inside a larger logical tensor."""
    dtype = draw(st.sampled_from(FLOATS + INTS + COMPLEX))
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    extra = tuple(draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim)))
    offsets = tuple(draw(st.integers(0, e)) for e in extra)
    logical = tuple(s + e for s, e in zip(shape, extra))
    layout = PieceLayout(logical_shape=logical, offsets=offsets, shape=shape)
    specials = draw(st.lists(st.integers(0, 10 ** 6), max_size=4))
    t = _values(dtype, shape, draw(st.integers(0, 2 ** 16)), specials)
    how = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    if how == "transposed" and ndim >= 2:
        t = t.transpose(0, 1).contiguous().transpose(0, 1)  # same values, column-major memory
    elif how == "strided" and ndim >= 1:
        wide = torch.zeros((*shape[:-1], 2 * shape[-1] + 1), dtype=t.dtype)
        wide[..., 1::2] = t
        t = wide[..., 1::2]
    return t, layout


@PROFILE
@given(pieces())
def test_fused_equals_eager(piece):
    t, layout = piece
    assert_same(t, layout)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", [0, 1, 511, 512, 513, 300_001])
def test_sizes_across_blocks_and_chunks(dtype, n):
    t = _values(dtype, (n,), n, [7, 1000, 4096, 299_999, 12])
    assert_same(t, PieceLayout.full((n,)), k=256)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_noncontiguous_and_batch_split(dtype):
    t = _values(dtype, (700, 600), 3, [5, 70_000]).t()  # 420k elements, column-major
    assert_same(t, PieceLayout((600, 1400), (0, 700), (600, 700)), k=256)
    u = _values(dtype, (8, 3, 5), 4, [1])
    assert_same(u, batch_layout((8, 3, 5), dp_rank=2, dp_size=4))


@pytest.mark.parametrize("k", [1, 2, 4, 8, 64, 4096, 8192])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.int32])
def test_every_sketch_size_at_unaligned_offsets(dtype, k):
    """k < 8 takes the scalar loop, k >= 8 the vector one (bucket groups of 8 lanes); a shard
    starting mid-block gives the vector loop a scalar head and tail around whole groups. Up to
    4096 buckets the kernel accumulates in an aligned stack buffer, past it in the row itself."""
    t = _values(dtype, (3, 1000), k, [17, 2500])
    assert_same(t, PieceLayout((5, 1003), (1, 3), (3, 1000)), k=k)
    assert_same(t.t().contiguous().t(), PieceLayout((5, 1003), (1, 3), (3, 1000)), k=k)


def test_runs_crossing_the_32_bit_index_boundary():
    # Row 1 of a logical (4, 2**31 + 64) tensor starts at 2**31 + 64, so its columns from
    # 2**31 - 84 on start at global index 2**32 - 20: block indices past 2**24 and a run that
    # straddles 2**32 (where version 1 of the scheme changed its hash's high word).
    layout = PieceLayout((4, 2 ** 31 + 64), (1, 2 ** 31 - 84), (2, 40))
    t = _values(torch.float32, (2, 40), 9, [3])
    assert_same(t, layout)
    assert_same(t.t().contiguous().t(), layout)


def test_all_nonfinite_and_size_one_dims():
    t = torch.tensor([math.nan, math.inf, -math.inf], dtype=torch.float32)
    assert_same(t, PieceLayout.full((3,)))
    # a tensor with extra size-1 dims against its layout, as digest_piece accepts
    u = _values(torch.float32, (1, 5, 1), 1, [])
    assert_same(u, PieceLayout((10,), (5,), (5,)))


def test_complex_with_either_layout():
    t = _values(torch.complex64, (4, 3), 2, [1])
    assert_same(t, PieceLayout.full((4, 3)))
    assert_same(t, complex_real_layout(PieceLayout.full((4, 3))))


def test_batch_call_equals_one_call_per_piece():
    items = [(_values(d, (5, 7), i, [i]), PieceLayout.full((5, 7)))
             for i, d in enumerate(FLOATS + INTS)]
    rows = RowBatch(len(items) + 3, K)
    rows.reserve(2)  # the batch's rows land after those already in it
    got = Digester("auto").digest([(t, layout, 0) for t, layout in items], K, rows)
    assert got == list(range(2, 2 + len(items)))
    f64, i64 = rows.rows()
    for (t, layout), r in zip(items, got):
        one64, one_i64 = cpu.digest_piece_fused(t, layout, sketch_k=K)
        assert torch.equal(i64[r], one_i64) and torch.equal(f64[r], one64)


def _payload_via_kernel(t: torch.Tensor, layout: PieceLayout) -> torch.Tensor:
    """The payload bytes the kernel copies while digesting ``t`` (a real or real-viewed piece)."""
    out = torch.full((t.numel() * t.element_size() + 8,), 0xA5, dtype=torch.uint8)
    rows = RowBatch(1, K)
    got = Digester("auto").digest([(t, layout, out.data_ptr())], K, rows)
    assert got == [0]
    assert torch.equal(out[-8:], torch.full((8,), 0xA5, dtype=torch.uint8))  # nothing past the end
    return out[:-8]


@PROFILE
@given(pieces())
def test_payload_copied_by_the_kernel_is_the_contiguous_bytes(piece):
    t, layout = piece
    if t.is_complex():
        t, layout = torch.view_as_real(t), complex_real_layout(layout)
    want = t.contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(_payload_via_kernel(t, layout), want)


def test_payload_of_expanded_and_size_one_pieces():
    t = torch.arange(3, dtype=torch.float32).reshape(3, 1).expand(3, 4)  # stride 0
    layout = PieceLayout.full((3, 4))
    assert torch.equal(_payload_via_kernel(t, layout), t.contiguous().view(torch.uint8).reshape(-1))
    u = _values(torch.bfloat16, (1, 5, 1), 1, [])
    assert torch.equal(_payload_via_kernel(u, PieceLayout((10,), (5,), (5,))),
                       u.contiguous().reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("special", [math.nan, math.inf, -math.inf])
def test_a_nonfinite_element_late_in_a_piece_redoes_it_whole(dtype, special):
    """The vector loop's first pass assumes finite elements; a NaN or infinity in a later run of
    a strided piece (its earlier runs finite) sends the whole piece to the masked pass again:
    the rows are the eager digest's, with the piece's every run counted once, and the payload
    copied in the first pass holds every element."""
    t = _values(dtype, (6, 520), 11, [])
    t[4, 300] = special
    piece = t[:, 4:516]  # six runs of 512 elements, 2080 bytes apart
    layout = PieceLayout((6, 512), (0, 0), (6, 512))
    assert_same(piece, layout, k=256)
    want = piece.contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(_payload_via_kernel(piece, layout), want)


def test_op_is_registered_with_a_fake_implementation():
    t = _values(torch.float32, (3, 4), 0, [])
    base, gs = cpu.index_map((3, 4), PieceLayout.full((3, 4)))
    torch.library.opcheck(torch.ops.numaudit.digest_batch.default, ([t, t.t()], [base, base],
                          [*gs, *gs], K))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        f64, i64 = torch.ops.numaudit.digest_batch([mode.from_tensor(t)], [0], [4, 1], K)
    assert f64.shape == (1, N_MOMENTS + K) and i64.shape == (1, 6)


def test_stale_library_is_refused_with_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(build, "LIBRARY", tmp_path / "missing.so")
    monkeypatch.setattr(cpu, "_loaded", False)
    monkeypatch.setattr(cpu, "_lib", None)
    with caplog.at_level(logging.WARNING):
        assert cpu.load() is None
        assert cpu.load() is None
        digester = Digester("auto")
    assert not digester.fused
    assert sum("eager path" in r.message for r in caplog.records) == 1
    t = _values(torch.float32, (6,), 0, [])
    rows = RowBatch(1, K)
    assert digester.digest([(t, PieceLayout.full((6,)), 0)], K, rows) == [0]
    ref64, ref_i64 = _digest(t, PieceLayout.full((6,)), K, sync_free=None)
    assert torch.equal(rows.i64[0], ref_i64)  # the eager row, copied into the batch


def test_a_library_is_stale_by_its_sources_not_by_file_times(tmp_path):
    """An installed wheel's files all carry the install's time, so the library may look older
    than its sources: it is still the one built from them. Built from other sources, or
    with no stamp saying what it was built from, it is refused."""
    lib = tmp_path / build.LIBRARY.name
    lib.write_bytes(b"not loaded here")
    assert build.stale(lib)  # no stamp
    build.stamp_of(lib).write_text(build.sources_digest() + "\n")
    os.utime(lib, (1, 1))  # far older than every source
    assert not build.stale(lib)
    build.stamp_of(lib).write_text("0" * 64 + "\n")
    assert build.stale(lib)


def test_rejects_bad_k_and_bad_layout():
    t = torch.ones(4)
    with pytest.raises(ValueError, match="sketch_k"):
        cpu.digest_rows([t], [0], [1], 3)
    with pytest.raises(ValueError, match="shape"):
        cpu.index_map((4,), PieceLayout.full((5,)))


ISA_LEVELS = (3, 1)
"""The lower builds checked in child processes (3: AVX2, 1: baseline)."""


@pytest.fixture(scope="module")
def isa_children():
    """One child pytest per ISA level this CPU can run, all started at once: each keeps about
    one core busy, so on a machine with a core to spare they cost about the slower one's time
    instead of the sum. Each test below waits for its own."""
    children = {}
    for isa in ISA_LEVELS:
        if cpu.isa_level() >= isa:
            children[isa] = subprocess.Popen(
                [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
                 "-k", "sizes or every_sketch or noncontiguous or crossing"],
                env=dict(os.environ, NUMAUDIT_DIGEST_ISA=str(isa)), stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True)
    try:
        yield children
    finally:
        for child in children.values():
            if child.poll() is None:
                child.kill()
            child.communicate()


@pytest.mark.parametrize("isa", ISA_LEVELS)
def test_every_isa_build_agrees_with_eager(isa, isa_children):
    """The library holds an AVX-512, an AVX2 and a baseline build, and a CPU runs only its best:
    run this file's equality tests again in a child process pinned to each lower build
    (NUMAUDIT_DIGEST_ISA), so every build is checked on one machine."""
    if cpu.isa_level() < isa:
        pytest.skip(f"this CPU cannot run the ISA level {isa} build")
    env = dict(os.environ, NUMAUDIT_DIGEST_ISA=str(isa))
    child = isa_children[isa]
    output, _ = child.communicate(timeout=600)
    assert child.returncode == 0, output[-5000:]
    probe = subprocess.run([sys.executable, "-c", "from numaudit.agents.kernels import cpu; "
                            "print(cpu.isa_level())"], env=env, capture_output=True, text=True)
    assert probe.stdout.strip() == str(isa)
