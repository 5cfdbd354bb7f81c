"""The bands file (docs/noise.md, "The file"): saved bands read back equal, `np.load` reads it
without pickles, and every damaged or hostile file is refused naming the file and the field."""

from __future__ import annotations

import io
import json
import zipfile
from contextlib import closing

import numpy as np
import pytest

from numaudit.auditor.compare.noise.bands_file import BandsError, load_bands, save_bands
from numaudit.auditor.compare.noise.calibrate import measure_bands
from numaudit.auditor.compare.policy.load import preset_policy
from numaudit.auditor.store import Reader
from tests.auditor.noisy_runs import noisy_run
from tests.auditor.synth import write_runs


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bands")
    db = write_runs(tmp / "audit.db", noisy_run("ref", 1), noisy_run("ref2", 2),
                    noisy_run("ref3", 3))
    with closing(Reader(db)) as reader:
        bands = measure_bands(reader, ["ref", "ref2", "ref3"], preset_policy("bf16"))
    save_bands(bands, tmp / "bands.npz")
    return bands, tmp / "bands.npz"


def test_saved_bands_read_back_equal(saved):
    bands, path = saved
    got = load_bands(path)
    for f in ("when", "where", "state", "dtype", "numel", "differ", "rel", "sigma", "max_abs",
              "bound", "ulp", "share", "piece_start", "p_bitwise", "p_rel", "p_sigma", "p_max_abs",
              "p_bound", "p_ulp", "p_share"):
        assert np.array_equal(getattr(got, f), getattr(bands, f), equal_nan=True), f
    assert (got.p_box, got.runs, got.sites, got.dtypes, got.pairs) == \
        (bands.p_box, bands.runs, bands.sites, bands.dtypes, bands.pairs)
    assert got.meta["format"] == "numaudit.noise_bands" and got.meta["version"] == 1
    with np.load(path, allow_pickle=False) as npz:  # a plain .npz, no pickles
        assert json.loads(npz["meta"].tobytes())["runs"] == ["ref", "ref2", "ref3"]


def _rewrite(path, out, *, drop=(), replace=None, add=None):
    """A copy of the archive at ``path`` with members dropped, replaced or added."""
    replace = replace or {}
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            name = info.filename.removesuffix(".npy")
            if name in drop:
                continue
            data = src.read(info)
            if name in replace:
                data = replace[name](data)
            dst.writestr(info.filename, data)
        for name, data in (add or {}).items():
            dst.writestr(name, data)
    return out


def _npy(arr) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, arr, allow_pickle=True)
    return buf.getvalue()


def _meta(change):
    def edit(data: bytes) -> bytes:
        arr = np.lib.format.read_array(io.BytesIO(data))
        meta = json.loads(arr.tobytes())
        change(meta)
        return _npy(np.frombuffer(json.dumps(meta).encode(), np.uint8))
    return edit


def _column(f):
    def edit(data: bytes) -> bytes:
        return _npy(f(np.lib.format.read_array(io.BytesIO(data))))
    return edit


CASES = {
    "not_a_zip": (None, "not a bands file"),
    "missing": (dict(drop=("p_rel",)), "field 'p_rel': missing"),
    "extra": (dict(add={"evil.npy": b"x"}), "field 'evil': not a member"),
    "pickle": (dict(replace={"key_rel": lambda d: _npy(np.array([{"a": 1}], dtype=object))}),
               "field 'key_rel'"),
    "dtype": (dict(replace={"key_rel": _column(lambda a: a.astype(np.float32))}),
              "field 'key_rel': dtype float32"),
    "two_dims": (dict(replace={"key_a": _column(lambda a: a.reshape(1, -1))}),
                 "field 'key_a': shape"),
    "truncated": (dict(replace={"p_rel": lambda d: d[:-8]}), "field 'p_rel'"),
    "short_column": (dict(replace={"key_ulp": _column(lambda a: a[:-1])}),
                     "field 'key_ulp': 3 entries for 4 keys"),
    "unsorted": (dict(replace={"key_a": _column(lambda a: a[::-1].copy())}),
                 "field 'key_a': keys are not sorted"),
    "negative": (dict(replace={"p_rel": _column(lambda a: -a - 1)}),
                 "field 'p_rel': a negative distance"),
    "site": (dict(replace={"key_b": _column(lambda a: a + (50 << 32))}),
             "field 'key_b': a site index outside"),
    "version": (dict(replace={"meta": _meta(lambda m: m.update(version=2))}),
                "field 'meta.version': 2"),
    "format": (dict(replace={"meta": _meta(lambda m: m.update(format="other"))}),
               "field 'meta.format'"),
    "runs": (dict(replace={"meta": _meta(lambda m: m.update(runs=["ref"]))}),
             "field 'meta.runs'"),
    "dtypes": (dict(replace={"meta": _meta(lambda m: m.update(dtypes=["float33"]))}),
               "field 'meta.dtypes'"),
    "meta_json": (dict(replace={"meta": lambda d: _npy(np.frombuffer(b"{nope", np.uint8))}),
                  "field 'meta': not JSON"),
    "pieces": (dict(replace={"piece_start": _column(lambda a: a[::-1].copy())}),
               "field 'piece_start'"),
    "box": (dict(replace={"p_ndim": _column(lambda a: a + 1)}), "field 'p_ndim'"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_damaged_files_are_refused_naming_the_field(saved, tmp_path, case):
    _, path = saved
    how, message = CASES[case]
    bad = tmp_path / "bad.npz"
    if how is None:
        bad.write_bytes(b"\x80\x04not a zip")
    else:
        _rewrite(path, bad, **how)
    with pytest.raises(BandsError) as exc:
        load_bands(bad)
    assert str(exc.value).startswith(str(bad)) and message in str(exc.value)


def test_a_member_declaring_more_than_it_holds_allocates_nothing(saved, tmp_path):
    """An .npy header declaring 2**40 elements over a few bytes is refused from its size,
    before any array is made."""
    def huge(data: bytes) -> bytes:
        head = io.BytesIO()
        np.lib.format.write_array_header_1_0(head, {"descr": "<f8", "fortran_order": False,
                                                    "shape": (1 << 40,)})
        return head.getvalue() + b"\0" * 16  # the magic, the header, two float64s
    bad = _rewrite(saved[1], tmp_path / "huge.npz", replace={"key_rel": huge})
    with pytest.raises(BandsError, match="hold no 1099511627776 elements"):
        load_bands(bad)
