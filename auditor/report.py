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
        first = True
        fast = _IdenticalWriter(self.comparison)
        comp = self.comparison
        for i in comp.indices(include_identical=include_identical):
            if not first:
                out.write(",")
            first = False
            if indent:
                out.write("\n  ")
            if comp.verdict[i] == F.IDENTICAL and fast.ok(i):
                out.write(fast.render(i))
            else:
                out.write(json.dumps(comp.finding(i).as_dict(), allow_nan=False))
        out.write(("\n" if indent else "") + "]}\n")

    def to_json(self, *, include_identical: bool = True, indent: int | None = None) -> str:
        buf = io.StringIO()
        self.write_json(buf, include_identical=include_identical, indent=indent)
        return buf.getvalue()

    # -- text -------------------------------------------------------------------------------------

    def to_text(self, *, width: int | None = None, show_all: bool = False,
                limit: int = TEXT_ROWS_PER_GROUP, color: bool = False) -> str:
        findings = (f.as_dict() for f in self.findings(breaches_only=not show_all))
        return render_text(self.header_dict(), findings, width=width, show_all=show_all,
                           limit=limit, color=color)

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
    """JSON of identical findings without building a Finding (the common, bulky case)."""

    def __init__(self, comp) -> None:
        self.comp = comp
        self._sites: dict[int, str] = {}
        self._rules = [json.dumps(r) for r in comp.rule_labels]
        self._dtypes = [json.dumps(d) for d in comp.catalog.dtypes]
        self._shapes = [json.dumps(list(s[0])) for s in comp.catalog.shapes]

    def ok(self, i: int) -> bool:
        c = self.comp
        return c.ri[i] >= 0 and c.ci[i] >= 0 and i not in c.notes

    def render(self, i: int) -> str:
        c = self.comp
        a, b = int(c.A[i]), int(c.B[i])
        sid = b >> 32
        site = self._sites.get(sid)
        if site is None:
            site = self._sites[sid] = json.dumps(c.catalog.site_names.get(sid, f"site#{sid}"))
        ri, ci = int(c.ri[i]), int(c.ci[i])
        rk, ck = c.ref_keys, c.cand_keys
        none = rk.status[ri] == M.NONE
        rr = rk.ranks(c.ref, ri)
        cr = ck.ranks(c.cand, ci)
        if none:
            dt_r = dt_c = shape = "null"
            numel = "null"
            metrics = "{}"
        else:
            dt_r = self._dtypes[rk.dtype[ri]]
            dt_c = self._dtypes[ck.dtype[ci]]
            shape = self._shapes[ck.shape[ci]]
            numel = str(int(ck.numel[ci]))
            metrics = (f'{{"exact": true, "nonfinite_present": {{"ref": '
                       f'{"true" if rk.nonfinite[ri] else "false"}, "cand": '
                       f'{"true" if ck.nonfinite[ci] else "false"}}}}}')
        return (
            f'{{"key": {{"step": {a >> 24}, "microbatch": {((a >> 4) & 0xFFFFF) - 1}, '
            f'"phase": "{phase_name(a & 0xF)}", "site": {site}, '
            f'"role": "{_ROLE[(b >> 28) & 0xF]}", "index": {(b >> 14) & 0x3FFF}, '
            f'"call": {b & 0x3FFF}}}, "verdict": "identical", "breach": false, '
            f'"stage": {int(ck.stage[ci])}, "ref_stage": {int(rk.stage[ri])}, '
            f'"ranks": {{"ref": {rr}, "cand": {cr}}}, '
            f'"dtype": {{"ref": {dt_r}, "cand": {dt_c}}}, "shape": {shape}, "numel": {numel}, '
            f'"metric": {"null" if none else chr(34) + "exact" + chr(34)}, "value": null, '
            f'"sigma": null, "threshold": null, "uncertain": false, "metrics": {metrics}, '
            f'"rule": {self._rules[int(c.rule[i])]}, "expected": false, "detail": '
            f'"{"None in both runs" if none else ""}", "notes": [], "cause": null, '
            f'"order": {int(c.rank_in_order[i])}}}'
        )


from auditor.align import ROLE_NAMES as _ROLE_NAMES  # noqa: E402

_ROLE = {k: v for k, v in _ROLE_NAMES.items()}


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
    entries: list[tuple] = []
    totals_stage: dict[tuple, set[str]] = {}
    totals_run: dict[str, set[str]] = {"ref": set(), "cand": set()}
    for i in idx.tolist():
        site = site_names.get(int(comp.B[i] >> 32), "")
        step = int(comp.A[i] >> 24)
        stage = int(comp.order_stage[i])
        ri, ci = int(comp.ri[i]), int(comp.ci[i])
        for side, present in (("ref", ri >= 0), ("cand", ci >= 0)):
            if present:
                totals_run[side].add(site)
                totals_stage.setdefault((side, stage), set()).add(site)
        v = int(comp.verdict[i])
        if v == F.GRAD_NONE:
            side = "cand" if ck.status[ci] == M.NONE else "ref"
            entries.append((side, "none", stage, site, step))
        elif ri >= 0 and ci >= 0 and rk.status[ri] == M.OK and ck.status[ci] == M.OK:
            zr, zc = int(rk.all_zero[ri]), int(ck.all_zero[ci])
            if zr >= 0 and zc >= 0 and zr != zc:
                entries.append(("ref" if zr else "cand", "zero", stage, site, step))
    breaks = F.group_graph_breaks(entries, totals_stage, totals_run, names)
    _add_boundary(comp, breaks)
    return breaks


