"""`auditor checkpoint`'s name prefixes: the `--map` two checkpoints need when one nests the
other's names (`dcp.save({"model": sd})` against a flat safetensors file of `sd`), applied when
it is unambiguous and suggested otherwise (`auditor.checkpoint.prefix`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from numaudit.auditor.checkpoint.prefix import PrefixMatch, prefix_match


def _toml_inline(m: PrefixMatch) -> str:
    """The map file's three lines, as a report line says them."""
    return f'`[[map]]`, `cand = "{m.cand_glob}"`, `ref = "{m.ref_glob}"`'


def prefix_map(sides: dict[str, Any], directory: Path) -> tuple[Any, list[str]]:
    """For two checkpoints read from files and no --map: (the name map, what the report says).
    The map when the prefix explains every CAND name unambiguously (applied, said so), else
    None with the map suggested; (None, []) when no prefix relates the names."""
    from numaudit.auditor.checkpoint.mapping import load_map

    if any(isinstance(s, str) for s in sides.values()):
        return None, []
    names = {side: [e.name for e in source.entries()] for side, source in sides.items()}
    m = prefix_match(names["ref"], names["cand"])
    if m is None:
        return None, []
    if not m.complete:
        return None, [_suggestion(m)]
    path = directory / "prefix-map.toml"
    path.write_text(m.toml())
    return load_map(path), [
        f"names: {m.describe()}: compared through the map {_toml_inline(m)} (applied: it "
        "pairs every name of cand; a --map FILE of these lines says so explicitly)"]


def suggestion_from_report(report: Any) -> list[str]:
    """Where the comparison's missing entries are one side's names with a prefix: the map
    that pairs them (for a run: side, or a prefix not applied before the comparison)."""
    only: dict[str, set[str]] = {"missing_in_cand": set(), "missing_in_ref": set()}
    for f in report.findings(breaches_only=True):
        if f.verdict in only and f.key.phase == "state":
            only[f.verdict].add(f.key.site)
    m = prefix_match(only["missing_in_cand"], only["missing_in_ref"])
    return [_suggestion(m)] if m is not None else []


def _suggestion(m: PrefixMatch) -> str:
    return (f"names: {m.describe()}: a map file of the lines {_toml_inline(m)} pairs them "
            "(auditor checkpoint REF CAND --map FILE)")


MEASURED_ENTRIES = 20
"""Breaching tensor entries (the earliest) whose values `measure_differences` reads back."""


def measure_differences(report: Any, sides: dict[str, Any], name_map: Any, cap: int) -> int:
    """A checkpoint compared bitwise says only that fingerprints differ: for the first
    MEASURED_ENTRIES diverged tensors that both sides read from files and that fit `cap` bytes
    each, read both back and measure how much and where (max_abs, ulp, the largest
    difference's index: the finding's `metrics.payload`). Returns how many were measured."""
    from numaudit.auditor.compare.measure import findings as F

    if any(isinstance(s, str) for s in sides.values()):
        return 0
    comp = report.comparison
    todo = [int(i) for i in comp.indices(breaches_only=True)
            if int(comp.verdict[i]) == F.DIVERGED and int(i) not in comp.payload]
    todo = todo[:MEASURED_ENTRIES]
    if not todo:
        return 0
    ref = {e.name: (e, False) for e in sides["ref"].entries() if e.dtype is not None}
    cand = {}
    for e in sides["cand"].entries():
        if e.dtype is not None:
            name, transposed = name_map.apply(e.name) if name_map is not None else (e.name, False)
            cand[name] = (e, transposed)
    measured = 0
    for i in todo:
        site = comp.key(i).site
        if site not in ref or site not in cand:
            continue
        got = _measure(ref[site], cand[site], cap)
        if got is not None:
            comp.payload[i] = got
            measured += 1
            if report.first is not None and report.first.key == comp.key(i):
                report.first.metrics["payload"] = {k: v for k, v in got.items()
                                                   if not k.startswith("_")}
    return measured


def _load(entry: Any, transposed: bool):
    import torch

    out = torch.empty(entry.shape, dtype=entry.dtype)
    for c in entry.chunks:
        box = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.shape))
        out[box] = c.read(0, c.numel, None).reshape(c.shape)
    return out.t() if transposed and out.dim() == 2 else out


def _measure(ref: tuple, cand: tuple, cap: int) -> dict | None:
    """Exact metrics of one entry from both files' values (None when it does not fit `cap`
    or the shapes or dtypes differ)."""
    import math

    import numpy as np
    import torch

    from numaudit.auditor.compare.digests.metrics import json_float, payload_metrics
    from numaudit.auditor.compare.digests.ulp import ulp_distance

    (r_entry, _), (c_entry, _) = ref, cand
    itemsize = torch.empty((), dtype=r_entry.dtype).element_size()
    if r_entry.dtype != c_entry.dtype or math.prod(r_entry.shape) * itemsize * 2 > cap \
            or not r_entry.dtype.is_floating_point or itemsize > 8:
        return None
    r, c = _load(*ref), _load(*cand)
    if r.shape != c.shape:
        return None
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]
    rb = r.contiguous().view(bits).numpy().view(f"u{itemsize}")
    cb = c.contiguous().view(bits).numpy().view(f"u{itemsize}")
    rv, cv = r.double().numpy(), c.double().numpy()
    pm = payload_metrics(rv, cv, rtol=0.0, atol=0.0, ref_bits=rb, cand_bits=cb, ulp_ok=True)
    pm.mismatched = int(np.count_nonzero(rb != cb))  # bitwise: every element that differs
    dtype = str(r_entry.dtype).removeprefix("torch.")
    pm.ulp = ulp_distance(rb, cb, rv, cv, dtype)
    out = pm.as_dict()
    out["allclose"] = None  # no tolerance: the checkpoint is compared bit for bit
    out["_bitwise"] = False
    out["rel_l2"] = json_float(pm.rel_l2)
    return out
