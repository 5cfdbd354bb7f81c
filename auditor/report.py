"""Reports of a comparison: text (rich, terminal width), JSON (docs/report-schema.md), JUnit XML.

The `Report` wraps the engine's columnar `Comparison`; findings are materialized one at a time
while a report is written, so a million identical keys cost no million objects until someone
asks for them in JSON.
"""

from __future__ import annotations

import io
import json
import math
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import IO, Iterable, Iterator

import numpy as np

from auditor import findings as F
from auditor import merge as M
from auditor.align import PHASE_IDS, phase_name
from auditor.policy import Policy
from auditor.findings import format_float
from auditor.ranges import format_ranges
from auditor.engine import _METRIC_NAMES

SCHEMA = "numaudit.report"
SCHEMA_VERSION = 1
"""Bumped on any change that could break a reader of the JSON report (docs/report-schema.md)."""
TEXT_ROWS_PER_GROUP = 50
"""Breaching findings listed per (phase, stage) group in the text report unless --limit says."""


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("numaudit")
    except Exception:  # not installed (running from a checkout)
        return "0+unknown"


@dataclass
class Report:
    """The outcome of comparing two runs."""

    comparison: object
    """auditor.engine.Comparison"""
    ref: dict
    cand: dict
    policy: Policy
    counts: dict[str, int]
    first: F.Finding | None
    graph_breaks: list[F.GraphBreak]
    warnings: list[str] = field(default_factory=list)
    generated_unix: float = field(default_factory=time.time)

    @property
    def breaches(self) -> int:
        return int(self.comparison.breach.sum())

    @property
    def exit_code(self) -> int:
        """0 = every finding within policy, 1 = some finding breaches it."""
        return 1 if self.breaches else 0

    @property
    def uncertain(self) -> int:
        return int(self.comparison.uncertain.sum())

    @classmethod
    def build(cls, comp, ref_info: dict, cand_info: dict, policy: Policy) -> Report:
        counts = comp.counts()
        fd = comp.first_divergence()
        first = comp.finding(fd) if fd >= 0 else None
        warnings = list(comp.catalog.warnings) + _run_warnings(ref_info, cand_info)
        if first is not None and first.cause and first.key.step > 0 \
                and not comp._step_keys(first.key.step, (PHASE_IDS["param"],)).size:
            first.notes.append("parameter values were not captured: a divergence of the weights "
                               "(an optimizer difference) would first show here")
        return cls(comparison=comp, ref=ref_info, cand=cand_info, policy=policy, counts=counts,
                   first=first, graph_breaks=graph_breaks(comp), warnings=warnings)

    # -- iteration --------------------------------------------------------------------------------

    def findings(self, *, breaches_only: bool = False,
                 include_identical: bool = True) -> Iterator[F.Finding]:
        """Findings in execution order."""
        return self.comparison.findings(breaches_only=breaches_only,
                                        include_identical=include_identical)

    def summary_line(self) -> str:
        return summary_line(self.header_dict()["summary"])

    # -- JSON -------------------------------------------------------------------------------------

    def header_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "generated_unix": self.generated_unix,
            "numaudit_version": _version(),
            "runs": {"ref": self.ref, "cand": self.cand},
            "policy": self.policy.describe(),
            "summary": {
                "keys": int(len(self.comparison)),
                "verdicts": {v: self.counts.get(v, 0) for v in F.VERDICTS},
                "ignored": self.counts.get("ignored", 0),
                "breaches": self.breaches,
                "uncertain": self.uncertain,
                "exit_code": self.exit_code,
            },
            "first_divergence": None if self.first is None else self.first.as_dict(),
            "graph_breaks": [g.as_dict() for g in self.graph_breaks],
            "warnings": self.warnings,
        }

    def write_json(self, out: IO[str], *, include_identical: bool = True,
                   indent: int | None = None) -> None:
        """Stream the JSON report to ``out`` (findings one at a time)."""
        head = self.header_dict()
        head["findings_included"] = "all" if include_identical else "non_identical"
        if not include_identical:
            head["findings_omitted"] = {"identical": self.counts.get("identical", 0)}
        text = json.dumps(head, indent=indent, allow_nan=False)
        out.write(text[:-1].rstrip() + (",\n" if indent else ",") + ' "findings": [')
        fast = _IdenticalWriter(self.comparison)
        comp = self.comparison
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
                             json.dumps(comp.finding(i).as_dict(), allow_nan=False))
            out.write(("\n  " if indent and start == 0 else ("" if start == 0 else sep))
                      + sep.join(parts))
        out.write(("\n" if indent else "") + "]}\n")

    def to_json(self, *, include_identical: bool = True, indent: int | None = None) -> str:
        buf = io.StringIO()
        self.write_json(buf, include_identical=include_identical, indent=indent)
        return buf.getvalue()

    # -- text -------------------------------------------------------------------------------------

    def to_text(self, *, width: int | None = None, show_all: bool = False,
                limit: int = TEXT_ROWS_PER_GROUP, color: bool = False) -> str:
        return render_text(self.header_dict(), self._text_findings(show_all, limit), width=width,
                           show_all=show_all, limit=limit, color=color)

    def _text_findings(self, show_all: bool, limit: int) -> Iterator[dict]:
        """Findings for the text report: the rows it lists in full, the others reduced to what
        it counts (a million breaches must not build a million Findings to print fifty)."""
        comp = self.comparison
        rk, ck = comp.ref_keys, comp.cand_keys
        collapse = bool(self.graph_breaks)
        grad, grad_none = PHASE_IDS["grad"], F.GRAD_NONE
        listed: dict[tuple, int] = {}
        for i in comp.indices(breaches_only=not show_all).tolist():
            ri, ci = int(comp.ri[i]), int(comp.ci[i])
            stage = int(ck.stage[ci]) if ci >= 0 else None
            ref_stage = int(rk.stage[ri]) if ri >= 0 else None
            ph, v = int(comp.A[i] & 0xF), int(comp.verdict[i])
            group = (ph, stage if stage is not None else (ref_stage or -1))
            listable = not (collapse and ph == grad and v == grad_none)
            n = listed.get(group, 0)
            if listable:
                listed[group] = n + 1
            if listable and (limit <= 0 or n < limit):
                yield comp.finding(i).as_dict()
            else:
                yield {"key": {"phase": phase_name(ph)}, "stage": stage, "ref_stage": ref_stage,
                       "verdict": F.VERDICT_NAMES[v], "breach": bool(comp.breach[i]),
                       "order": int(comp.rank_in_order[i])}

    def to_junit(self) -> str:
        return render_junit(self.header_dict(), self._lite_findings())

    def _lite_findings(self) -> Iterator[dict]:
        """Finding dicts; identical ones reduced to what the JUnit report reads."""
        comp = self.comparison
        for i in comp.indices():
            if comp.verdict[i] == F.IDENTICAL:
                k = comp.key(int(i))
                yield {"key": k.as_dict(), "verdict": "identical", "breach": False}
            else:
                yield comp.finding(int(i)).as_dict()


