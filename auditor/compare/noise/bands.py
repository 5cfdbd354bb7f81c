"""Noise bands: how far a reference configuration's reruns lie from one another, per key and per
piece (docs/noise.md).

Reruns of the reference with the same configuration differ where its kernels are
nondeterministic (a GPU's atomic accumulation in an attention backward, an embedding's
`index_add`). `Bands` holds, for every key the reruns hold, whether every pair of reruns was
bitwise equal there, and else the largest distances among them, for every box of the
reference's pieces and for the key as a whole: relative L2 (with the sketch's sigma where it
was estimated), max_abs, ULP and the share of elements failing the preset's elementwise test.
Bands are never pooled across keys or pieces: each box keeps its own.

`BandBuilder` collects the distances of each pair of reruns (`auditor.compare.noise.calibrate`), and
`Bands.locate` finds a comparison's keys in them; `auditor.compare.noise.bands_file` saves and loads
them; `auditor.compare.noise.judge` judges a candidate against them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.noise.pieces import PieceDistance

BITWISE, NOISY, UNUSABLE = 0, 1, 2
"""`Bands.state` of a key: every pair of reruns bitwise equal; some pair differs (the band's
distances say by how much); no band (missing in a rerun, not comparable, or not measurable
piece by piece: the reason is in `Bands.reasons`)."""
STATE_NAMES = ("bitwise", "noisy", "unusable")
KEY_FIELDS = ("rel", "sigma", "max_abs", "bound", "ulp", "share", "allclose")
"""Distances kept per key and per piece (the largest over the pairs of reruns)."""
_KEY_DTYPE = np.dtype([("a", "<i8"), ("b", "<i8")])


@dataclass
class Bands:
    """The noise bands of a reference configuration (columns, one entry per key in key order;
    piece columns ``p_*`` indexed by ``piece_start``)."""

    runs: list[str]
    """The reference's runs the bands were measured among."""
    pairs: int
    """Pairs of runs measured (every pair of `runs`)."""
    sites: list[str]
    dtypes: list[str]
    when: np.ndarray
    """Key part A (step, microbatch, phase), as the comparison packs it."""
    where: np.ndarray
    """Key part B with the site as an index into `sites`: ``site << 32 | role, index, call``."""
    state: np.ndarray
    dtype: np.ndarray
    """Index into `dtypes` (-1 unknown)."""
    numel: np.ndarray
    """Elements of the key's logical tensor in the reference (-1 unknown): a comparison's key
    with another count (microbatches grouped otherwise) is another tensor, and gets no band."""
    differ: np.ndarray
    """Pairs of runs in which the key is not bitwise equal."""
    rel: np.ndarray
    sigma: np.ndarray
    max_abs: np.ndarray
    bound: np.ndarray
    """The largest lower bound of max_abs from the extremes (known without payloads)."""
    allclose: np.ndarray
    """The largest elementwise ratio of the policy the bands were measured under
    (``meta["policy"]``): max |a - b| / (atol + rtol |a|)."""
    ulp: np.ndarray
    share: np.ndarray
    piece_start: np.ndarray
    """Pieces of key g: ``p_*[piece_start[g]:piece_start[g + 1]]`` (noisy keys only)."""
    p_box: list[tuple | None]
    """A piece's box (offsets, shape) in the reference's logical tensor; None: the whole key."""
    p_bitwise: np.ndarray
    p_rel: np.ndarray
    p_sigma: np.ndarray
    p_max_abs: np.ndarray
    p_bound: np.ndarray
    p_allclose: np.ndarray
    p_ulp: np.ndarray
    p_share: np.ndarray
    reasons: dict[int, str] = field(default_factory=dict)
    """Why a key has no band (state UNUSABLE)."""
    meta: dict = field(default_factory=dict)
    """The policy, when and by what they were measured, and the reference's nondeterminism
    (`auditor.compare.noise.nondeterminism`)."""

    def __len__(self) -> int:
        return len(self.when)

    def counts(self) -> dict[str, int]:
        c = np.bincount(self.state.astype(np.int64), minlength=3)
        return {name: int(c[k]) for k, name in enumerate(STATE_NAMES)}

    def pieces(self, g: int) -> dict[tuple | None, int]:
        """Key g's pieces: box -> index into the ``p_*`` columns."""
        return {self.p_box[j]: j for j in range(int(self.piece_start[g]),
                                                int(self.piece_start[g + 1]))}

    def locate(self, A: np.ndarray, B: np.ndarray, site_names: dict[int, str]) -> np.ndarray:
        """Per key of a comparison (its when and where, site ids named by ``site_names``): the index
        of its band, or -1."""
        idx = {name: j for j, name in enumerate(self.sites)}
        sid = (np.asarray(B, np.int64) >> 32)
        top = int(sid.max(initial=0)) + 1
        lut = np.full(top, -1, np.int64)
        for s, name in site_names.items():
            if s < top and name in idx:
                lut[s] = idx[name]
        bsite = lut[sid] if len(sid) else sid
        q = np.zeros(len(A), _KEY_DTYPE)
        q["a"], q["b"] = A, (bsite << 32) | (np.asarray(B, np.int64) & 0xFFFFFFFF)
        keys = np.zeros(len(self.when), _KEY_DTYPE)
        keys["a"], keys["b"] = self.when, self.where
        pos = np.searchsorted(keys, q)
        inside = pos < len(keys)
        found = np.zeros(len(A), bool)
        found[inside] = keys[pos[inside]] == q[inside]
        return np.where(found & (bsite >= 0), pos, -1)


