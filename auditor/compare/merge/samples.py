"""Aligning two runs' samples within a step, by content: which of the candidate's rows is which of
the reference's (`auditor.compare.merge.regroup` re-keys records with it).

Where both runs sent the bytes of a batch-holding key (the input, else the earliest activation),
the step's rows are rebuilt from the pieces' payloads and matched one to one: equal rows first,
bitwise, then each remaining row to its nearest with a clear margin. Where they did not (pieces
over the payload size), the same from both runs' per-sample digests (`sample_rows`): a sample's
fingerprint, keyed within the sample, is equal wherever the sample sits when its bits are, and
its sketch is a sketch of the sample alone, so nearest rows are nearest sketches. `round_robin`
recognizes the one reordering that ordinary data-parallel code makes on purpose: a
DistributedSampler deals the step's samples to the dp ranks in turn (rank r takes samples r,
r + n, r + 2n, ...).
"""

from __future__ import annotations

import numpy as np

from numaudit.auditor.compare.digests.metrics import (
    PayloadUnavailable,
    bits_to_values,
    decode_payload,
)
from numaudit.auditor.compare.read.sample_digests import fetch
from numaudit.wire.vocabulary import Phase

ALIGN_MAX_ROWS = 4096
"""Rows matched one by one to align samples (the nearest-row search is quadratic)."""
ALIGN_MAX_BYTES = 64 << 20
"""Bytes of one run's step read back to align samples."""


def sample_starts(rows: dict[int, int]) -> dict[int, int]:
    """Microbatch -> position of its first sample in the step (microbatches in order)."""
    out, at = {}, 0
    for m in sorted(rows):
        out[m] = at
        at += rows[m]
    return out


def step_rows(cols, at, mb, ph, catalog, key, d, rows) -> np.ndarray | None:
    """One run's step of batch-holding key ``key`` as [samples, features] float64 rows, rebuilt
    from its pieces' payloads (None when a piece has none)."""
    starts = sample_starts(rows)
    sel = at[(ph[at] == key[0]) & (cols.where[at] == key[1])]
    if not len(sel):
        return None
    pieces = [catalog.pieces[cols.layout[r]] for r in sel]
    total = sum(rows.values())
    shape = list(pieces[0].logical_shape)
    shape[d] = total
    n = int(np.prod(shape))
    if n == 0 or n * 8 > ALIGN_MAX_BYTES or total > ALIGN_MAX_ROWS:
        return None
    if not catalog.payload_rids(cols.rid[sel]) >= {int(x) for x in cols.rid[sel]}:
        return None
    values = np.full(shape, np.nan)
    for r, piece in zip(sel, pieces):
        got = catalog.reader.payload(int(cols.rid[r]))
        if got is None:
            return None
        try:
            bits = decode_payload(got[0], got[1], piece.dtype, piece.shape,
                                  max_bytes=ALIGN_MAX_BYTES)
        except PayloadUnavailable:
            return None
        v = bits_to_values(bits, piece.dtype).reshape(piece.shape)
        box = [slice(o, o + s) for o, s in zip(piece.offsets, piece.shape)]
        box[d] = slice(starts[int(mb[r])] + piece.offsets[d],
                       starts[int(mb[r])] + piece.offsets[d] + piece.shape[d])
        values[tuple(box)] = v
    rows_2d = np.moveaxis(values, d, 0).reshape(total, -1)
    if np.isnan(rows_2d).all(axis=1).any():
        return None
    return rows_2d