class _IdenticalWriter:
    """JSON of identical and close findings without building Findings (the bulky cases).

    Produces exactly `Finding.as_dict()` serialized by json.dumps (tests/auditor/test_report.py
    holds the two to equality), from bulk-converted columns.
    """

    def __init__(self, comp) -> None:
        self.comp = comp
        names = comp.catalog.site_names
        self._sites = {sid: json.dumps(n) for sid, n in names.items()}
        self._rules = [json.dumps(r) for r in comp.rule_labels]
        self._dtypes = [json.dumps(d) for d in comp.catalog.dtypes]
        self._shapes = [json.dumps(list(s[0])) for s in comp.catalog.shapes]
        self._ref_ranks = comp.ref.rank.tolist()
        self._cand_ranks = comp.cand.rank.tolist()

    def renderable(self, idx: np.ndarray) -> np.ndarray:
        """Identical findings, and close ones without notes or payload metrics."""
        c = self.comp
        v = c.verdict[idx]
        ok = ((v == F.IDENTICAL) | (v == F.CLOSE)) & (c.ri[idx] >= 0) & (c.ci[idx] >= 0)
        if c.notes:
            ok &= ~np.isin(idx, list(c.notes))
        if c.payload:
            ok &= ~np.isin(idx, list(c.payload))
        return ok

    def render_many(self, idx: np.ndarray) -> list[str]:
        c = self.comp
        rk, ck = c.ref_keys, c.cand_keys
        ri, ci = c.ri[idx], c.ci[idx]
        A, B = c.A[idx].tolist(), c.B[idx].tolist()
        none = (rk.status[ri] == M.NONE).tolist()
        r_first, r_count = rk.first[ri].tolist(), rk.count[ri].tolist()
        c_first, c_count = ck.first[ci].tolist(), ck.count[ci].tolist()
        dt_r, dt_c = rk.dtype[ri].tolist(), ck.dtype[ci].tolist()
        shape, numel = ck.shape[ci].tolist(), ck.numel[ci].tolist()
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
                        _PARTIAL_WHY if partial[j] else '"digests were made with other seeds"')
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
                mname = json.dumps(_METRIC_NAMES[metric[j]]) if metric[j] >= 0 else "null"
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
                    f'"notes": [], "cause": null, "order": {order[j]}}}')
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
                f'"notes": [], "cause": null, "order": {order[j]}}}'
            )
        return out


