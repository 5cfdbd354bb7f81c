"""Distances between two runs' keys from their per-sample digests (docs/digests.md "Per-sample
digests"): pure numpy, vectorized over keys.

Each side of a key is a set of *units*. A unit covers the samples at positions ``pos .. pos +
cnt - 1`` of the key's batch dim (in the comparison's sample order), has a nominal size ``size``
(a power of two; ``cnt <= size``), and holds, in ``k`` buckets, ``sum_t X_t S_t``: the
within-sample sketch of its sample ``t`` with bucket ``b`` moved to ``c = b XOR t`` and the sign
of its Walsh character ``(-1)^<t,c>`` (agents/digest/sample_digest.py), the moments of its samples
together and the fingerprint of its samples as a tensor of their own. Pieces of one
sample (tensor-parallel shards) are units at the same place: they add.

The estimator compares *blocks*: the smallest runs of positions that are unions of units on both
sides. A unit at offset ``o`` of its block (a multiple of its size, so that ``o XOR t = o + t``
for its slots t) is lifted into the block by moving bucket ``b`` to ``b XOR o``; sketches of
more buckets are folded first (bucket ``b`` into ``b mod k'``: the scheme's buckets are the low
bits of one word, so a folded sketch is the sketch with fewer buckets; folding commutes with
``X_t`` for ``t < k'``). ``X_o X_t = X_(o XOR t)`` when o and t share no bit, so a lifted unit
is what its samples lifted one by one would be. In a block every sample has its own label ``o +
t < k``, so two samples never share a bucket at the same element index, and the block's sketch
is a CountSketch of the block with k buckets. Then

    Y_B = ||S(cand_B) - S(ref_B)||^2        E[Y_B] = ||cand_B - ref_B||^2
    Y = sum_B Y_B                            E[Y] = ||cand - ref||^2
    Var[Y] = sum_B Var[Y_B] <= (2/k) sum_B ||d_B||^4

Blocks share the within-sample scheme, so their errors are not independent: with ``delta_B`` the
difference of block B's sketches, ``Var[Y] ~ (2/k) sum_{B, B'} <d_B, d_B'>^2``, estimated by
``(2/k) ||sum_B delta_B delta_B^T||_F^2``. A difference the same in every sample (a bias) adds up
coherently, and its band is that of one block's sketch (sigma of the norm 1/sqrt(2k)); one that
differs from sample to sample averages, down to a band about sqrt(B) times narrower. The band is
stated from the estimates themselves, as an *effective* bucket count ``k_eff = k Y^2 / ||sum_B
tail_B delta_B delta_B^T||_F^2`` (`metrics.sketch_band` of it; ``tail_B`` widens blocks whose
difference fills few buckets, `metrics.concentration_factor`). Blocks whose fingerprints agree
(both exact) contribute an exact 0. Deterministic lower bounds come with it: per block
``| ||ref_B|| - ||cand_B|| |`` (their squares add) and the difference of its extremes.

What is never done: adding the sketches of different samples *keyed alike* (the same labels),
which would let two samples' differences cancel (a swap of two samples would vanish) or add
coherently. A key whose units cannot be laid into such blocks (units of other sizes that do not
nest, labels past k, a side that does not cover a block) is not measured: it keeps the lower
bound of the moments and breaches as uncertain (`slow.py`), never passes on a guess.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from numaudit.auditor.compare.digests.algebra import FINGERPRINT_H
from numaudit.auditor.compare.digests.metrics import EPS64, concentration_factor

N_MOMENTS = 5
LOWER_BOUND_SLACK = 16.0
"""Rounding slack of a block's norm-difference bound, in eps64 * sqrt(elements) * norm."""
_BIG = 1 << 40
"""Positions are below this: (key, position) packs into one sortable int64."""


@dataclass
class Units:
    """One side's units, over many keys (one row per unit)."""

    key: np.ndarray
    """int64: the key (0 .. keys - 1)."""
    pos: np.ndarray
    cnt: np.ndarray
    size: np.ndarray
    k: np.ndarray
    moments: np.ndarray
    """float64 [m, 5]: sum, sum_sq, min, max, abs_max."""
    sketch: np.ndarray
    """float64, every unit's k buckets concatenated in row order."""
    fp: np.ndarray
    """uint64."""

    def __len__(self) -> int:
        return len(self.key)

    def starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.k)[:-1]]).astype(np.int64)


