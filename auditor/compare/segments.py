"""Segment helpers over numpy arrays: rows of many keys, each key a contiguous segment."""

from __future__ import annotations

import numpy as np


def ranges_index(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated aranges [starts[i], ends[i]) and the segment offsets."""
    lengths = ends - starts
    total = int(lengths.sum())
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else lengths
    idx = np.repeat(starts - offsets, lengths) + np.arange(total)
    return idx, offsets


def segment_reduce(ufunc: np.ufunc, values: np.ndarray, offsets: np.ndarray, n_rows: int,
                   identity: float) -> np.ndarray:
    """``ufunc.reduceat`` over segments that may be empty (a key whose pieces hold no elements
    takes no rows): an empty segment gets ``identity``, never its neighbour's value, and an
    offset at the end of ``values`` is not an error."""
    lengths = np.diff(np.append(offsets, n_rows))
    out_shape = (len(offsets),) + values.shape[1:]
    out = np.full(out_shape, identity, dtype=np.result_type(values, np.float64)
                  if values.dtype.kind == "f" else values.dtype)
    full = lengths > 0
    if full.any():
        out[full] = ufunc.reduceat(values, offsets[full], axis=0)
    return out