from auditor.align import ROLE_NAMES as _ROLE_NAMES  # noqa: E402

_ROLE = {k: v for k, v in _ROLE_NAMES.items()}
_PARTIAL_WHY = json.dumps("Partial placement: the logical tensor's fingerprint cannot be rebuilt "
                          "from addends")


def _num(v: float) -> str:
    """A float as Finding.as_dict() + json.dumps write it: NaN null, infinities as strings."""
    if v != v:
        return "null"
    if v in (math.inf, -math.inf):
        return '"inf"' if v > 0 else '"-inf"'
    return repr(v)


def _run_warnings(ref: dict, cand: dict) -> list[str]:
    out = []
    for info in (ref, cand):
        n = info["name"]
        if info["ranks_registered"] < info["world_size"]:
            out.append(f"{n}: only {info['ranks_registered']} of {info['world_size']} ranks "
                       "registered: keys of the others are missing")
        if info["ranks_closed"] < info["ranks_registered"]:
            out.append(f"{n}: {info['ranks_registered'] - info['ranks_closed']} ranks have not "
                       "closed their session: the run may still be sending")
        if info["dropped"]:
            out.append(f"{n}: agents dropped {info['dropped']} records (see `auditor show {n}`)")
        if info["conflicts"]:
            out.append(f"{n}: {info['conflicts']} records were resent with other content "
                       "(first stored kept)")
    if ref.get("dtype") and cand.get("dtype") and ref["dtype"] != cand["dtype"]:
        out.append(f"training dtypes differ ({ref['dtype']} vs {cand['dtype']}): each key gets "
                   "the looser of its two dtypes' tolerances")
    return out


# -- graph breaks ------------------------------------------------------------------------------------

def graph_breaks(comp) -> list[F.GraphBreak]:
    """Group grad_none and all-zero parameter gradients (GRAD phase) by run, stage and module."""
    grad = PHASE_IDS["grad"]
    is_grad = (comp.A & 0xF) == grad
    if not is_grad.any():
        return []
    rk, ck = comp.ref_keys, comp.cand_keys
    names = {"ref": comp.ref.name, "cand": comp.cand.name}
    site_names = comp.catalog.site_names
    idx = np.flatnonzero(is_grad & (comp.verdict != F.IGNORED))
    ri, ci = comp.ri[idx], comp.ci[idx]
    both_ok = (ri >= 0) & (ci >= 0)
    zr = np.where(both_ok, rk.all_zero[np.maximum(ri, 0)] if len(rk) else -1, -1)
    zc = np.where(both_ok, ck.all_zero[np.maximum(ci, 0)] if len(ck) else -1, -1)
    zero_diff = both_ok & (zr >= 0) & (zc >= 0) & (zr != zc) & (comp.verdict[idx] != F.GRAD_NONE)
    none = comp.verdict[idx] == F.GRAD_NONE
    if not (none.any() or zero_diff.any()):  # the common case: nothing to group
        return []
    entries: list[tuple] = []
    totals_stage: dict[tuple, set[str]] = {}
    totals_run: dict[str, set[str]] = {"ref": set(), "cand": set()}
    for i, r, c, is_none, zd, z_ref in zip(idx.tolist(), ri.tolist(), ci.tolist(),
                                            none.tolist(), zero_diff.tolist(), zr.tolist()):
        site = site_names.get(int(comp.B[i] >> 32), "")
        stage = int(comp.order_stage[i])
        for side, present in (("ref", r >= 0), ("cand", c >= 0)):
            if present:
                totals_run[side].add(site)
                totals_stage.setdefault((side, stage), set()).add(site)
        step = int(comp.A[i] >> 24)
        if is_none:
            side = "cand" if ck.status[c] == M.NONE else "ref"
            entries.append((side, "none", stage, site, step))
        elif zd:
            entries.append(("ref" if z_ref == 1 else "cand", "zero", stage, site, step))
    breaks = F.group_graph_breaks(entries, totals_stage, totals_run, names)
    _add_boundary(comp, breaks)
    return breaks


