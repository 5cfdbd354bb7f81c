"""The HTML report: one self-contained file (inline CSS, SVG and JS; no network) to explore a
comparison in a browser (docs/report-html.md).

The page is built from the JSON report's form (docs/report-schema.md), reduced to what a browser
needs: a heatmap per phase (rows = modules in execution order, columns = step/microbatch), whose
cells are aggregated into buckets when a run has more modules or microbatches than a screen
shows, so 10^5 keys stay a small page; and the non-identical findings (at most
`MAX_TABLE_ROWS`, breaches first) for the table. Every string from a run (site names, run names,
notes) reaches the page inside a JSON blob whose `<`, `>` and `&` are escaped, and the page's
script writes it with `textContent` only, never as markup.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Iterable, Iterator

from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.read.align import phase_name
from numaudit.auditor.compare.read.ranges import format_ranges
from numaudit.auditor.compare.result import Report
from numaudit.auditor.report.html_assets import CSS, JS, SVG_DEFS
from numaudit.auditor.report.text import noise_line, run_text, summary_line
from numaudit.wire.vocabulary import ROLE_NAMES

MAX_ROWS = 64
"""Heatmap rows per phase; more modules are bucketed into this many rows."""
MAX_COLS = 64
"""Heatmap columns per phase; more (step, microbatch) pairs are bucketed into this many: 64
cells of at least `html_assets` CELL_MIN (16 px) fit the page's 1,100 px of heatmap."""
MAX_TABLE_ROWS = 2000
"""Findings listed in the table (breaches first, then the other non-identical ones)."""

IDENTICAL, WITHIN, BREACH = 0, 1, 2
"""A heatmap cell's state: every key identical; some differ within policy; some breach."""


def _num(v) -> float | str | None:
    """A metric as the page shows it: finite floats, "inf"/"-inf" strings, or None."""
    if v is None or isinstance(v, str):
        return v
    v = float(v)
    return None if math.isnan(v) else (v if not math.isinf(v) else ("inf" if v > 0 else "-inf"))


def _log10(v) -> float | None:
    if isinstance(v, (int, float)) and v > 0 and math.isfinite(v):
        return round(math.log10(v), 3)
    return None


def _state(f: dict) -> int:
    if f["breach"]:
        return BREACH
    return IDENTICAL if f["verdict"] == "identical" else WITHIN


