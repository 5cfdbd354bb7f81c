"""The Triton digest (agents/kernels/digest_triton.py) against the eager reference, under
Triton's CPU interpreter when there is no GPU, within the accelerator contract (docs/digests.md
"On an accelerator"): fingerprints, counts, min/max/abs-max bitwise equal; sums, sums of
squares and sketch buckets within the float32-tile bound of their terms' magnitudes, bucket by
bucket; the same bits twice. One test also holds it to the pure-Python definition of hash
scheme v3 (agents/digest/hashing.py): keys ``u * h**i`` for indices up to 2**63 (every byte of the
block power table), ``V(x)`` through mix64 or not per dtype.

The cases aim at what v3 makes position-dependent: pieces that start mid-block and cross
256-element block boundaries (one line), strided and sharded pieces (many lines), sketches of 1
bucket up to more buckets than a block has lanes; and at the kernels' own machinery: launch
groups, tiles, the float64 pass, vector reads, the row arena, the launch through compiled
handles, and compiling every kind of variant for a GPU (what the interpreter cannot check).

`make test` installs triton (the dev extras) and runs these under the interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton, when there is no
GPU); they skip where triton is not installed. On a machine with a GPU the same tests run the
compiled kernels on it (``python -m bench.gpu --pytest`` does that too). The interpreter is
slow, so the pieces are small (a few blocks each).
"""

from __future__ import annotations

import importlib.util
import itertools
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


from numaudit.agents.digest import hashing  # noqa: E402
from numaudit.agents.digest.digest import N_MOMENTS, _digest  # noqa: E402
from numaudit.agents.kernels.accel import term_magnitudes, within_contract  # noqa: E402
from numaudit.agents.kernels.triton_plan import MIN_TILE_ROWS, plan_piece, tiling  # noqa: E402
from numaudit.agents.layout import PieceLayout, batch_layout  # noqa: E402

K = 16
SKETCH_KS = [1, 8, 256, 4096]
"""One bucket, fewer buckets than lanes (lanes of a block share buckets), one bucket per lane,
more buckets than lanes."""

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool]
"""uint16/32/64 are read by the kernel but not by the eager reference on CPU (no
count_nonzero for them): test_wide_unsigned_ints_enter_by_value covers them."""

NONFINITE_AT = (3, 17, 40, 41, 90, 300, 511, 777)
"""Where float test values get NaN, Inf, -Inf, 0.0, -0.0 (cycled): several blocks have some."""


@pytest.fixture(scope="module")
def triton_digest():
    import numaudit.agents.kernels.digest_triton as mod

    return mod


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _values(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        t = (torch.randn(n, generator=g, dtype=torch.float64) * 3).to(dtype)
        specials = (math.nan, math.inf, -math.inf, 0.0, -0.0)
        for j, p in enumerate(NONFINITE_AT):
            if p < n:
                t[p] = specials[j % len(specials)]
        return t
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2 ** 62)), min(info.max, 2 ** 62), (n,), generator=g,
                         dtype=torch.int64).to(dtype)


def _assert_same(mod, t: torch.Tensor, layout: PieceLayout, k: int = K) -> None:
    _assert_rows(mod.digest_piece_triton(t.to(_device()), layout, sketch_k=k), t, layout, k)


def _assert_rows(got, t: torch.Tensor, layout: PieceLayout, k: int = K) -> None:
    """Rows ``got`` are the eager reference's digest of ``t`` within the contract
    (agents/kernels/accel.py ``within_contract``): bitwise where it says so, sums and sketch
    buckets within the float32-tile bound of their terms' magnitudes."""
    want = _digest(t, layout, k, sync_free=None)
    got = got[0].cpu().reshape(want[0].shape), got[1].cpu().reshape(want[1].shape)
    assert torch.equal(got[1], want[1]), (got[1].tolist(), want[1].tolist())
    assert torch.equal(got[0][2:N_MOMENTS], want[0][2:N_MOMENTS]), (got[0][:5], want[0][:5])
    assert within_contract(got, want, term_magnitudes(t, layout, k)), (got[0], want[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 97, 2500])
def test_triton_equals_eager(triton_digest, dtype, n):
    t = _values(dtype, n, n)
    _assert_same(triton_digest, t, PieceLayout.full((n,)))