def _add_boundary(comp, breaks: list[F.GraphBreak]) -> None:
    """Name where gradients stop: the first stage (in pipeline order) without parameter
    gradients, and whether its input activation's backward was captured."""
    for side, kind in (("cand", "none"), ("cand", "zero"), ("ref", "none"), ("ref", "zero")):
        mine = [b for b in breaks if b.side == side and b.kind == kind]
        if not mine:
            continue
        what = "parameter gradients" if kind == "none" else "non-zero parameter gradients"
        keys = comp.cand_keys if side == "cand" else comp.ref_keys
        run = (comp.cand if side == "cand" else comp.ref).name
        stages = sorted({b.stage for b in mine if b.stage is not None and b.stage >= 0})
        in_stage = keys.stage == stages[0] if stages else np.ones(len(keys), bool)
        where = f"stage {stages[0]}" if stages else "the model"
        phase = keys.A & 0xF
        bwd = in_stage & (phase == PHASE_IDS["bwd"]) & (keys.status == M.OK)
        fwd = np.flatnonzero(in_stage & (phase == PHASE_IDS["fwd"]))
        text = f"gradients stop at {where} (the first without {what} in {run})"
        later = stages[0] + 1 if stages else None
        if later is not None and later not in stages and (keys.stage == later).any():
            text += (f", at the stage {stages[0]} -> {later} boundary (stage {later}'s parameters "
                     "received gradients)")
        any_bwd = ((keys.A & 0xF) == PHASE_IDS["bwd"]).any()
        if not any_bwd:
            text += (f"; {run} captured no activation gradients (phase bwd), so whether backward "
                     "reached the stage cannot be told: capture bwd to locate the cut")
        elif len(fwd):
            # the stage's input activation: its earliest forward capture
            first = fwd[np.argmin(keys.pos[fwd])]
            site_id = int(keys.B[first] >> 32)
            site = comp.catalog.site_names.get(site_id, "?")
            back = bwd & ((keys.B >> 32) == site_id)
            if back.any():
                text += (f": the backward of its input activation ({site}) was captured, so "
                         "gradients reached the stage but its parameters received none (a skipped "
                         "weight-gradient step, or gradients dropped or freed before capture)")
            elif bwd.any():
                text += (f": {int(bwd.sum())} activation gradients were captured in it but not the "
                         f"backward of its input activation ({site})")
            else:
                text += (f": no activation gradient was captured in it, not even for its input "
                         f"activation ({site}): backward never reached it")
        elif bwd.any():
            text += f": {int(bwd.sum())} activation gradients were captured in it"
        else:
            text += ": no activation gradient was captured in it either"
        target = next((b for b in mine if b.scope in ("run", "stage")), mine[0])
        target.boundary = text


# -- text ---------------------------------------------------------------------------------------------

def _ranks_text(ranks: list[int]) -> str:
    return format_ranges(ranks, "-")


def _run_text(info: dict) -> str:
    stages = info.get("stages") or []
    parts = [f"{info['world_size']} rank" + ("s" if info["world_size"] != 1 else "")]
    if len(stages) > 1:
        parts.append(f"stages {format_ranges(stages)}")
    if info.get("dtype"):
        parts.append(info["dtype"])
    return f"{info['name']} ({', '.join(parts)})"


