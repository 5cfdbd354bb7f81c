"""Noise bands on disk (`auditor calibrate -o FILE`, `compare --noise-bands FILE`;
docs/noise.md, "The file").

A bands file is a NumPy ``.npz`` archive (a zip of ``.npy`` arrays, never a pickle): ``meta``,
the UTF-8 JSON of what the bands are (format, version, the runs, the sites, dtypes, the reasons
keys have no band, the policy, the nondeterminism found), and one array per column of `Bands`
(``key_*`` per key, ``p_*`` per piece, a piece's box as ``p_ndim`` and its offsets then shape in
``p_dims``). `np.load(FILE, allow_pickle=False)` reads it.

Reading trusts nothing: every member must be one the format names (and no other), of its
dtype and one dimension, read within a size bound from its own ``.npy`` header (no member
allocates more than its bytes hold); the columns must agree in length, the keys be sorted and
unique, indices in range, distances non-negative. Anything else is a `BandsError` naming the
file and the field.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from pathlib import Path

import numpy as np

from numaudit.auditor.compare.digests.metrics import ITEMSIZE
from numaudit.auditor.compare.noise.bands import KEY_FIELDS, NOISY, UNUSABLE, Bands

FORMAT = "numaudit.noise_bands"
VERSION = 1
"""Bumped on any change a reader of an earlier version could misread."""
MAX_MEMBER_BYTES = 1 << 31
"""No column is read beyond 2 GiB (a million keys take ~100 MiB)."""
MAX_META_BYTES = 64 << 20

_COLUMNS: dict[str, str] = {
    "key_a": "<i8", "key_b": "<i8", "key_state": "|i1", "key_dtype": "<i2", "key_numel": "<i8",
    "key_differ": "<i2", "key_reason": "<i4", "piece_start": "<i8",
    **{f"key_{f}": "<f8" for f in KEY_FIELDS},
    "p_ndim": "|i1", "p_dims_start": "<i8", "p_dims": "<i8", "p_bitwise": "|b1",
    **{f"p_{f}": "<f8" for f in KEY_FIELDS},
    "meta": "|u1",
}


class BandsError(ValueError):
    """A bands file that cannot be used: names the file and the field."""


def save_bands(bands: Bands, path: str | Path) -> None:
    """Write ``bands`` to ``path`` (through a temporary file, renamed)."""
    path = Path(path)
    reasons = sorted(set(bands.reasons.values()))
    code = {r: j for j, r in enumerate(reasons)}
    key_reason = np.full(len(bands), -1, np.int32)
    for g, r in bands.reasons.items():
        key_reason[g] = code[r]
    ndim, starts, dims = [], [0], []
    for box in bands.p_box:
        if box is None:
            ndim.append(-1)
        else:
            ndim.append(len(box[0]))
            dims.extend(list(box[0]) + list(box[1]))
        starts.append(len(dims))
    meta = {
        "format": FORMAT, "version": VERSION, "runs": bands.runs, "pairs": bands.pairs,
        "sites": bands.sites, "dtypes": bands.dtypes, "reasons": reasons,
        **{k: v for k, v in bands.meta.items() if k != "order"},
    }
    cols = {
        "key_a": bands.when, "key_b": bands.where, "key_state": bands.state,
        "key_dtype": bands.dtype,
        "key_numel": bands.numel,
        "key_differ": bands.differ, "key_reason": key_reason, "piece_start": bands.piece_start,
        **{f"key_{f}": getattr(bands, f) for f in KEY_FIELDS},
        "p_ndim": np.array(ndim, np.int8), "p_dims_start": np.array(starts, np.int64),
        "p_dims": np.array(dims, np.int64), "p_bitwise": bands.p_bitwise,
        **{f"p_{f}": getattr(bands, f"p_{f}") for f in KEY_FIELDS},
        "meta": np.frombuffer(json.dumps(meta, allow_nan=True).encode(), np.uint8),
    }
    tmp = path.with_name(path.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, dt in _COLUMNS.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(cols[name], np.dtype(dt)),
                                      allow_pickle=False)
            zf.writestr(name + ".npy", buf.getvalue())
    os.replace(tmp, path)


def load_bands(path: str | Path) -> Bands:
    """The bands saved in ``path``, validated (module docstring); `BandsError` otherwise."""
    path = Path(path)

    def err(field: str, why: str) -> BandsError:
        return BandsError(f"{path}: field '{field}': {why}")

    try:
        zf = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise BandsError(f"{path}: no such file") from None
    except (zipfile.BadZipFile, OSError) as exc:
        raise BandsError(f"{path}: not a bands file (not an .npz archive: {exc})") from None
    with zf:
        names = {i.filename: i for i in zf.infolist()}
        want = {n + ".npy" for n in _COLUMNS}
        for extra in sorted(set(names) - want):
            raise err(extra.removesuffix(".npy"), "not a member of a bands file")
        for missing in sorted(want - set(names)):
            raise err(missing.removesuffix(".npy"), "missing")
        cols = {n: _read_member(zf, names[n + ".npy"], dt, err) for n, dt in _COLUMNS.items()}
    try:
        meta = json.loads(cols.pop("meta").tobytes().decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise err("meta", f"not JSON ({exc})") from None
    return _bands(meta, cols, err)


def _read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, dtype: str, err) -> np.ndarray:
    name = info.filename.removesuffix(".npy")
    limit = MAX_META_BYTES if name == "meta" else MAX_MEMBER_BYTES
    if info.file_size > limit:
        raise err(name, f"{info.file_size} bytes, over the limit of {limit}")
    try:
        with zf.open(info) as fh:
            data = fh.read(limit + 1)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise err(name, f"cannot be read ({exc})") from None
    if len(data) > limit:
        raise err(name, f"over the limit of {limit} bytes")
    buf = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(buf)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                       (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if read_header is None:
            raise ValueError(f"npy version {version}")
        shape, fortran, got = read_header(buf)
    except (ValueError, TypeError, SyntaxError) as exc:
        raise err(name, f"not an .npy array ({exc})") from None
    if got != np.dtype(dtype) or got.hasobject:
        raise err(name, f"dtype {got}, expected {np.dtype(dtype)}")
    if len(shape) != 1:
        raise err(name, f"shape {shape}: expected one dimension")
    body = data[buf.tell():]
    if len(body) != shape[0] * got.itemsize:
        raise err(name, f"{len(body)} bytes hold no {shape[0]} elements of {got}")
    return np.frombuffer(body, got).copy()


def _bands(meta, cols: dict, err) -> Bands:
    if not isinstance(meta, dict):
        raise err("meta", "not a JSON object")
    if meta.get("format") != FORMAT:
        raise err("meta.format", f"{meta.get('format')!r} is not {FORMAT!r}")
    version = meta.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= VERSION:
        raise err("meta.version", f"{version!r}: this auditor reads version 1 to {VERSION}")
    runs = _strings(meta, "runs", err)
    if len(runs) < 2:
        raise err("meta.runs", "bands need at least two runs")
    pairs = meta.get("pairs")
    if not isinstance(pairs, int) or isinstance(pairs, bool) or pairs < 1:
        raise err("meta.pairs", f"{pairs!r} is not a positive count")
    sites, dtypes, reasons = (_strings(meta, f, err) for f in ("sites", "dtypes", "reasons"))
    for d in dtypes:
        if d not in ITEMSIZE:
            raise err("meta.dtypes", f"{d!r} is not a dtype")
    nondet = meta.get("nondeterminism")
    if nondet is not None and not isinstance(nondet, dict):
        raise err("meta.nondeterminism", "not an object")
    K = len(cols["key_a"])
    for f in ("key_b", "key_state", "key_dtype", "key_numel", "key_differ", "key_reason",
              *(f"key_{x}" for x in KEY_FIELDS)):
        if len(cols[f]) != K:
            raise err(f, f"{len(cols[f])} entries for {K} keys")
    a, b = cols["key_a"], cols["key_b"]
    if K > 1 and not np.all((a[1:] > a[:-1]) | ((a[1:] == a[:-1]) & (b[1:] > b[:-1]))):
        raise err("key_a", "keys are not sorted and unique")
    site = b >> 32
    if K and (site.min() < 0 or site.max() >= len(sites)):
        raise err("key_b", f"a site index outside the {len(sites)} sites")
    state = cols["key_state"]
    if K and (state.min() < 0 or state.max() > UNUSABLE):
        raise err("key_state", "a state that is none of bitwise, noisy, unusable")
    _in_range(cols["key_dtype"], -1, len(dtypes), "key_dtype", err)
    if np.any(cols["key_numel"] < -1):
        raise err("key_numel", "a negative element count")
    _in_range(cols["key_reason"], -1, len(reasons), "key_reason", err)
    if np.any((cols["key_reason"] >= 0) != (state == UNUSABLE)):
        raise err("key_reason", "a reason for a key with a band, or none for one without")
    if np.any(cols["key_differ"] < 0) or np.any(cols["key_differ"] > pairs):
        raise err("key_differ", f"a count outside 0..{pairs}")
    ps = cols["piece_start"]
    P = len(cols["p_ndim"])
    if len(ps) != K + 1 or (len(ps) and (ps[0] != 0 or ps[-1] != P)) or np.any(np.diff(ps) < 0):
        raise err("piece_start", f"not {K + 1} non-decreasing offsets from 0 to {P}")
    if np.any((np.diff(ps) > 0) & (state != NOISY)):
        raise err("piece_start", "pieces for a key without noise")
    for f in ("p_bitwise", *(f"p_{x}" for x in KEY_FIELDS)):
        if len(cols[f]) != P:
            raise err(f, f"{len(cols[f])} entries for {P} pieces")
    for f in (*(f"key_{x}" for x in KEY_FIELDS), *(f"p_{x}" for x in KEY_FIELDS)):
        if np.any(cols[f] < 0):
            raise err(f, "a negative distance")
    boxes = _boxes(cols, P, err)
    return Bands(
        runs=runs, pairs=pairs, sites=sites, dtypes=dtypes, when=a, where=b, state=state,
        dtype=cols["key_dtype"], numel=cols["key_numel"], differ=cols["key_differ"],
        piece_start=ps, p_box=boxes,
        p_bitwise=cols["p_bitwise"], **{f: cols[f"key_{f}"] for f in KEY_FIELDS},
        **{f"p_{f}": cols[f"p_{f}"] for f in KEY_FIELDS},
        reasons={int(g): reasons[int(r)] for g, r in enumerate(cols["key_reason"]) if r >= 0},
        meta={k: v for k, v in meta.items() if k not in ("sites", "dtypes", "reasons")})


def _strings(meta: dict, field: str, err) -> list[str]:
    v = meta.get(field)
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise err(f"meta.{field}", "not a list of strings")
    return v


def _in_range(col: np.ndarray, lo: int, hi: int, field: str, err) -> None:
    if len(col) and (int(col.min()) < lo or int(col.max()) >= hi):
        raise err(field, f"an index outside {lo}..{hi - 1}")


def _boxes(cols: dict, P: int, err) -> list:
    ndim, starts, dims = cols["p_ndim"], cols["p_dims_start"], cols["p_dims"]
    if len(starts) != P + 1 or (len(starts) and (starts[0] != 0 or starts[-1] != len(dims))):
        raise err("p_dims_start", f"not {P + 1} offsets from 0 to {len(dims)}")
    if np.any(ndim < -1) or np.any(np.diff(starts) != 2 * np.maximum(ndim, 0)):
        raise err("p_ndim", "a box whose dims do not match its offsets and shape")
    if np.any(dims < 0):
        raise err("p_dims", "a negative offset or size")
    out: list = []
    for j in range(P):
        n = int(ndim[j])
        if n < 0:
            out.append(None)
            continue
        d = dims[int(starts[j]):int(starts[j + 1])].tolist()
        out.append((tuple(d[:n]), tuple(d[n:])))
    return out


def describe_file(bands: Bands) -> str:
    """One line: what a bands file holds."""
    c = bands.counts()
    return (f"bands of {len(bands)} keys among {len(bands.runs)} runs ({', '.join(bands.runs)}; "
            f"{bands.pairs} pairs): {c['noisy']} noisy, {c['bitwise']} bitwise equal, "
            f"{c['unusable']} without a band")