@pytest.mark.parametrize("k", SKETCH_KS)
@pytest.mark.parametrize("offset, size", [(37, 700), (255, 2), (5 * 256 - 1, 258), (256, 1030)])
def test_contiguous_pieces_at_unaligned_offsets(triton_digest, k, offset, size):
    """A run of consecutive indices starting anywhere in a block (aligned path: tiles of whole
    blocks, masked at both ends)."""
    layout = PieceLayout((offset + size + 13,), (offset,), (size,))
    _assert_same(triton_digest, _values(torch.float32, size, offset), layout, k)
    _assert_same(triton_digest, _values(torch.int32, size, offset), layout, k)


@pytest.mark.parametrize("k, dtype", [
    (k, dtype) for k in SKETCH_KS for dtype in (torch.bfloat16, torch.float64, torch.int16)
    # integers have no sketch: k changes nothing of theirs the kernel computes differently
    # but the rows a loop step reads (one above 256 buckets), which k = 4096 covers for floats
    if not (dtype == torch.int16 and k > 256)])
def test_strided_and_sharded_pieces(triton_digest, k, dtype):
    # A column shard whose rows start mid-block (general path, contiguous memory).
    _assert_same(triton_digest, _values(dtype, 6 * 130, 1).reshape(6, 130),
                 PieceLayout((6, 300), (0, 100), (6, 130)), k)
    # Column-major memory, placed at an offset in both dims.
    t = _values(dtype, 30 * 40, 2).reshape(30, 40).t()
    _assert_same(triton_digest, t, PieceLayout((50, 90), (3, 60), (40, 30)), k)
    # Every other element of a buffer, consecutive in the logical tensor (aligned, stride 2).
    u = _values(dtype, 2 * 601, 3)[::2]
    _assert_same(triton_digest, u, PieceLayout((2000,), (517,), (601,)), k)
    # Three merged dims, permuted memory: an inner box of a 3-D tensor.
    w = _values(dtype, 3 * 5 * 40, 4).reshape(40, 3, 5).permute(1, 2, 0)
    _assert_same(triton_digest, w, PieceLayout((4, 7, 200), (1, 2, 33), (3, 5, 40)), k)
    # Strided rows of a batch split.
    v = _values(dtype, 2 * 601, 5).reshape(2, 601)[:, ::2]
    _assert_same(triton_digest, v, batch_layout((2, 301), dp_rank=1, dp_size=3), k)
    # Broadcast views (stride 0), as expand() and the gradients of broadcast ops give them:
    # every logical element is read, some of them from one address.
    _assert_same(triton_digest, _values(dtype, 300, 6).expand(4, 300), PieceLayout.full((4, 300)),
                 k)
    _assert_same(triton_digest, _values(dtype, 5, 7).reshape(5, 1).expand(5, 600),
                 PieceLayout((10, 600), (5, 0), (5, 600)), k)


def test_all_nonfinite_piece(triton_digest):
    t = torch.tensor([math.nan, math.inf, -math.inf] * 100, dtype=torch.float32)
    _assert_same(triton_digest, t, PieceLayout((400,), (50,), (300,)))


@pytest.mark.parametrize("layout", [
    PieceLayout((4, 2 ** 31 + 64), (1, 2 ** 31 - 84), (2, 40)),  # general path
    PieceLayout((2 ** 33,), (2 ** 32 - 300,), (600,)),  # aligned path
])
def test_index_crossing_2_to_the_32(triton_digest, layout):
    t = _values(torch.float32, layout.numel, 9).reshape(layout.shape)
    _assert_same(triton_digest, t, layout, 256)


def _python_values(t: torch.Tensor) -> list[int]:
    """``V(x)`` of every element of ``t`` (flat order) from hashing.value_term: floats by their
    bit pattern, integers and bool by their value."""
    flat = t.reshape(-1)
    if t.dtype.is_floating_point:
        width = 8 * t.element_size()
        view = {16: torch.int16, 32: torch.int32, 64: torch.int64}[width]
        bits = [b & ((1 << width) - 1) for b in flat.view(view).tolist()]
    else:
        bits = [int(x) for x in flat.tolist()]
    return [hashing.value_term(b, hashing.mixed_dtype(t.dtype)) for b in bits]


DEFINITION_DTYPES = [torch.int64, torch.int32, torch.float64, torch.float32, torch.bfloat16,
                     torch.bool]