def render_text(doc: dict, findings: Iterable[dict], *, width: int | None = None,
                show_all: bool = False, limit: int = TEXT_ROWS_PER_GROUP,
                color: bool = False) -> str:
    """The human report from the JSON form: summary, first divergence, graph breaks, warnings,
    then the findings (breaching ones, or all with ``show_all``) by phase and stage."""
    from rich.console import Console
    from rich.padding import Padding
    from rich.text import Text

    def para(text: str, indent: int, style: str = "") -> None:
        """A paragraph whose wrapped lines keep the indentation."""
        con.print(Padding(Text(text, style=style), (0, 0, 0, indent)))

    buf = io.StringIO()
    con = Console(file=buf, width=width or 100, force_terminal=color, no_color=not color,
                  highlight=False, soft_wrap=False)
    runs, pol, summ = doc["runs"], doc["policy"], doc["summary"]
    con.print(Text(f"numaudit: {_run_text(runs['ref'])} vs {_run_text(runs['cand'])}",
                   style="bold"))
    con.print(f"policy: {pol['name']} ({pol['source']}, sha256 {pol['sha256'][:12]})")
    con.print(Text(summary_line(summ), style="bold red" if summ["breaches"] else "bold green"))

    con.print()
    first = doc.get("first_divergence")
    if first is None:
        con.print(Text("First divergence: none", style="bold"))
    else:
        con.print(Text("First divergence", style="bold"))
        para(F.headline(first), 2, "red")
        if first.get("cause"):
            para(f"{first['cause']['kind']}: {first['cause']['reason']}", 2)
        para(f"ranks: {runs['ref']['name']} {_ranks_text(first['ranks']['ref'])}; "
             f"{runs['cand']['name']} {_ranks_text(first['ranks']['cand'])}; "
             f"rule: {first['rule']}", 2)
        payload = first.get("metrics", {}).get("payload")
        if payload and payload.get("worst"):
            w = payload["worst"]
            para(f"largest difference at {w['index']}: {w['ref']} vs {w['cand']} "
                 f"(max_abs {format_float(payload['max_abs'])}, "
                 f"ulp {format_float(payload['ulp'])})", 2)
        for note in first.get("notes", []):
            para(f"note: {note}", 2)

    if doc.get("graph_breaks"):
        con.print()
        con.print(Text("Backward-graph breaks", style="bold"))
        for g in doc["graph_breaks"]:
            para(f"- {g['message']}", 2, "red" if g["kind"] == "none" else "yellow")
            if g.get("boundary"):
                para(g["boundary"], 4)

    if doc.get("warnings"):
        con.print()
        con.print(Text("Warnings", style="bold"))
        for w in doc["warnings"]:
            para(f"- {w}", 2)

    groups: dict[tuple[str, int], list[dict]] = {}
    first_order: dict[tuple[str, int], int] = {}
    for f in findings:
        if not show_all and not f["breach"]:
            continue
        st = f["stage"] if f["stage"] is not None else (f.get("ref_stage") or -1)
        g = (f["key"]["phase"], st if st is not None else -1)
        groups.setdefault(g, []).append(f)
        first_order.setdefault(g, f.get("order", 0))
    con.print()
    title = "Findings" if show_all else "Breaching findings"
    if not groups:
        con.print(Text(f"{title}: none", style="bold"))
        return _rstrip_lines(buf.getvalue())
    con.print(Text(f"{title}, by phase and stage", style="bold"))
    summarized = bool(doc.get("graph_breaks"))
    for (phase, st), members in sorted(groups.items(), key=lambda kv: first_order[kv[0]]):
        label = phase + (f", stage {st}" if st >= 0 else "")
        rows = members
        collapsed = 0
        if phase == "grad" and summarized:
            rows = [f for f in members if f["verdict"] != "grad_none"]
            collapsed = len(members) - len(rows)
        con.print(Text(f"  {label}: {len(members)} findings", style="bold"))
        if collapsed:
            con.print(f"    {collapsed} grad_none, summarized under backward-graph breaks")
        if not rows:
            continue
        shown = rows if limit <= 0 else rows[:limit]
        texts = [_row_texts(f) for f in shown]
        shared = {t[1] for t in texts}
        common = shared.pop() if len(shared) == 1 and len(texts) > 1 else None
        if common:
            para(f"all listed: {common}", 4)
        # align the columns of the listed rows as far as the width allows
        widths = [max(len(t[0][c]) for t in texts) for c in range(3)]
        budget = (width or 100) - 4 - 6 - max(len(t[0][3]) for t in texts)
        if sum(widths) > budget:
            widths[1] = max(0, budget - widths[0] - widths[2])
        texts = [("  ".join(p.ljust(w) for p, w in zip(t[0][:3], widths)) + "  " + t[0][3],
                  t[1]) for t in texts]
        for f, (line, extra) in zip(shown, texts):
            style = "red" if f["breach"] else ("green" if f["verdict"] == "identical" else "")
            para(line, 4, style)
            if extra and extra != common:
                para(extra, 8)
        if len(rows) > len(shown):
            con.print(f"    ... and {len(rows) - len(shown)} more (--limit 0 lists all; "
                      "--format json has every finding)")
    return _rstrip_lines(buf.getvalue())