def sample_rows(cols, at, mb, ph, catalog, key, d, rows) -> np.ndarray | None:
    """One run's step of batch-holding key ``key`` as [samples, 1 + k] float64 rows from its
    pieces' per-sample digests: each sample's fingerprint (its bits as a float64, so that equal
    rows are equal fingerprints) and its sketch of k buckets (the fewest of its pieces'), whose
    distance to another sample's estimates the distance between the samples (a sketch is linear
    and keyed within the sample). None unless every piece has one unit per sample and holds its
    samples whole (no shard of a sample), or for more than ALIGN_MAX_ROWS samples."""
    starts = sample_starts(rows)
    sel = at[(ph[at] == key[0]) & (cols.where[at] == key[1])]
    total = sum(rows.values())
    if not len(sel) or total > ALIGN_MAX_ROWS:
        return None
    got = fetch(catalog, cols.rid[sel])
    if len(got) < len(sel):
        return None
    k = min(s.k for s in got.values())
    out = np.full((total, 1 + k), np.nan)
    for r in sel:
        piece = catalog.pieces[cols.layout[r]]
        smp = got[int(cols.rid[r])]
        whole = all(o == 0 and s == n for e, (o, s, n) in enumerate(
            zip(piece.offsets, piece.shape, piece.logical_shape)) if e != d)
        if smp.dim != d or smp.unit != 1 or not whole or smp.count != piece.shape[d]:
            return None
        g0 = starts[int(mb[r])] + piece.offsets[d]
        sketch = smp.f64[:, 5:].reshape(smp.count, smp.k // k, k).sum(1)
        out[g0:g0 + smp.count, 0] = smp.fp.view(np.float64)
        out[g0:g0 + smp.count, 1:] = sketch
    if np.isnan(out[:, 1:]).any():
        return None
    return out


def _folded(rows: np.ndarray, k: int) -> np.ndarray:
    """`sample_rows` rows with their sketches folded to k buckets (bucket b into b mod k)."""
    big = rows.shape[1] - 1
    if big == k:
        return rows
    return np.concatenate([rows[:, :1], rows[:, 1:].reshape(len(rows), big // k, k).sum(1)],
                          axis=1)


def match_rows(ref: np.ndarray, cand: np.ndarray, skip: int = 0) -> np.ndarray | None:
    """perm with cand[g] ~ ref[perm[g]]: equal rows first (bitwise), then each remaining cand
    row to its nearest ref row when that is clearly nearer than the next (distance at most a
    tenth of the second nearest; columns from ``skip`` on: `sample_rows`' fingerprint column
    only pairs equal rows); None when the rows do not pair up one to one."""
    n = len(ref)
    if len(cand) != n:
        return None
    if np.array_equal(ref, cand, equal_nan=True):
        return np.arange(n)
    perm = np.full(n, -1)
    free: dict[bytes, list[int]] = {}
    for i in range(n):
        free.setdefault(ref[i].tobytes(), []).append(i)
    for g in range(n):
        slot = free.get(cand[g].tobytes())
        if slot:
            perm[g] = slot.pop(0)
    rest = np.flatnonzero(perm < 0)
    if len(rest):
        used = np.zeros(n, bool)
        used[perm[perm >= 0]] = True
        open_ref = np.flatnonzero(~used)
        a = np.nan_to_num(cand[rest][:, skip:])
        b = np.nan_to_num(ref[open_ref][:, skip:])
        dist = np.sqrt(np.maximum(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1), 0.0))
        order = np.argsort(dist, axis=1)
        best = order[:, 0]
        d0 = dist[np.arange(len(rest)), best]
        if len(open_ref) > 1:
            d1 = dist[np.arange(len(rest)), order[:, 1]]
            if not np.all(d0 <= 0.1 * d1):
                return None
        perm[rest] = open_ref[best]
    if len(np.unique(perm)) != n:
        return None
    return perm


def align_samples(rc, cc, at_r, at_c, mb_r, mb_c, ph_r, ph_c, catalog, dim_of, rows_r, rows_c
                  ) -> tuple[np.ndarray | None, str]:
    """(perm, how) with cand's sample g being ref's sample perm[g] (both in their runs' order),
    from the rows of the input, else the earliest activations; perm None (and why) when the rows
    do not pair up, the identity when no key has payloads in both runs."""
    n = sum(rows_r.values())
    keys = sorted(dim_of, key=lambda k: (k[0] != Phase.INPUT, k[0] != Phase.FWD))
    # input first, then activations in ref's capture order (dim_of's insertion order)
    order = [k for k in keys if k[0] == Phase.INPUT] + \
        [k for k in dim_of if k[0] == Phase.FWD]
    for key in order[:4]:
        d = dim_of[key]
        ref = step_rows(rc, at_r, mb_r, ph_r, catalog, key, d, rows_r)
        cand = step_rows(cc, at_c, mb_c, ph_c, catalog, key, d, rows_c)
        how = "rows"
        if ref is None or cand is None:
            ref = sample_rows(rc, at_r, mb_r, ph_r, catalog, key, d, rows_r)
            cand = sample_rows(cc, at_c, mb_c, ph_c, catalog, key, d, rows_c)
            how = "per-sample digests"
            if ref is None or cand is None:
                continue
            k = min(ref.shape[1], cand.shape[1]) - 1  # the sketches folded to one bucket count
            ref, cand = _folded(ref, k), _folded(cand, k)
        perm = match_rows(ref, cand, skip=0 if how == "rows" else 1)
        site = catalog.site_names.get(key[1] >> 32, f"site {key[1] >> 32}")
        phase = "input" if key[0] == Phase.INPUT else "fwd"
        if perm is None:
            return None, (f"the runs group their samples differently, and the {how} of "
                          f"{phase} {site} do not pair up one to one between them: their "
                          "microbatches were not regrouped (are they the same samples?)")
        return perm, f"samples aligned by the {how} of {phase} {site}"
    return np.arange(n), ("samples assumed in the same order (microbatch 0's first; no "
                          "batch-holding key with payloads in both runs to align them by: "
                          "capture the input with agent.capture(x, site=..., phase=\"input\"))")


def share_dim(piece) -> int | None:
    """The dim on which ``piece`` (merge.Piece) is its dp rank's share of an evenly split batch
    (logical = rows x n for n >= 2, offset a multiple of rows), else None."""
    if piece.is_none or piece.flat or piece.ragged is not None or piece.reduce or piece.partial:
        return None
    dims = [d for d, (s, n) in enumerate(zip(piece.shape, piece.logical_shape)) if s != n]
    if len(dims) != 1:
        return None
    d = dims[0]
    rows = piece.shape[d]
    if not rows or piece.logical_shape[d] % rows or piece.offsets[d] % rows \
            or piece.logical_shape[d] // rows < 2:
        return None
    return d


def round_robin(cols, at, mb, ph, catalog, key, d, rows, perm: np.ndarray) -> int | None:
    """The dp size n when the run's sample g (in its order: microbatches in turn, dp ranks in
    rank order within each) is the other run's sample perm[g] = r + n k for the k-th sample of
    its dp rank r over the step: the samples were dealt to the dp ranks in turn, as a
    DistributedSampler does; else None (the identity included)."""
    if np.array_equal(perm, np.arange(len(perm))):
        return None
    starts = sample_starts(rows)
    sel = at[(ph[at] == key[0]) & (cols.where[at] == key[1])]
    boxes = sorted({(int(mb[r]), catalog.pieces[cols.layout[r]].offsets[d],
                     catalog.pieces[cols.layout[r]].shape[d],
                     catalog.pieces[cols.layout[r]].logical_shape[d]) for r in sel
                    if share_dim(catalog.pieces[cols.layout[r]]) == d})
    sizes = {logical // n for _, _, n, logical in boxes}
    if not boxes or len(sizes) != 1:
        return None
    (dp,) = sizes
    if sum(n for _, _, n, _ in boxes) != len(perm):
        return None  # some samples are in no share (replicated, or not captured)
    seen: dict[int, int] = {}
    for m, offset, n, _ in boxes:
        rank = offset // n
        k0 = seen.get(rank, 0)
        g0 = starts[m] + offset
        if not np.array_equal(perm[g0:g0 + n], rank + dp * np.arange(k0, k0 + n)):
            return None
        seen[rank] = k0 + n
    return dp
