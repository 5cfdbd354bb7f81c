"""The JSON report (docs/report-schema.md), streamed one finding at a time."""

from __future__ import annotations

import io
import json
import math
from typing import IO

import numpy as np

from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.measure.comparison import METRIC_NAMES
from numaudit.auditor.compare.merge import tiling as M
from numaudit.auditor.compare.read.align import phase_name
from numaudit.auditor.compare.read.columns import shape_flags
from numaudit.auditor.compare.result import Report
from numaudit.wire.vocabulary import ROLE_NAMES


class _IdenticalWriter:
    """JSON of identical and close findings without building Findings (the bulky cases).

    Produces exactly `Finding.as_dict()` serialized by json.dumps, from bulk-converted columns
    (tests/auditor/report/test_report.py holds the two to equality).
    """

    def __init__(self, comp) -> None:
        self.comp = comp
        names = comp.catalog.site_names
        self._sites = {sid: json.dumps(n) for sid, n in names.items()}
        self._rules = [json.dumps(r) for r in comp.rule_labels]
        self._dtypes = [json.dumps(d) for d in comp.catalog.dtypes]
        self._shapes = [json.dumps(list(s[0])) for s in comp.catalog.shapes]
        self._flat = shape_flags(comp.catalog.shapes)[0]
        """Per shape code (-1: the last), whether it is a flat key's (only its count)."""
        self._ref_ranks = comp.ref.rank.tolist()
        self._cand_ranks = comp.cand.rank.tolist()

    def renderable(self, idx: np.ndarray) -> np.ndarray:
        """Identical findings, and close ones without notes or payload metrics."""
        c = self.comp
        v = c.verdict[idx]
        both = (c.ref_index[idx] >= 0) & (c.cand_index[idx] >= 0)
        ok = ((v == F.IDENTICAL) | (v == F.CLOSE)) & both
        if c.notes:
            ok &= ~np.isin(idx, list(c.notes))
        if c.payload:
            ok &= ~np.isin(idx, list(c.payload))
        if c.noise:  # judged against the reference's noise bands: metrics.noise
            ok &= ~np.isin(idx, list(c.noise))
        return ok

    def render_many(self, idx: np.ndarray) -> list[str]:
        c = self.comp
        rk, ck = c.ref_keys, c.cand_keys
        ri, ci = c.ref_index[idx], c.cand_index[idx]
        A, B = c.when[idx].tolist(), c.where[idx].tolist()
        none = (rk.status[ri] == M.NONE).tolist()
        r_first, r_count = rk.first[ri].tolist(), rk.count[ri].tolist()
        c_first, c_count = ck.first[ci].tolist(), ck.count[ci].tolist()
        dt_r, dt_c = rk.dtype[ri].tolist(), ck.dtype[ci].tolist()
        shape, numel = ck.shape[ci], ck.numel[ci].tolist()
        # a flat candidate's shape is only its count: the reference's says more (as in Finding)
        shape = np.where(self._flat[shape] & (rk.shape[ri] >= 0), rk.shape[ri], shape).tolist()
        st_r, st_c = rk.stage[ri].tolist(), ck.stage[ci].tolist()
        nf_r, nf_c = (rk.nonfinite[ri] > 0).tolist(), (ck.nonfinite[ci] > 0).tolist()
        rule, order = c.rule[idx].tolist(), c.rank_in_order[idx].tolist()
        close = (c.verdict[idx] == F.CLOSE).tolist()
        rr, cr = self._ref_ranks, self._cand_ranks
        sites, rules, dtypes, shapes = self._sites, self._rules, self._dtypes, self._shapes
        if any(close):
            exact = (rk.exact[ri] & ck.exact[ci]).tolist()
            fp_eq = (rk.fp[ri] == ck.fp[ci]).tolist()
            partial = (rk.partial[ri] | ck.partial[ci]).tolist()
            metric = c.metric[idx].tolist()
            cols = [c.value, c.sigma, c.threshold, c.rel_l2, c.rel_sigma, c.lower_bound,
                    c.cos_dist, c.cos_sigma, c.norm_ratio, c.abs_max_ratio]
            nums = [[_num(x) for x in col[idx].tolist()] for col in cols]
            unc = c.uncertain[idx].tolist()
            nfc = c.nonfinite_counts[idx].tolist() if c.nonfinite_counts is not None else None
        out = []
        for j in range(len(A)):
            a, b = A[j], B[j]
            sid = b >> 32
            site = sites.get(sid) or json.dumps(f"site#{sid}")
            if close[j]:
                value, sigma, thr, rel, rels, lb, cosd, coss, nr, ar = (n[j] for n in nums)
                if exact[j]:
                    ex = f'"exact": {"true" if fp_eq[j] else "false"}'
                else:
                    ex = '"exact": null, "exact_unavailable": ' + (
                        _PARTIAL_WHY if partial[j] else json.dumps(F.OTHER_DIGESTS))
                extra = ""
                if rel != "null":
                    extra = (f', "rel_l2": {{"estimate": {rel}, "sigma": {rels}, "lower_bound": '
                             f'{lb}}}, "cosine_distance": {{"estimate": {cosd}, "sigma": {coss}}}'
                             f', "norm_ratio": {nr}, "abs_max_ratio": {ar}')
                if nfc is not None and nfc[j][0] >= 0:
                    n6 = nfc[j]
                    extra += (f', "nonfinite": {{"ref": {{"nan": {n6[0]}, "posinf": {n6[1]}, '
                              f'"neginf": {n6[2]}}}, "cand": {{"nan": {n6[3]}, "posinf": '
                              f'{n6[4]}, "neginf": {n6[5]}}}}}')
                mname = json.dumps(METRIC_NAMES[metric[j]]) if metric[j] >= 0 else "null"
                body = (f'"dtype": {{"ref": {dtypes[dt_r[j]]}, "cand": {dtypes[dt_c[j]]}}}, '
                        f'"shape": {shapes[shape[j]]}, "numel": {numel[j]}, "metric": {mname}, '
                        f'"value": {value}, "sigma": {sigma}, "threshold": {thr}, '
                        f'"uncertain": {"true" if unc[j] else "false"}, "metrics": {{{ex}, '
                        '"nonfinite_present": {"ref": '
                        f'{"true" if nf_r[j] else "false"}, "cand": '
                        f'{"true" if nf_c[j] else "false"}}}{extra}}}')
                out.append(
                    f'{{"key": {{"step": {a >> 24}, "microbatch": {((a >> 4) & 0xFFFFF) - 1}, '
                    f'"phase": "{phase_name(a & 0xF)}", "site": {site}, '
                    f'"role": "{_ROLE[(b >> 28) & 0xF]}", "index": {(b >> 14) & 0x3FFF}, '
                    f'"call": {b & 0x3FFF}}}, "verdict": "close", "breach": false, '
                    f'"stage": {st_c[j]}, "ref_stage": {st_r[j]}, '
                    f'"ranks": {{"ref": {rr[r_first[j]:r_first[j] + r_count[j]]}, '
                    f'"cand": {cr[c_first[j]:c_first[j] + c_count[j]]}}}, {body}, '
                    f'"rule": {rules[rule[j]]}, "expected": false, "detail": "", '
                    f'"notes": [], "cause": null, "pieces": null, "order": {order[j]}, '
                    '"group": null}')
                continue
            if none[j]:
                body = ('"dtype": {"ref": null, "cand": null}, "shape": null, "numel": null, '
                        '"metric": null, "value": null, "sigma": null, "threshold": null, '
                        '"uncertain": false, "metrics": {}')
                detail = "None in both runs"
            else:
                body = (f'"dtype": {{"ref": {dtypes[dt_r[j]]}, "cand": {dtypes[dt_c[j]]}}}, '
                        f'"shape": {shapes[shape[j]]}, "numel": {numel[j]}, "metric": "exact", '
                        '"value": null, "sigma": null, "threshold": null, "uncertain": false, '
                        '"metrics": {"exact": true, "nonfinite_present": {"ref": '
                        f'{"true" if nf_r[j] else "false"}, "cand": '
                        f'{"true" if nf_c[j] else "false"}}}}}')
                detail = ""
            out.append(
                f'{{"key": {{"step": {a >> 24}, "microbatch": {((a >> 4) & 0xFFFFF) - 1}, '
                f'"phase": "{phase_name(a & 0xF)}", "site": {site}, '
                f'"role": "{_ROLE[(b >> 28) & 0xF]}", "index": {(b >> 14) & 0x3FFF}, '
                f'"call": {b & 0x3FFF}}}, "verdict": "identical", "breach": false, '
                f'"stage": {st_c[j]}, "ref_stage": {st_r[j]}, '
                f'"ranks": {{"ref": {rr[r_first[j]:r_first[j] + r_count[j]]}, '
                f'"cand": {cr[c_first[j]:c_first[j] + c_count[j]]}}}, {body}, '
                f'"rule": {rules[rule[j]]}, "expected": false, "detail": "{detail}", '
                f'"notes": [], "cause": null, "pieces": null, "order": {order[j]}, '
                '"group": null}'
            )
        return out