"""Mixed (integers of two widths, float64, bool) and unmixed (narrow floats) values."""


@pytest.mark.parametrize("offsets, shape, logical", [
    ((250,), (300,), (1000,)),  # aligned path
    ((1, 100), (2, 130), (3, 300)),  # general path
    # Blocks of 2**32 and more (byte 4 of the block on; 2**40 crossed inside the piece).
    ((2 ** 40 - 150,), (300,), (2 ** 41,)),
    ((1, 2 ** 40 - 60), (2, 130), (3, 2 ** 41)),
    # Blocks near 2**54 (bytes 0..6 of the power table: indices up to about 2**63).
    ((2 ** 62 - 400,), (300,), (2 ** 62,)),
    ((1, 2 ** 61 - 200), (2, 130), (3, 2 ** 61)),
])
def test_matches_hash_scheme_definition(triton_digest, offsets, shape, logical):
    """Fingerprint and sketch from agents/digest/hashing.py's pure-Python key, value_term and
    bucket_sign, for every dtype rule of ``V`` (one list, several launch groups) and indices
    far out (block bytes above the first two); the sketch with fewer buckets than a block's
    lanes and with more (the placement table and the block word's bits above the lanes both
    pick the bucket)."""
    layout = PieceLayout(logical, offsets, shape)
    n = layout.numel
    gstrides = [math.prod(logical[d + 1:]) for d in range(len(logical))]
    index = [sum((o + c) * g for o, c, g in zip(offsets, coords, gstrides))
             for coords in itertools.product(*(range(s) for s in shape))]
    keys = [hashing.key(g) for g in index]
    pieces = [_values(dtype, n, 11 + j).reshape(shape) for j, dtype in enumerate(DEFINITION_DTYPES)]
    _, got_i64 = triton_digest.digest_pieces_triton([(t.to(_device()), layout) for t in pieces],
                                                    sketch_k=K)
    for j, t in enumerate(pieces):
        fp = sum(k * v for k, v in zip(keys, _python_values(t))) & hashing.M64
        assert int(got_i64[j, 5]) & hashing.M64 == fp, t.dtype
    floats = _values(torch.float64, n, 12)
    for k in (8, 4096):
        got64, _ = triton_digest.digest_piece_triton(floats.reshape(shape).to(_device()),
                                                     layout, sketch_k=k)
        sketch = [0.0] * k
        for g, v in zip(index, floats.tolist()):
            bucket, minus = hashing.bucket_sign(g, k)
            if math.isfinite(v):
                sketch[bucket] += -v if minus else v
        want = torch.tensor(sketch, dtype=torch.float64)
        assert torch.allclose(got64.cpu()[N_MOMENTS:], want, rtol=1e-12, atol=1e-12), k


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_wide_unsigned_ints_enter_by_value(triton_digest, dtype):
    """The eager reference cannot read these on CPU; the digest of their values must be the
    int64 digest of the same values (checked against eager above)."""
    layout = PieceLayout((900,), (100,), (700,))
    values = _values(torch.int64, 700, 13).abs() % min(torch.iinfo(dtype).max + 1, 2 ** 62)
    values[::7] = 0
    got = triton_digest.digest_piece_triton(values.to(dtype).to(_device()), layout, sketch_k=K)
    want = triton_digest.digest_piece_triton(values.to(_device()), layout, sketch_k=K)
    assert all(torch.equal(g.cpu(), w.cpu()) for g, w in zip(got, want))
    assert int(want[1][4]) == 100  # zeros


def test_rejects_too_many_dims_and_bad_k(triton_digest):
    layout = PieceLayout((4, 5, 6, 7, 8), (0, 0, 0, 0, 0), (2, 2, 2, 2, 2))  # 5 unmergeable dims
    with pytest.raises(ValueError, match="shape"):
        triton_digest.digest_piece_triton(torch.zeros(layout.shape), layout, sketch_k=K)
    with pytest.raises(ValueError, match="sketch_k"):
        triton_digest.digest_piece_triton(torch.zeros(3), PieceLayout.full((3,)), sketch_k=12)