def _add_boundary(comp, breaks: list[F.GraphBreak]) -> None:
    """Name where gradients stop: the first stage (in pipeline order) without gradients."""
    for side in ("cand", "ref"):
        mine = [b for b in breaks if b.side == side and b.kind == "none"]
        if not mine:
            continue
        stages = sorted({b.stage for b in mine if b.stage is not None and b.stage >= 0})
        keys = comp.cand_keys if side == "cand" else comp.ref_keys
        cols = comp.cand if side == "cand" else comp.ref
        bwd = ((keys.A & 0xF) == PHASE_IDS["bwd"]) & (keys.status == M.OK)
        run = cols.name
        if stages:
            s = stages[0]
            in_stage = bwd & (keys.stage == s)
            n = int(in_stage.sum())
            where = f"stage {s}"
        else:
            in_stage = bwd
            n = int(bwd.sum())
            where = "the model"
        if n == 0:
            text = (f"gradients stop at {where} (first without parameter gradients in {run}): no "
                    "activation gradient was captured there either, so backward never reached it")
        else:
            sites = sorted({comp.catalog.site_names.get(int(b >> 32), "?")
                            for b in keys.B[in_stage][:1000]})
            text = (f"gradients stop at {where} (first without parameter gradients in {run}): "
                    f"{n} activation gradients were captured there (e.g. {sites[0]}), so backward "
                    "ran through it but its parameters received no gradient (weight-gradient "
                    "computation skipped, or gradients dropped or freed before capture)")
        for b in mine:
            if b.scope in ("run", "stage") or b is mine[0]:
                b.boundary = text
                break


def format_float(v: float | None) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if v == 0:
        return "0"
    if math.isinf(v) or math.isnan(v):
        return str(v)
    return f"{v:.3g}"


# -- text ---------------------------------------------------------------------------------------------

def _ranks_text(ranks: list[int]) -> str:
    from auditor.merge import _rank_list

    return _rank_list(ranks) or "-"


def _run_text(info: dict) -> str:
    stages = info.get("stages") or []
    parts = [f"{info['world_size']} rank" + ("s" if info["world_size"] != 1 else "")]
    if len(stages) > 1:
        parts.append(f"stages {_ranges(stages)}")
    if info.get("dtype"):
        parts.append(info["dtype"])
    return f"{info['name']} ({', '.join(parts)})"


def _ranges(values) -> str:
    from auditor.merge import _rank_list

    return _rank_list(values)


def render_text(doc: dict, findings: Iterable[dict], *, width: int | None = None,
                show_all: bool = False, limit: int = TEXT_ROWS_PER_GROUP,
                color: bool = False) -> str:
    """The human report from the JSON form: summary, first divergence, graph breaks, warnings,
    then the findings (breaching ones, or all with ``show_all``) by phase and stage."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

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
        con.print(Text("  " + F.headline(first), style="red"))
        if first.get("cause"):
            con.print(f"  {first['cause']['kind']}: {first['cause']['reason']}")
        con.print(f"  ranks: {runs['ref']['name']} {_ranks_text(first['ranks']['ref'])}; "
                  f"{runs['cand']['name']} {_ranks_text(first['ranks']['cand'])}; "
                  f"rule: {first['rule']}")
        payload = first.get("metrics", {}).get("payload")
        if payload and payload.get("worst"):
            w = payload["worst"]
            con.print(f"  largest difference at {w['index']}: {w['ref']} vs {w['cand']} "
                      f"(max_abs {format_float(payload['max_abs'])}, "
                      f"ulp {format_float(payload['ulp'])})")
        for note in first.get("notes", []):
            con.print(f"  note: {note}")

    if doc.get("graph_breaks"):
        con.print()
        con.print(Text("Backward-graph breaks", style="bold"))
        for g in doc["graph_breaks"]:
            con.print(Text(f"  - {g['message']}", style="red" if g["kind"] == "none" else "yellow"))
            if g.get("boundary"):
                con.print(f"    {g['boundary']}")

    if doc.get("warnings"):
        con.print()
        con.print(Text("Warnings", style="bold"))
        for w in doc["warnings"]:
            con.print(f"  - {w}")

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
        return buf.getvalue()
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
        table = Table(box=None, pad_edge=False, show_edge=False, padding=(0, 1),
                      header_style="bold")
        for name, kw in (("step", {"justify": "right"}), ("mb", {"justify": "right"}),
                         ("site", {"overflow": "fold", "ratio": 3}), ("role", {}),
                         ("verdict", {}), ("metric", {}), ("value", {"justify": "right"}),
                         ("threshold", {"justify": "right"}),
                         ("cause / detail", {"overflow": "fold", "ratio": 4})):
            table.add_column(name, **kw)
        shown = rows if limit <= 0 else rows[:limit]
        for f in shown:
            value = format_float(f.get("value"))
            if f.get("sigma"):
                value += f" ±{format_float(f['sigma'])}"
            if f.get("uncertain"):
                value += " ?"
            cause = f.get("cause")
            extra = f"{cause['kind']}: {cause['reason']}" if cause else f.get("detail", "")
            if f.get("notes"):
                extra = (extra + "; " if extra else "") + "; ".join(f["notes"])
            k = f["key"]
            role = k["role"] + (f"[{k['index']}]" if k["index"] else "") + \
                (f" #{k['call']}" if k["call"] else "")
            style = "red" if f["breach"] else ("green" if f["verdict"] == "identical" else "")
            table.add_row(str(k["step"]), str(k["microbatch"]) if k["microbatch"] >= 0 else "-",
                          k["site"], role, Text(f["verdict"], style=style), f.get("metric") or "-",
                          value, format_float(f.get("threshold")), extra or "")
        con.print(table)
        if len(rows) > len(shown):
            con.print(f"    ... and {len(rows) - len(shown)} more (--limit 0 lists all; "
                      "--format json has every finding)")
    return buf.getvalue()


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