@dataclass
class _Entry:
    """One key's distances over the pairs seen so far."""

    dtype: str | None
    numel: int = -1
    pairs: int = 0
    differ: int = 0
    whole: list[PieceDistance] = field(default_factory=list)
    pieces: dict = field(default_factory=dict)
    """box -> [PieceDistance, one per pair in which the key differs]."""
    reason: str = ""


class BandBuilder:
    """Collects each pair of reruns' distances and makes the `Bands` (the largest distance of
    every key and piece over the pairs; a piece bitwise only if every pair was)."""

    def __init__(self, runs: list[str]) -> None:
        self.runs = list(runs)
        self.pairs = 0
        self.entries: dict[tuple[int, str, int], _Entry] = {}
        self.first_order: dict[tuple[int, str, int], int] = {}

    def add(self, comp, measured: dict[int, list[PieceDistance] | str]) -> None:
        """The distances of one pair's comparison (``measured``: `pieces.measure_keys` of
        its keys that are not identical)."""
        self.pairs += 1
        first = self.pairs == 1
        rk = comp.ref_keys
        cat = comp.catalog
        for i in range(len(comp)):
            v = int(comp.verdict[i])
            if v == F.IGNORED:
                continue
            a, b = int(comp.when[i]), int(comp.where[i])
            key = (a, cat.site_names.get(b >> 32, f"site#{b >> 32}"), b & 0xFFFFFFFF)
            ri = int(comp.ref_index[i])
            dt = cat.dtypes[rk.dtype[ri]] if ri >= 0 and rk.dtype[ri] >= 0 else None
            numel = int(rk.numel[ri]) if ri >= 0 else -1
            e = self.entries.get(key)
            if e is None:
                if not first:
                    e = self.entries[key] = _Entry(
                        dt, numel, reason=f"not held by {comp.ref.name} or {comp.cand.name} in "
                                          "every pair")
                else:
                    e = self.entries[key] = _Entry(dt, numel)
                    self.first_order[key] = int(comp.rank_in_order[i])
            e.pairs += 1
            if e.reason:
                continue
            if v == F.IDENTICAL:
                continue  # bitwise equal (or None in both): nothing to keep
            got = measured.get(i)
            if got is None or isinstance(got, str):
                e.reason = got or (f"{F.VERDICT_NAMES[v]} between {comp.ref.name} and "
                                   f"{comp.cand.name}")
                continue
            if all(p.bitwise for p in got):
                continue
            e.differ += 1
            e.whole.append(_whole_of(comp, i))
            for p in got:
                e.pieces.setdefault(p.box, []).append(p)

    def build(self, meta: dict | None = None) -> Bands:
        keys = sorted(self.entries)
        sites = sorted({k[1] for k in keys})
        site_idx = {s: j for j, s in enumerate(sites)}
        dtypes = sorted({e.dtype for e in self.entries.values() if e.dtype})
        dt_idx = {d: j for j, d in enumerate(dtypes)}
        K = len(keys)
        A = np.array([k[0] for k in keys], np.int64)
        B = np.array([(site_idx[k[1]] << 32) | k[2] for k in keys], np.int64)
        state = np.zeros(K, np.int8)
        dtype = np.full(K, -1, np.int16)
        numel = np.array([self.entries[k].numel for k in keys], np.int64)
        differ = np.zeros(K, np.int16)
        whole = {f: np.zeros(K) for f in KEY_FIELDS}
        piece_start = np.zeros(K + 1, np.int64)
        p_box: list = []
        pcols: dict[str, list] = {f: [] for f in ("bitwise",) + KEY_FIELDS}
        reasons: dict[int, str] = {}
        for g, k in enumerate(keys):
            e = self.entries[k]
            dtype[g] = dt_idx.get(e.dtype, -1) if e.dtype else -1
            differ[g] = e.differ
            if e.pairs < self.pairs and not e.reason:
                e.reason = "missing in some of the reference's runs"
            if e.reason:
                state[g] = UNUSABLE
                reasons[g] = e.reason
                for f in KEY_FIELDS:
                    whole[f][g] = math.nan
            elif e.differ:
                state[g] = NOISY
                for f, v in zip(KEY_FIELDS, _largest(e.whole)):
                    whole[f][g] = v
                for box in sorted(e.pieces, key=_box_order):
                    got = e.pieces[box]
                    p_box.append(box)
                    pcols["bitwise"].append(all(p.bitwise for p in got) and
                                            len(got) == e.differ)
                    for f, v in zip(KEY_FIELDS, _largest(got)):
                        pcols[f].append(v)
            piece_start[g + 1] = len(p_box)
        order = np.array([self.first_order.get(k, 1 << 62) for k in keys], np.int64)
        meta = dict(meta or {})
        meta.setdefault("created_unix", time.time())
        bands = Bands(
            runs=self.runs, pairs=self.pairs, sites=sites, dtypes=dtypes, when=A, where=B,
            state=state, dtype=dtype, numel=numel, differ=differ, piece_start=piece_start,
            p_box=p_box,
            p_bitwise=np.array(pcols["bitwise"], bool),
            **{f: whole[f] for f in KEY_FIELDS},
            **{f"p_{f}": np.array(pcols[f], np.float64) for f in KEY_FIELDS},
            reasons=reasons, meta=meta)
        bands.meta["order"] = order  # execution order of the first pair (not saved)
        return bands


def _box_order(box) -> tuple:
    return (0, ()) if box is None else (1, tuple(box[0]), tuple(box[1]))


def _whole_of(comp, i: int) -> PieceDistance:
    from numaudit.auditor.compare.noise.pieces import _whole

    return _whole(comp, i)


def _largest(ds: list[PieceDistance]) -> tuple[float, ...]:
    """(rel, its sigma, max_abs, its bound, ulp, share, allclose): the largest over pairs; an
    unknown relative distance makes the band unknown (NaN), an unknown max_abs, bound, ULP,
    share or allclose is left out of its maximum (a band that underestimates them only
    breaches more)."""
    if any(math.isnan(d.rel) for d in ds):
        return (math.nan,) * len(KEY_FIELDS)
    worst = max(ds, key=lambda d: d.rel)

    def top(vals):
        known = [v for v in vals if not math.isnan(v)]
        return max(known) if known else math.nan

    return (worst.rel, worst.sigma, top([d.max_abs for d in ds]),
            top([d.max_abs_bound for d in ds]), top([d.ulp for d in ds]),
            top([d.share for d in ds]), top([d.allclose for d in ds]))