def test_complex_is_digested_as_its_real_view(triton_digest):
    re, im = _values(torch.float32, 300, 1), _values(torch.float32, 300, 2)
    t = torch.complex(re, im).reshape(100, 3)
    layout = PieceLayout((200, 3), (50, 0), (100, 3))
    ref64, ref_i64 = _digest(t, layout, K, sync_free=None)
    got64, got_i64 = triton_digest.digest_piece_triton(t.to(_device()), layout, sketch_k=K)
    assert torch.equal(got_i64.cpu(), ref_i64)
    assert torch.equal(got64.cpu()[2:N_MOMENTS], ref64[2:N_MOMENTS])


# -- lists of pieces: what a hook hands over, digested in a few launches ------------------------

def _mixed_pieces() -> list[tuple[torch.Tensor, PieceLayout]]:
    """Pieces of several tensors (so offsets from the anchor run both ways), dtypes (several
    launch groups), both index paths and empty pieces, in an order that interleaves them."""
    big = _values(torch.float32, 6 * 700, 21).reshape(6, 700)
    other = _values(torch.float32, 999, 22)
    half = _values(torch.bfloat16, 40 * 30, 23).reshape(40, 30)
    return [
        (other, PieceLayout.full((999,))),
        (big[1:4], PieceLayout((6, 700), (1, 0), (3, 700))),  # aligned, starts mid-block
        (torch.zeros(0), PieceLayout.full((0,))),
        (_values(torch.int32, 300, 24), PieceLayout((1000,), (517,), (300,))),
        (big[:, 100:160].t(), PieceLayout((700, 6), (100, 0), (60, 6))),  # many short lines
        (half.t(), PieceLayout((30, 40), (0, 0), (30, 40))),
        (big, PieceLayout.full((6, 700))),  # the same tensor again, whole
        (torch.zeros(0, dtype=torch.int32), PieceLayout.full((0,))),
        (_values(torch.bool, 257, 25), PieceLayout.full((257,))),
        (other[::3], PieceLayout((1000,), (1,), (333,))),  # aligned, memory stride 3
        (half, PieceLayout((80, 30), (40, 0), (40, 30))),
        (_values(torch.float64, 1, 26), PieceLayout((9,), (8,), (1,))),
        # the same load dtype as bfloat16 (uint16), another float type: its own launch
        (_values(torch.float16, 600, 27), PieceLayout.full((600,))),
    ]


@pytest.mark.parametrize("k", [8, 256])
def test_a_list_of_pieces_gives_each_piece_its_own_digest(triton_digest, k):
    pieces = _mixed_pieces()
    f64, i64 = triton_digest.digest_pieces_triton([(t.to(_device()), lay) for t, lay in pieces],
                                                  sketch_k=k)
    assert f64.shape == (len(pieces), N_MOMENTS + k) and i64.shape == (len(pieces), 6)
    for j, (t, layout) in enumerate(pieces):
        _assert_rows((f64[j], i64[j]), t, layout, k)


def test_types_that_load_alike_keep_their_own_digests_in_one_list(triton_digest):
    """float32 and uint32 load as uint32, bfloat16, float16 and uint16 as uint16, bool and uint8
    as uint8: in one list each keeps its own digest (floats their moments and sketch and their
    bits unmixed, unsigned ints and bool their values through mix64)."""
    layout = PieceLayout((700,), (30,), (600,))
    ints = _values(torch.int64, 600, 51).abs() % 60000
    bools = _values(torch.bool, 600, 55)
    pieces = [_values(torch.bfloat16, 600, 52), _values(torch.float16, 600, 53),
              _values(torch.float32, 600, 54), bools, bools.to(torch.uint8),
              ints.to(torch.uint16), ints.to(torch.uint32)]
    f64, i64 = triton_digest.digest_pieces_triton([(t.to(_device()), layout) for t in pieces],
                                                  sketch_k=K)
    for j, t in enumerate(pieces[:5]):
        _assert_rows((f64[j], i64[j]), t, layout)
    want = triton_digest.digest_piece_triton(ints.to(_device()), layout,
                                             sketch_k=K)  # by value, as int64
    for j in (5, 6):
        assert torch.equal(i64[j], want[1]) and torch.equal(f64[j], want[0]), j