_ROLE = dict(ROLE_NAMES)
_PARTIAL_WHY = json.dumps("Partial placement: the logical tensor's fingerprint cannot be rebuilt "
                          "from addends")


def _num(v: float) -> str:
    """A float as Finding.as_dict() + json.dumps write it: NaN null, infinities as strings."""
    if v != v:
        return "null"
    if v in (math.inf, -math.inf):
        return '"inf"' if v > 0 else '"-inf"'
    return repr(v)


def write_json(report: Report, out: IO[str], *, include_identical: bool = True,
               indent: int | None = None) -> None:
    """Stream the JSON report to ``out`` (findings one at a time)."""
    head = report.header_dict()
    head["findings_included"] = "all" if include_identical else "non_identical"
    if not include_identical:
        head["findings_omitted"] = {"identical": report.counts.get("identical", 0)}
    text = json.dumps(head, indent=indent, allow_nan=False)
    out.write(text[:-1].rstrip() + (",\n" if indent else ",") + ' "findings": [')
    comp = report.comparison
    fast = _IdenticalWriter(comp)
    sep = ",\n  " if indent else ","
    idx = comp.indices(include_identical=include_identical)
    for start in range(0, len(idx), 4096):
        chunk = idx[start:start + 4096]
        quick = fast.renderable(chunk)
        rendered = fast.render_many(chunk[quick]) if quick.any() else []
        parts: list[str] = []
        it = iter(rendered)
        for i, q in zip(chunk.tolist(), quick.tolist()):
            parts.append(next(it) if q else
                         json.dumps(report.finding(i).as_dict(), allow_nan=False))
        out.write(("\n  " if indent and start == 0 else ("" if start == 0 else sep))
                  + sep.join(parts))
    out.write(("\n" if indent else "") + "]}\n")


def to_json(report: Report, *, include_identical: bool = True, indent: int | None = None) -> str:
    """The whole JSON report as one string."""
    buf = io.StringIO()
    write_json(report, buf, include_identical=include_identical, indent=indent)
    return buf.getvalue()