class _Heatmap:
    """One phase's cells, before bucketing: per (site, column) the worst state and metric.

    Rows are the sites in execution order: by the earliest place any of a site's findings
    has in it (their ``order``), whatever order the findings come in."""

    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.sites: dict[str, int] = {}
        self.first: list[float] = []
        """Per site (by its index in `sites`): its earliest finding's execution order."""
        self.cols: set[tuple[int, int]] = set()
        self.cells: dict[tuple[int, tuple[int, int]], list] = {}

    def add(self, f: dict) -> tuple[int, tuple[int, int]]:
        k = f["key"]
        site = self.sites.setdefault(k["site"], len(self.sites))
        order = f.get("order")
        order = math.inf if order is None else order
        if site == len(self.first):
            self.first.append(order)
        elif order < self.first[site]:
            self.first[site] = order
        col = (k["step"], k["microbatch"])
        self.cols.add(col)
        cell = self.cells.get((site, col))
        state, lv = _state(f), _log10(f.get("value"))
        if cell is None:
            self.cells[(site, col)] = [state, lv, 1]
        else:
            cell[0] = max(cell[0], state)
            if lv is not None and (cell[1] is None or lv > cell[1]):
                cell[1] = lv
            cell[2] += 1
        return site, col

    def build(self) -> tuple[dict, dict, dict]:
        """The page's heatmap, with maps of site index and column to their (bucketed) row and
        column."""
        by_order = sorted(range(len(self.sites)), key=lambda i: (self.first[i], i))
        names = list(self.sites)
        sites = [names[i] for i in by_order]
        cols = sorted(self.cols)
        rank_of, row_labels = _buckets(sites, MAX_ROWS, lambda s: s)
        row_of = [0] * len(sites)  # by site index, as `add` numbered them
        for r, i in enumerate(by_order):
            row_of[i] = rank_of[r]
        col_pos, col_labels = _buckets(cols, MAX_COLS, _col_label)
        col_of = {c: col_pos[i] for i, c in enumerate(cols)}
        steps: list[list[int]] = [[] for _ in col_labels]
        mbs: list[list[int]] = [[] for _ in col_labels]
        for i, (step, mb) in enumerate(cols):
            steps[col_pos[i]].append(step)
            if mb >= 0:
                mbs[col_pos[i]].append(mb)
        cells: dict[tuple[int, int], list] = {}
        for (site, col), (state, lv, n) in self.cells.items():
            rc = (row_of[site], col_of[col])
            c = cells.get(rc)
            if c is None:
                cells[rc] = [state, lv, n]
            else:
                c[0] = max(c[0], state)
                if lv is not None and (c[1] is None or lv > c[1]):
                    c[1] = lv
                c[2] += n
        flat: list = []
        for (r, col_at), (state, lv, n) in sorted(cells.items()):
            flat += [r, col_at, state, lv, n]
        logs = [v for v in flat[3::5] if v is not None]
        doc = {"phase": self.phase, "rows": row_labels, "cols": col_labels, "cells": flat,
               "lo": min(logs) if logs else None, "hi": max(logs) if logs else None,
               "sites": len(sites), "columns": len(cols),
               "steps": len({c[0] for c in cols}), "microbatches": len({c[1] for c in cols
                                                                      if c[1] >= 0}),
               "col_steps": [format_ranges(x, "-").replace(", ", ",") for x in steps],
               "col_mbs": [format_ranges(x).replace(", ", ",") for x in mbs]}
        return doc, dict(enumerate(row_of)), col_of


def _col_label(col: tuple[int, int]) -> str:
    step, mb = col
    return f"s{step}" + (f" mb{mb}" if mb >= 0 else "")