def test_many_pieces_of_one_group_find_their_tiles(triton_digest):
    """70 pieces in one launch, many of them empty or of one tile and a few of several: each
    program's binary search over the pieces' first tiles must land on its own piece (a piece
    that took a neighbour's tile would show in the neighbour's fingerprint and counts)."""
    g = torch.Generator().manual_seed(7)
    sizes = torch.randint(0, 700, (70,), generator=g).tolist()
    sizes[3] = sizes[4] = sizes[40] = sizes[69] = 0
    sizes[10] = sizes[41] = 2 * MIN_TILE_ROWS * hashing.LANES + 300  # three tiles
    pieces = [(_values(torch.float32, n, 100 + j), PieceLayout((n + 300,), (j,), (n,)))
              for j, n in enumerate(sizes)]
    f64, i64 = triton_digest.digest_pieces_triton([(t.to(_device()), lay) for t, lay in pieces],
                                                  sketch_k=K)
    for j, (t, layout) in enumerate(pieces):
        _assert_rows((f64[j], i64[j]), t, layout)


def test_a_piece_of_more_tiles_than_one_finishing_step(triton_digest, monkeypatch):
    """More tile partials than the finishing program reads in one step (FINISH_BLOCK); tiles
    made small so that the interpreter has fewer rows to run."""
    from numaudit.agents.kernels import triton_plan

    monkeypatch.setattr(triton_plan, "MIN_TILE_ROWS", 4)
    n = (triton_digest.FINISH_BLOCK + 3) * 4 * hashing.LANES + 5
    t = _values(torch.float32, n, 31)
    layout = PieceLayout((n + 10,), (3,), (n,))
    assert tiling(plan_piece(t, layout), K)[1] > triton_digest.FINISH_BLOCK
    _assert_same(triton_digest, t, layout)


def test_pieces_on_two_devices_are_refused(triton_digest):
    """One call is one device's launches (the agent groups pieces by device first); "meta"
    stands for a second device, refused before anything is launched."""
    with pytest.raises(ValueError, match="more than one device"):
        triton_digest.digest_pieces_triton(
            [(torch.zeros(3, device=_device()), PieceLayout.full((3,))),
             (torch.zeros(3, device="meta"), PieceLayout.full((3,)))], sketch_k=K)


def test_a_layout_seen_with_other_strides_or_dtype_is_planned_again(triton_digest):
    """Plans are cached per layout, shape, strides and dtype: the same layout object with a
    transposed tensor of the same shape, or another dtype, must not reuse the first plan."""
    layout = PieceLayout((60, 40), (30, 0), (30, 40))
    rows = _values(torch.float32, 1200, 41).reshape(30, 40)
    cols = _values(torch.float32, 1200, 42).reshape(40, 30).t()
    ints = _values(torch.int16, 1200, 43).reshape(30, 40)
    for t in (rows, cols, ints, rows):
        _assert_rows(triton_digest.digest_pieces_triton([(t.to(_device()), layout)],
                                                        sketch_k=K), t, layout)