@dataclass
class Estimate:
    """Per key (NaN / False where not measured)."""

    ok: np.ndarray
    d2: np.ndarray
    """sum over blocks of the squared sketched distance."""
    k_eff: np.ndarray
    """Bucket count of one sketch with the same relative variance (inf when every block is
    exact)."""
    lower: np.ndarray
    """sqrt(sum over blocks of the squared norm-difference bound)."""
    extremes: np.ndarray
    """max over blocks of | max, min or abs_max of cand - of ref |: a bound on max |cand - ref|."""
    resid2: np.ndarray
    """sum over blocks of ||S(cand_B) - alpha S(ref_B)||^2 (alpha given per key)."""
    blocks: np.ndarray
    identical: np.ndarray
    """Blocks whose fingerprints agree."""
    k: np.ndarray
    """Buckets the blocks were compared with."""
    ref_sq: np.ndarray
    """sum of the reference's squares over the blocks (scaled): its norm there, squared."""


def fold(sketch: np.ndarray, k: int) -> np.ndarray:
    """[m, K] sketches as [m, k] ones (k divides K): bucket b adds into b mod k."""
    m, big = sketch.shape
    return sketch if big == k else sketch.reshape(m, big // k, k).sum(1)


def lift(sketch: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """[m, k] sketches of units at ``offset`` of their blocks: ``X_o``, bucket b moves to c =
    b ^ o, its sign flipped where popcount(o & c) is odd."""
    k = sketch.shape[1]
    lanes = np.arange(k)[None, :]
    idx = lanes ^ offset[:, None]
    odd = (np.bitwise_count(lanes & offset[:, None]) & 1).astype(bool)
    out = np.take_along_axis(sketch, idx, axis=1)
    return np.where(odd, -out, out)


def estimate(ref: Units, cand: Units, keys: int, *, numel_s: np.ndarray,
             scale: np.ndarray | None = None, alpha: np.ndarray | None = None,
             exact: np.ndarray | None = None) -> Estimate:
    """The block estimate of every key (module docstring). ``numel_s``: elements of a whole
    sample per key (for the fingerprints' moves); ``scale``: the reference's factor per key
    (activation gradients), applied to its sketches and moments; ``alpha``: the factor of the
    scaled residual; ``exact``: per key, whether unit fingerprints may decide a block."""
    nan = np.full(keys, np.nan)
    out = Estimate(ok=np.zeros(keys, bool), d2=nan.copy(), k_eff=nan.copy(), lower=nan.copy(),
                   extremes=nan.copy(), resid2=nan.copy(), blocks=np.zeros(keys, np.int64),
                   identical=np.zeros(keys, np.int64), k=np.zeros(keys, np.int64),
                   ref_sq=nan.copy())
    if not len(ref) or not len(cand):
        return out
    scale = np.ones(keys) if scale is None else np.asarray(scale, np.float64)
    alpha = np.ones(keys) if alpha is None else np.asarray(alpha, np.float64)
    exact = np.zeros(keys, bool) if exact is None else np.asarray(exact, bool)
    kt = np.full(keys, np.iinfo(np.int64).max)
    np.minimum.at(kt, ref.key, ref.k)
    np.minimum.at(kt, cand.key, cand.k)
    has = np.zeros((2, keys), bool)
    has[0, ref.key] = True
    has[1, cand.key] = True
    for k in np.unique(kt[has.all(0)]):
        _estimate_k(ref, cand, int(k), np.flatnonzero(has.all(0) & (kt == k)), numel_s, scale,
                    alpha, exact, out)
    return out


def _side(units: Units, sel: np.ndarray, k: int, side: int) -> dict:
    """The selected units with their sketches folded to k buckets."""
    starts = units.starts()[sel]
    ks = units.k[sel]
    folded = np.empty((len(sel), k))
    for kk in np.unique(ks):
        at = np.flatnonzero(ks == kk)
        idx = starts[at, None] + np.arange(kk)[None, :]
        folded[at] = fold(units.sketch[idx], k)
    return {"side": np.full(len(sel), side, np.int8), "key": units.key[sel],
            "pos": units.pos[sel], "cnt": units.cnt[sel], "size": units.size[sel],
            "moments": units.moments[sel], "fp": units.fp[sel], "sketch": folded}


def _estimate_k(ref: Units, cand: Units, k: int, keys: np.ndarray, numel_s: np.ndarray,
                scale: np.ndarray, alpha: np.ndarray, exact: np.ndarray, out: Estimate) -> None:
    parts = [_side(u, np.flatnonzero(np.isin(u.key, keys)), k, s)
             for s, u in enumerate((ref, cand))]
    u = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
    order = np.lexsort((u["pos"], u["key"]))
    u = {name: v[order] for name, v in u.items()}
    key, pos, cnt, size = u["key"], u["pos"], u["cnt"], u["size"]
    m = len(key)
    # blocks: runs of positions that units of either side cover together
    packed_end = np.maximum.accumulate(key * _BIG + pos + cnt)
    new = np.ones(m, bool)
    new[1:] = (key[1:] != key[:-1]) | (key[1:] * _BIG + pos[1:] >= packed_end[:-1])
    block = np.cumsum(new) - 1
    first = np.flatnonzero(new)
    nb = len(first)
    offset = pos - pos[first][block]
    bad = (offset % size != 0) | (offset + cnt > k) | (cnt < 1) | (cnt > size)
    # every block covered by both sides: each side's distinct positions span the block
    length = np.zeros(nb, np.int64)
    np.maximum.at(length, block, offset + cnt)
    for s in (0, 1):
        mine = u["side"] == s
        covered = np.unique(np.repeat(block[mine] * _BIG, cnt[mine]) + _ranges(offset[mine],
                                                                                  cnt[mine]))
        count = np.bincount(covered // _BIG, minlength=nb)
        bad_blocks = count != length
        bad |= bad_blocks[block]
    bad_keys = np.zeros(out.ok.shape, bool)
    bad_keys[key[bad]] = True
    keep = ~bad_keys[key]
    if not keep.any():
        return
    key, block, offset, side = key[keep], block[keep], offset[keep], u["side"][keep]
    sketch = lift(u["sketch"][keep], offset)
    mom = u["moments"][keep].copy()
    f = scale[key]
    ref_rows = side == 0
    if np.any(f[ref_rows] != 1.0):
        fr = f[ref_rows]
        sketch[ref_rows] *= fr[:, None]
        mom[ref_rows, :2] *= np.stack([fr, fr * fr], axis=1)
        lo, hi = mom[ref_rows, 2] * fr, mom[ref_rows, 3] * fr
        mom[ref_rows, 2], mom[ref_rows, 3] = np.minimum(lo, hi), np.maximum(lo, hi)
        mom[ref_rows, 4] *= np.abs(fr)
    fp = _moved(u["fp"][keep], offset, numel_s[key])
    # per (block, side): sums of sketches, moments and fingerprints
    grp = block * 2 + side
    order = np.argsort(grp, kind="stable")
    grp, key, sketch, mom, fp = grp[order], key[order], sketch[order], mom[order], fp[order]
    at = np.flatnonzero(np.r_[True, grp[1:] != grp[:-1]])
    g_block, g_side, g_key = grp[at] // 2, grp[at] % 2, key[at]
    s_sum = np.add.reduceat(sketch, at, axis=0)
    sum_sq = np.add.reduceat(mom[:, 1], at)
    lo = np.minimum.reduceat(mom[:, 2], at)
    hi = np.maximum.reduceat(mom[:, 3], at)
    amax = np.maximum.reduceat(mom[:, 4], at)
    with np.errstate(over="ignore"):
        fps = np.add.reduceat(fp, at)  # uint64: wraps mod 2**64
    # both sides of every surviving block are present (coverage): pair them up
    r, c = np.flatnonzero(g_side == 0), np.flatnonzero(g_side == 1)
    assert np.array_equal(g_block[r], g_block[c])
    bkey = g_key[r]
    diff = s_sum[c] - s_sum[r]
    y = np.einsum("ij,ij->i", diff, diff)
    same = exact[bkey] & (fps[r] == fps[c]) & (scale[bkey] == 1.0)
    y = np.where(same, 0.0, y)
    tail = concentration_factor(diff, y)
    diff = np.where(same[:, None], 0.0, diff)
    norm_f2 = _gram_norms(diff * np.sqrt(tail)[:, None], bkey, len(out.ok))
    resid = s_sum[c] - alpha[bkey][:, None] * s_sum[r]
    resid2 = np.einsum("ij,ij->i", resid, resid)
    rn, cn = np.sqrt(np.maximum(sum_sq[r], 0)), np.sqrt(np.maximum(sum_sq[c], 0))
    elements = numel_s[bkey] * length[g_block[r]]
    slack = LOWER_BOUND_SLACK * EPS64 * np.sqrt(elements + 1.0) * np.maximum(rn, cn)
    lb2 = np.where(same, 0.0, np.maximum(np.abs(cn - rn) - slack, 0.0) ** 2)
    with np.errstate(invalid="ignore"):
        ext = np.nanmax(np.stack([np.abs(hi[c] - hi[r]), np.abs(lo[c] - lo[r]),
                                  np.abs(amax[c] - amax[r])]), axis=0)
    ext = np.where(same | ~np.isfinite(ext), 0.0, ext)
    done = np.unique(bkey)
    out.ok[done] = True
    out.k[done] = k
    for name, values in (("d2", y), ("resid2", resid2), ("ref_sq", sum_sq[r])):
        arr = np.zeros(len(out.ok))
        np.add.at(arr, bkey, values)
        getattr(out, name)[done] = arr[done]
    with np.errstate(divide="ignore", invalid="ignore"):
        out.k_eff[done] = np.where(norm_f2[done] > 0,
                                   k * out.d2[done] ** 2 / norm_f2[done], np.inf)
    lower = np.zeros(len(out.ok))
    np.add.at(lower, bkey, lb2)
    out.lower[done] = np.sqrt(lower[done])
    extremes = np.zeros(len(out.ok))
    np.maximum.at(extremes, bkey, ext)
    out.extremes[done] = extremes[done]
    out.blocks[done] = np.bincount(bkey, minlength=len(out.ok))[done]
    out.identical[done] = np.bincount(bkey, weights=same, minlength=len(out.ok))[done].astype(
        np.int64)


def _gram_norms(diff: np.ndarray, key: np.ndarray, keys: int) -> np.ndarray:
    """Per key, ``||sum_B d_B d_B^T||_F^2 = sum_{B, B'} <d_B, d_B'>^2`` over its blocks' rows of
    ``diff`` (rows sorted by key): ``(2/k)`` times it estimates ``Var[Y]``, whose cross terms
    are those of blocks whose differences resemble each other (all samples share the
    within-sample scheme: a bias in every sample adds up coherently, no averaging)."""
    out = np.zeros(keys)
    bounds = np.flatnonzero(np.r_[True, key[1:] != key[:-1], True])
    for a, b in zip(bounds[:-1], bounds[1:]):
        d = diff[a:b]
        gram = d @ d.T if b - a <= d.shape[1] else d.T @ d
        out[key[a]] = float(np.einsum("ij,ij->", gram, gram))
    return out


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """start, start + 1, ..., start + count - 1 for each (start, count), concatenated."""
    total = int(counts.sum())
    if not total:
        return np.zeros(0, np.int64)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + np.arange(total) - first


_POWERS: dict[int, int] = {}


def _moved(fp: np.ndarray, offset: np.ndarray, numel_s: np.ndarray) -> np.ndarray:
    """Unit fingerprints moved ``offset`` samples of ``numel_s`` elements into their blocks:
    times ``h**(offset numel_s)`` mod 2**64 (version 3's keys)."""
    delta = offset * numel_s
    out = fp.astype(np.uint64).copy()
    moving = np.flatnonzero(delta != 0)
    if len(moving):
        uniq, inv = np.unique(delta[moving], return_inverse=True)
        powers = np.array([_power(int(d)) for d in uniq], np.uint64)
        with np.errstate(over="ignore"):
            out[moving] = out[moving] * powers[inv]
    return out


def _power(d: int) -> int:
    p = _POWERS.get(d)
    if p is None:
        if len(_POWERS) > 65536:
            _POWERS.clear()
        p = _POWERS[d] = pow(FINGERPRINT_H, d, 1 << 64)
    return p