def _buckets(items: list, limit: int, label) -> tuple[list[int], list[str]]:
    """Each item's bucket (contiguous, at most `limit` buckets) and the buckets' labels."""
    n = len(items)
    if n <= limit:
        return list(range(n)), [label(x) for x in items]
    of = [i * limit // n for i in range(n)]
    labels = []
    for b in range(limit):
        lo = -(-b * n // limit)
        hi = -(-(b + 1) * n // limit) - 1
        labels.append(f"{label(items[lo])} … {label(items[hi])} ({hi - lo + 1})")
    return of, labels


def measure(f: dict) -> tuple[str, float | str | None]:
    """The table's measure of a finding, the verdict's own (text, and a number to sort by):
    "×4.00" for a rescaling, "1 ulp" or "max_abs 7.45e-09" for a bitwise breach measured from
    bytes, "rel_l2 0.0123" for a metric against its threshold; "" when nothing was measured."""
    metrics = f.get("metrics") or {}
    scaled = metrics.get("scaled_by")
    if isinstance(scaled, (int, float)):
        return f"×{F._fixed(scaled)}", float(scaled)
    payload = metrics.get("payload") or {}
    value, metric = f.get("value"), f.get("metric")
    if metric == "exact" and value is None and payload.get("max_abs") is not None:
        text = f"max_abs {F.format_float(payload['max_abs'])}"
        if payload.get("ulp"):
            text += f", {F.format_float(payload['ulp'])} ulp"
        return text, _num(payload["max_abs"]) if isinstance(payload["max_abs"], float) else None
    if metric and value is not None:
        number = _num(value)
        if metric == "ulp":
            return f"{F.format_float(value)} ulp", number if isinstance(number, float) else None
        return f"{metric} {F.format_float(value)}", number if isinstance(number, float) else None
    return "", None


def _row(f: dict, cell: list | None) -> dict:
    """A finding as the table and the rank map need it."""
    k = f["key"]
    cause = f.get("cause")
    why = f"{cause['kind']}: {cause['reason']}" if cause else (f.get("detail") or "")
    text, number = measure(f)
    return {"o": f.get("order", 0), "step": k["step"], "mb": k["microbatch"],
            "phase": k["phase"], "site": k["site"], "role": k["role"], "index": k.get("index", 0),
            "call": k.get("call", 0), "verdict": f["verdict"], "breach": f["breach"],
            "stage": f.get("stage"), "metric": f.get("metric"), "value": _num(f.get("value")),
            "measure": text, "mnum": number,
            "threshold": _num(f.get("threshold")), "rule": f.get("rule"), "why": why,
            "group": f.get("group"),
            "ranks": f.get("ranks") or {"ref": [], "cand": []}, "pieces": f.get("pieces"),
            "notes": f.get("notes") or [], "cell": cell, "head": F.headline(f)}


def _group(g: dict) -> dict:
    """A group of breaching findings as the page's Causes section shows it."""
    cause = g.get("cause")
    return {"index": g["index"], "headline": g["headline"], "count": g["count"],
            "first": g["first_order"], "sites": g.get("sites_text", ""),
            "why": f"{cause['kind']}: {cause['reason']}" if cause else g.get("detail", ""),
            "factor": g.get("factor_name", ""), "notes": g.get("notes") or []}


def page_data(doc: dict, findings: Iterable[dict]) -> dict:
    """What the page's script reads: the head of the report, heatmaps and table rows."""
    maps: dict[str, _Heatmap] = {}
    where: list[tuple[dict, str, int, tuple[int, int]]] = []
    breaches: list[dict] = []
    others: list[dict] = []
    listed = 0
    for f in findings:
        ph = f["key"]["phase"]
        hm = maps.get(ph)
        if hm is None:
            hm = maps[ph] = _Heatmap(ph)
        site, col = hm.add(f)
        if f["verdict"] == "identical":
            continue
        listed += 1
        if "ranks" not in f:  # reduced by html_findings: counted, not listed
            continue
        bucket = breaches if f["breach"] else others
        if len(bucket) < MAX_TABLE_ROWS:
            bucket.append(f)
            where.append((f, ph, site, col))
    heatmaps, index, placed = [], {}, {}
    for n, (ph, hm) in enumerate(maps.items()):
        hdoc, row_of, col_of = hm.build()
        heatmaps.append(hdoc)
        index[ph] = n
        placed[ph] = (row_of, col_of)
    cells = {id(f): [index[ph], placed[ph][0][site], placed[ph][1][col]]
             for f, ph, site, col in where}
    kept = breaches + others[:max(0, MAX_TABLE_ROWS - len(breaches))]
    kept.sort(key=lambda f: f.get("order", 0))
    rows = [_row(f, cells[id(f)]) for f in kept]
    first = doc.get("first_divergence")
    first_doc = None
    if first is not None:
        k = first["key"]
        ph = k["phase"]
        cell = None
        if ph in maps and k["site"] in maps[ph].sites:
            row_of, col_of = placed[ph]
            col = (k["step"], k["microbatch"])
            cell = [index[ph], row_of[maps[ph].sites[k["site"]]], col_of.get(col, 0)]
        first_doc = _row(first, cell)
    runs = doc["runs"]
    breaks: dict[str, list[dict]] = {}
    for g in doc.get("graph_breaks") or []:
        st = g.get("stage")
        label = f"stage {st}" if st is not None and st >= 0 else "whole run"
        breaks.setdefault(f"{g.get('side', '')}: {label}", []).append(
            {"kind": g.get("kind"), "message": g.get("message", ""),
             "boundary": g.get("boundary") or "", "sites": g.get("sites")})
    pol = doc["policy"]
    return {
        "title": f"numaudit: {runs['ref']['name']} vs {runs['cand']['name']}",
        "headline": f"numaudit: {run_text(runs['ref'])} vs {run_text(runs['cand'])}",
        "policy": f"policy: {pol['name']} ({pol['source']}, sha256 {pol['sha256'][:12]})",
        "summary": summary_line(doc["summary"]) + (
            f"; {noise_line(doc['noise'])}" if doc.get("noise") else ""),
        "exit_code": doc["summary"]["exit_code"],
        "runs": {side: {"name": r["name"], "world_size": r["world_size"],
                        "mesh_shape": r.get("mesh_shape") or [],
                        "mesh_dim_names": r.get("mesh_dim_names") or []}
                 for side, r in runs.items()},
        "first": first_doc, "graph_breaks": [{"group": g, "items": items}
                                             for g, items in breaks.items()],
        "warnings": _noise_warning(doc) + (doc.get("warnings") or []), "heatmaps": heatmaps,
        "findings": rows,
        "groups": [_group(g) for g in doc.get("groups") or []],
        "findings_listed": listed, "findings_included": doc.get("findings_included", "all"),
        "verdicts": list(F.VERDICTS),
    }


def _noise_warning(doc: dict) -> list[str]:
    """The reference's own nondeterminism (noise bands, docs/noise.md) as the first warning."""
    text = ((doc.get("noise") or {}).get("nondeterminism") or {}).get("text")
    return [text[0].upper() + text[1:]] if text else []


def script_json(data: dict) -> str:
    """JSON safe inside a <script> element: no `</script>`, `<!--` or entity can end it."""
    text = json.dumps(data, allow_nan=False, separators=(",", ":"))
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def render_html(doc: dict, findings: Iterable[dict]) -> str:
    """The HTML report from the JSON form of a report (its head and its findings)."""
    data = page_data(doc, findings)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{html.escape(data['title'])}</title><style>{CSS}</style></head>\n"
            f"<body>{SVG_DEFS}<main id=\"app\"><noscript>This report needs JavaScript; "
            "`auditor compare --format text` prints the same findings.</noscript></main>\n"
            f"<script type=\"application/json\" id=\"numaudit-data\">{script_json(data)}"
            f"</script>\n<script>{JS}</script></body></html>\n")


def to_html(report: Report) -> str:
    """The HTML report of a comparison."""
    return render_html(report.header_dict(), html_findings(report))


def html_findings(report: Report) -> Iterator[dict]:
    """Findings for the HTML report: in full the ones its table may list, the others reduced to
    what a heatmap cell needs (key, verdict, breach, value)."""
    comp = report.comparison
    names = comp.catalog.site_names
    roles = dict(ROLE_NAMES)
    full = {"breach": 0, "other": 0}
    idx = comp.indices()
    A, B = comp.when[idx].tolist(), comp.where[idx].tolist()
    verdict, breach = comp.verdict[idx].tolist(), comp.breach[idx].tolist()
    value, order = comp.value[idx].tolist(), comp.rank_in_order[idx].tolist()
    for j, i in enumerate(idx.tolist()):
        v, br = verdict[j], bool(breach[j])
        if v != F.IDENTICAL:
            group = "breach" if br else "other"
            if full[group] < MAX_TABLE_ROWS:
                full[group] += 1
                yield report.finding(i).as_dict()
                continue
        a, b = A[j], B[j]
        sid = b >> 32
        yield {"key": {"step": a >> 24, "microbatch": ((a >> 4) & 0xFFFFF) - 1,
                       "phase": phase_name(a & 0xF), "site": names.get(sid, f"site#{sid}"),
                       "role": roles[(b >> 28) & 0xF]},
               "verdict": F.VERDICT_NAMES[v], "breach": br, "value": value[j],
               "order": order[j]}