def test_the_same_pieces_give_the_same_bits_twice(triton_digest):
    """No atomics, fixed orders: a list digested twice gives the same bits, sums and sketch
    included (on a device this is what float atomics would break)."""
    pieces = [(t.to(_device()), lay) for t, lay in _mixed_pieces()[:8]]
    first = triton_digest.digest_pieces_triton(pieces, sketch_k=256)
    again = triton_digest.digest_pieces_triton(pieces, sketch_k=256)
    assert torch.equal(first[1], again[1])
    assert torch.equal(first[0].view(torch.int64), again[0].view(torch.int64))


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the interpreter's float32 pass
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [2.0 ** 64, 2.0 ** -70])
def test_tiles_float32_cannot_sum_are_summed_in_float64(triton_digest, dtype, scale):
    """Elements near 2**64 (float32 squares overflow) or 2**-70 (float32 squares underflow
    entirely): such a tile is summed again in float64, so sums, squares and buckets agree with
    the eager reference to float64 rounding, far inside what float32 could give. Next to them
    a tile of ordinary values stays in float32 (within the contract)."""
    n = 2 * MIN_TILE_ROWS * hashing.LANES
    t = _values(dtype, n, 61)
    t[n // 2:] = (t[n // 2:].to(torch.float64) * scale).to(dtype)
    layout = PieceLayout.full((n,))
    f64, i64 = triton_digest.digest_piece_triton(t.to(_device()), layout, sketch_k=K)
    _assert_rows((f64, i64), t, layout)
    extreme = t[n // 2:]
    sub = PieceLayout((n,), (n // 2,), (n // 2,))
    f64 = triton_digest.digest_piece_triton(extreme.to(_device()), sub, sketch_k=K)[0].cpu()
    want, _ = _digest(extreme, sub, K, sync_free=None)
    f = torch.where(torch.isfinite(extreme.double()), extreme.double(), 0.0)
    assert abs(float(f64[0] - want[0])) <= 1e-12 * float(f.abs().sum())
    assert abs(float(f64[1] - want[1])) <= 1e-12 * float((f * f).sum())
    assert float(f64[1]) > 0
    assert ((f64[N_MOMENTS:] - want[N_MOMENTS:]).abs()
            <= 1e-12 * float(f.abs().sum())).all()


def test_agent_rows_come_from_an_arena_that_is_replaced_when_full(triton_digest, monkeypatch):
    """digest_rows (the agent's call) writes into the device's row arena: lists take
    consecutive rows, and a full arena is replaced without touching rows handed out before."""
    from numaudit.agents.kernels import triton_launch

    monkeypatch.setattr(triton_launch, "ARENA_ROWS", 4)
    pieces = [(t.to(_device()), lay) for t, lay in _mixed_pieces()[:6]]
    got = []
    for chunk in (pieces[:3], pieces[3:5], pieces[5:]):  # the second list does not fit: new
        got += triton_digest.digest_rows([triton_digest.prepare(t, lay) for t, lay in chunk],
                                         sketch_k=K)
    assert got[1][0].data_ptr() - got[0][0].data_ptr() == 8 * (N_MOMENTS + K)
    assert got[3][0].untyped_storage().data_ptr() != got[0][0].untyped_storage().data_ptr()
    for (f64, i64), (t, layout) in zip(got, _mixed_pieces()[:6]):
        _assert_rows((f64, i64), t, layout)


class _Compiled:
    """What Triton's JIT returns on a GPU: the compiled kernel, with its own launcher."""

    function, packed_metadata = "fn", "meta"

    def __init__(self, n_type: str = "i64") -> None:
        self.launches: list[tuple] = []
        self.src = type("Source", (), {"signature": {"x": "*u16", "n": n_type, "K": "constexpr"}})

    def run(self, *args) -> None:
        self.launches.append(args)


class _JitKernel:
    """A stand-in for a @triton.jit kernel on a GPU: launching it compiles it."""

    def __init__(self, n_type: str = "i64") -> None:
        self.compiled = _Compiled(n_type)
        self.jit_launches: list[tuple] = []

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.jit_launches.append((grid, args, options))
            return self.compiled
        return launch


def test_a_variant_is_launched_through_triton_once_then_through_its_handle():
    """The first launch goes through Triton's JIT with tensors (it compiles); later ones call
    the compiled kernel's launcher with addresses and, since Triton 3.3, the constexprs after
    the runtime arguments; hooks and launch metadata None. Under the interpreter every launch
    goes through Triton (there is no compiled kernel)."""
    from numaudit.agents.kernels import triton_launch

    kernel = _JitKernel()
    launch = triton_launch.Launcher(kernel, {"K": 8, "FLOAT": None}, num_warps=8, ints=("n",))
    launch((3, 1), 77, (1000, 5), lambda: ("tensor", 5))
    assert kernel.jit_launches == [((3, 1), ("tensor", 5), {"K": 8, "FLOAT": None,
                                                            "num_warps": 8})]
    launch((4, 2), 78, (2000, 6), lambda: pytest.fail("Triton's launcher used again"))
    extra = (8, None) if triton_launch.ALL_ARGS else ()
    assert kernel.compiled.launches == [(4, 2, 1, 78, "fn", "meta", None, None, None, 2000, 6,
                                         *extra)]
    interpreted = type("InterpretedFunction", (_JitKernel,), {})()
    launch = triton_launch.Launcher(interpreted, {"K": 8}, num_warps=8, ints=("n",))
    for _ in range(2):
        launch((1, 1), 0, (1,), lambda: ("tensor",))
    assert len(interpreted.jit_launches) == 2 and not interpreted.compiled.launches


def test_a_kernel_that_typed_an_integer_int32_keeps_tritons_launcher():
    """A Triton that typed an integer argument by the first call's value (int32 for a small
    one) would truncate a larger one passed through the handle: such a kernel is launched
    through Triton every time, which types and checks each call."""
    from numaudit.agents.kernels import triton_launch

    kernel = _JitKernel(n_type="i32")
    launch = triton_launch.Launcher(kernel, {"K": 8}, num_warps=8, ints=("n",))
    launch((1, 1), 0, (1000, 5), lambda: ("tensor", 5))
    launch((1, 1), 0, (1000, 2 ** 40), lambda: ("tensor", 2 ** 40))
    assert len(kernel.jit_launches) == 2 and not kernel.compiled.launches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_whole_groups_of_8_at_16_bytes_are_read_in_vectors(triton_digest, dtype):
    """A line whose first index and end are multiples of 8, at an address where its rows start
    on 16 bytes, takes the vector path (its masks per group of 8 lanes); the same layout one
    element further in memory does not. Both digest as the eager reference does."""
    from numaudit.agents.kernels.triton_plan import plan_piece, vector_reads

    layout = PieceLayout((3000,), (48,), (1040,))  # rows partly live at both ends
    buf = _values(dtype, 1040 + 16, 71).to(_device())
    for shift in (0, 1):
        t = buf[shift:shift + 1040]
        assert vector_reads(plan_piece(t, layout), t.data_ptr()) == (shift == 0)
        _assert_rows(triton_digest.digest_piece_triton(t, layout, sketch_k=K), t.cpu(), layout)


_COMPILE = r"""
import torch, triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from numaudit.agents.kernels import digest_triton as dt, triton_kernels as kern
from numaudit.agents.kernels.triton_plan import NUM_WARPS
from numaudit.agents.layout import PieceLayout

POINTERS = {"desc_ptr": "*i64", "inv_ptr": "*i32", "table_ptr": "*i64", "pow_ptr": "*i64",
            "part_i64_ptr": "*i64", "part_f64_ptr": "*fp64", "part_sk_ptr": "*fp64",
            "out_f64_ptr": "*fp64", "out_i64_ptr": "*i64"}
LOADS = {torch.uint8: "*u8", torch.uint16: "*u16", torch.uint32: "*u32", torch.uint64: "*u64",
         torch.int8: "*i8", torch.int16: "*i16", torch.int32: "*i32", torch.int64: "*i64"}

def build(kernel, const, load, warps):
    sig = {n: "constexpr" if n in const else
           (POINTERS.get(n) or (load if n == "x_ptr" else "i64")) for n in kernel.arg_names}
    triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=const),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})

one = (torch.zeros(4096), PieceLayout.full((4096,)))  # one line, read in vectors
odd = (torch.zeros(700)[1:], PieceLayout((900,), (5,), (699,)))  # one line, not in vectors
unit = (torch.zeros(6, 40), PieceLayout((6, 90), (0, 10), (6, 40)))  # lines of stride 1
strided = (torch.zeros(40, 6).t(), PieceLayout.full((6, 40)))  # lines of stride 6
cases = [  # every constexpr branch at least once: dtypes, index paths, k, one piece or a table
    (torch.bfloat16, one, 256, 1), (torch.bfloat16, odd, 1, 3), (torch.float32, strided, 4096, 1),
    (torch.float32, unit, 256, 3), (torch.float64, one, 256, 1), (torch.int64, unit, 256, 3),
    (torch.bool, odd, 4096, 1)]
seen = set()
for dtype, (t, layout), k, count in cases:
    p = dt.prepare(t.to(dtype), layout)
    tiles, finish = dt.constexprs(p.plan, k, count, dt.vector_reads(p.plan, p.ptr))
    build(kern.tiles_kernel, tiles, LOADS[p.plan.load_dtype], NUM_WARPS)
    if tuple(finish.values()) not in seen:
        seen.add(tuple(finish.values()))
        build(kern.finish_kernel, finish, "*u8", 4)
    seen.add(tuple(tiles.values()))
print("compiled", len(seen))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the device tests compile for it")
def test_every_kind_of_variant_compiles_for_a_hopper_gpu():
    """The interpreter runs the kernels as Python: it misses what only the compiler refuses (a
    function's returns of two types, a name rebound to another type in a branch; both
    happened). So every kind of variant the agent launches is compiled for sm_90 here, without
    a GPU (Triton's own ptxas): dtypes with and without moments and mix64, one line with and
    without vectors, many lines of stride 1 and not, k of 1, 256 and 4096, one piece and a
    table."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    out = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("compiled")