def _rstrip_lines(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.split("\n"))


def _row_texts(f: dict) -> tuple[tuple[str, str, str, str], str]:
    """A finding as the text report lists it: (where, what, verdict, measure), explanation."""
    k = f["key"]
    where = f"step {k['step']}" + (f" mb {k['microbatch']}" if k["microbatch"] >= 0 else "")
    role = k["role"] + (f"[{k['index']}]" if k["index"] else "") + \
        (f" call {k['call']}" if k["call"] else "")
    line = F.measure_text(f, compact=True)
    if not line and f.get("metric") and f["verdict"] != "identical":
        line = f["metric"]  # exact, shape: no number to show
    cause = f.get("cause")
    extra = f"{cause['kind']}: {cause['reason']}" if cause else f.get("detail", "")
    if f.get("notes"):
        extra = (extra + "; " if extra else "") + "; ".join(f["notes"])
    return (where, f"{k['site']} {role}", f["verdict"], line), extra


def summary_line(summ: dict) -> str:
    """"N keys: a identical, b close, ... — k breach the policy"."""
    v = summ["verdicts"]
    shown = [f"{v[name]} {name}" for name in F.VERDICTS if v.get(name)]
    keys = sum(v.values())
    text = f"{keys} keys: " + (", ".join(shown) or "none")
    if summ.get("ignored"):
        text += f" ({summ['ignored']} ignored by policy)"
    text += f" — {summ['breaches']} breach the policy" if summ["breaches"] else \
        " — all within policy"
    if summ.get("uncertain"):
        text += f"; {summ['uncertain']} within noise of their threshold"
    return text


def render_junit(doc: dict, findings: Iterable[dict]) -> str:
    """JUnit XML: a test suite per phase, a test case per site (failed when a key breaches)."""
    suites: dict[str, dict[str, list[dict]]] = {}
    for f in findings:
        k = f["key"]
        suites.setdefault(k["phase"], {}).setdefault(k["site"], []).append(f)
    runs = doc["runs"]
    root = ET.Element("testsuites", name=f"numaudit {runs['ref']['name']} vs {runs['cand']['name']}",
                      tests="0", failures="0")
    total = fails = 0
    for phase, cases in suites.items():
        suite = ET.SubElement(root, "testsuite", name=f"numaudit.{phase}", tests=str(len(cases)))
        nfail = 0
        for site, items in cases.items():
            tc = ET.SubElement(suite, "testcase", classname=f"numaudit.{phase}", name=site,
                               time="0")
            bad = [f for f in items if f["breach"]]
            if bad:
                nfail += 1
                verdicts = sorted({f["verdict"] for f in bad})
                fail = ET.SubElement(tc, "failure", type=",".join(verdicts),
                                     message=f"{len(bad)} of {len(items)} keys breach the policy; "
                                             f"first: {F.headline(bad[0])}")
                fail.text = "\n".join(F.headline(f) for f in bad[:100]) + (
                    f"\n... and {len(bad) - 100} more" if len(bad) > 100 else "")
            else:
                close = sum(1 for f in items if f["verdict"] == "close")
                out = ET.SubElement(tc, "system-out")
                out.text = f"{len(items)} keys: {len(items) - close} identical, {close} close"
        suite.set("failures", str(nfail))
        total += len(cases)
        fails += nfail
    root.set("tests", str(total))
    root.set("failures", str(fails))
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") \
        + "\n"
