"""The human report: summary, first divergence, graph breaks, warnings, findings by phase."""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator

from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.measure.findings import format_float
from numaudit.auditor.compare.read.align import phase_name
from numaudit.auditor.compare.read.ranges import format_ranges
from numaudit.auditor.compare.result import Report
from numaudit.auditor.report.ops_text import print_drill
from numaudit.wire.vocabulary import Phase

TEXT_ROWS_PER_GROUP = 50
"""Breaching findings listed per (phase, stage) group in the text report unless --limit says."""


def _ranks_text(ranks: list[int]) -> str:
    return format_ranges(ranks, "-")


def run_text(info: dict) -> str:
    """A run as the headline names it: "4 ranks, stages 0-3, float32" (the HTML page too)."""
    stages = info.get("stages") or []
    labels = info.get("labels") or {}
    if labels.get("checkpoint"):  # read from files by `auditor checkpoint`: its readers are no
                                  # ranks
        return (f"{info['name']} ({labels.get('checkpoint_format', 'checkpoint')} "
                f"{labels['checkpoint']})")
    parts = [f"{info['world_size']} rank" + ("s" if info["world_size"] != 1 else "")]
    if len(stages) > 1:
        parts.append(f"stages {format_ranges(stages)}")
    if info.get("dtype"):
        parts.append(info["dtype"])
    return f"{info['name']} ({', '.join(parts)})"


def render_text(doc: dict, findings: Iterable[dict], *, width: int | None = None,
                show_all: bool = False, limit: int = TEXT_ROWS_PER_GROUP,
                color: bool = False, verbose: bool = False) -> str:
    """The human report from the JSON form: summary, first divergence, graph breaks, warnings,
    then the breaching findings grouped by cause (the report's ``groups``); ``verbose`` adds
    every breaching finding by phase and stage, ``show_all`` lists every finding instead of
    the groups. A report without groups (a daemon of an earlier build) lists the findings."""
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
    con.print(Text(f"numaudit: {run_text(runs['ref'])} vs {run_text(runs['cand'])}",
                   style="bold"))
    con.print(f"policy: {pol['name']} ({pol['source']}, sha256 {pol['sha256'][:12]})")
    con.print(Text(summary_line(summ), style="bold red" if summ["breaches"] else "bold green"))
    if doc.get("noise"):
        con.print(noise_line(doc["noise"]))

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
        where_ranks = F.pieces_text(first.get("pieces"))
        scalar = first.get("numel") == 1  # one element: no piece, no place to name
        if where_ranks and not scalar and \
                where_ranks not in (first.get("cause") or {}).get("reason", ""):
            para(where_ranks, 2)
        payload = first.get("metrics", {}).get("payload")
        if payload and payload.get("worst"):
            para(worst_text(payload, runs, scalar), 2)
        for note in first.get("notes", []):
            para(f"note: {note}", 2)
    print_drill(con, para, doc)  # the rerun to drill into it; op-level findings (ops_text)

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

    nondet = (doc.get("noise") or {}).get("nondeterminism")
    if nondet and nondet.get("text"):
        con.print()
        con.print(Text("Reference noise", style="bold"))
        para(nondet["text"][0].upper() + nondet["text"][1:], 2)

    groups = doc.get("groups")
    if groups is not None and not show_all:
        printed = {*(first or {}).get("notes", ())}
        _print_groups(con, para, doc, groups, width or 100, printed, verbose)
        if not verbose:
            return _rstrip_lines(buf.getvalue())
    _print_listing(con, para, findings, show_all=show_all, limit=limit, width=width,
                   summarized=bool(doc.get("graph_breaks")))
    return _rstrip_lines(buf.getvalue())


DEFAULT_ROLES = {"fwd": "output", "bwd": "grad_output"}
"""The role a phase's keys usually have (others: value); a group lists its roles otherwise."""
KEYS_LINES = 2
"""Lines of a group's compact key list in the text report (the JSON report has them all)."""


def _print_groups(con, para, doc: dict, groups: list[dict], width: int, printed: set[str],
                  verbose: bool) -> None:
    """Breaching findings by cause: each group's headline, cause, keys and shared notes."""
    from rich.text import Text

    from numaudit.auditor.compare.explain.groups import template
    from numaudit.auditor.compare.explain.site_sets import shorten

    con.print()
    if not groups:
        con.print(Text("Breaching findings: none", style="bold"))
        return
    total = sum(g["count"] for g in groups)
    hint = "" if verbose else "; --verbose lists every finding"
    con.print(Text(f"Breaching findings: {total} in {len(groups)} group"
                   f"{'s' if len(groups) != 1 else ''} by cause{hint}", style="bold"))
    first = doc.get("first_divergence") or {}
    seen = {template(n) for n in printed}
    for g in groups:
        roles = g.get("roles") or []
        role = "" if roles == [DEFAULT_ROLES.get(g["phase"], "value")] else \
            f" ({', '.join(roles)})"
        keys = shorten(g.get("sites_text", ""), KEYS_LINES * (width - 10) - len(role))
        leads = bool(first) and g["index"] == first.get("group") and \
            g["first_order"] == first.get("order")
        head = g["headline"] + (" (the first divergence is its first)" if leads else "")
        if g["verdict"] == "grad_none" and doc.get("graph_breaks"):
            head += ", summarized under backward-graph breaks"
        inline = f"{head} — {keys}{role}"
        para(inline if len(inline) <= width - 2 else head, 2, "red")
        cause = g.get("cause")
        if leads:
            pass  # its cause and notes are the first divergence's, printed above
        elif cause:
            para(f"{cause['kind']}: {_short_reason(cause['reason'])}", 4)
        elif not g.get("causes_examined", True):
            para("cause not worked out (past the first breaches; --verbose lists them)", 4)
        if len(inline) > width - 2:
            para(f"keys: {keys}{role}", 4)
        factor = g.get("factor_name")
        if factor and not any(factor in n for n in printed):
            printed.add(factor)
            para(f"factor: {factor}", 4)
        inherited = (cause or {}).get("kind") == "inherited"  # its notes are no cause's: JSON
        for note in [] if inherited else g.get("notes") or []:
            t = template(note)
            if note in printed or t in seen:
                continue
            printed.add(note)
            seen.add(t)
            para(f"note: {note}", 4)


def _short_reason(reason: str) -> str:
    """A cause's reason as a group says it: "already differs (diverged)" is "already
    differs" (the group's verdict is in its headline), "the previous capture in execution
    order" is "the capture before it"."""
    return reason.replace(" already differs (diverged)", " already differs").replace(
        "the previous capture in execution order (", "the capture before it (")


def _print_listing(con, para, findings: Iterable[dict], *, show_all: bool, limit: int,
                   width: int | None, summarized: bool) -> None:
    """Every breaching finding (every finding with ``show_all``) by phase and stage."""
    from rich.text import Text

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
        return
    con.print(Text(f"{title}, by phase and stage", style="bold"))
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
        lines = [("  ".join(p.ljust(w) for p, w in zip(t[0][:3], widths)) + "  " + t[0][3],
                  t[1]) for t in texts]
        for f, (line, extra) in zip(shown, lines):
            style = "red" if f["breach"] else ("green" if f["verdict"] == "identical" else "")
            para(line, 4, style)
            if extra and extra != common:
                para(extra, 8)
        if len(rows) > len(shown):
            con.print(f"    ... and {len(rows) - len(shown)} more (--limit 0 lists all; "
                      "--format json has every finding)")


def worst_text(payload: dict, runs: dict, scalar: bool = False) -> str:
    """The largest elementwise difference from payloads: "largest difference at [3, 1]: 0.25
    vs 0.5 (max_abs 0.25, 8.39e+06 ulp)"; a scalar's "values: ref 0.113 vs cand 0.453"."""
    w = payload["worst"]
    measures = [f"max_abs {format_float(payload['max_abs'])}"]
    if payload.get("ulp") is not None:
        measures.append(f"{format_float(payload['ulp'])} ulp")
    if scalar:
        return (f"values: {runs['ref']['name']} {w['ref']} vs {runs['cand']['name']} "
                f"{w['cand']} ({', '.join(measures)})")
    return f"largest difference at {w['index']}: {w['ref']} vs {w['cand']} ({', '.join(measures)})"


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
    where_ranks = F.pieces_text(f.get("pieces"), short=True)
    if where_ranks and where_ranks not in extra:
        extra = where_ranks + ("; " + extra if extra else "")
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
        text += (f"; {summ['uncertain']} uncertain (within noise of their threshold, or "
                 "nothing to measure them by)")
    return text


def noise_line(noise: dict) -> str:
    """The line under the summary when the candidate was judged against noise bands: "noise
    bands: 3 runs of ref (3 pairs, within 4x): 79 keys noisy, 33 bitwise; 70 within their band
    (23 of them beyond the preset alone), 1 beyond the reference's noise, ..."."""
    c, k = noise.get("counts", {}), noise.get("keys", {})
    runs = noise.get("runs", [])
    where = noise.get("source") if noise.get("source") not in (None, "runs") else \
        ", ".join(runs)
    parts = [f"{c.get('within_band', 0)} within their band"
             + (f" ({c['excused']} of them beyond the preset alone)" if c.get("excused") else "")]
    for name, text in (("preset_breach", "within their band but breaching the preset"),
                       ("beyond_noise", "beyond the reference's run-to-run noise"),
                       ("beyond_floor", "beyond the rounding floor where its runs are bitwise "
                                        "equal"),
                       ("not_applied", "judged by the preset alone (no band piece by piece)"),
                       ("unbanded", "without a band")):
        if c.get(name):
            parts.append(f"{c[name]} {text}")
    return (f"noise bands of {len(runs)} reference runs ({where}; {noise.get('pairs', 0)} pairs, "
            f"within {noise.get('slack', 0):g}x): {k.get('noisy', 0)} keys noisy, "
            f"{k.get('bitwise', 0)} bitwise equal; " + ", ".join(parts))


def to_text(report: Report, *, width: int | None = None, show_all: bool = False,
            limit: int = TEXT_ROWS_PER_GROUP, color: bool = False, verbose: bool = False) -> str:
    """The text report of a comparison (findings are read only for --verbose or --all)."""
    return render_text(report.header_dict(), text_findings(report, show_all, limit), width=width,
                       show_all=show_all, limit=limit, color=color, verbose=verbose)


def text_findings(report: Report, show_all: bool, limit: int) -> Iterator[dict]:
    """Findings for the text report: the rows it lists in full, the others reduced to what
    it counts (a million breaches must not build a million Findings to print fifty)."""
    comp = report.comparison
    rk, ck = comp.ref_keys, comp.cand_keys
    collapse = bool(report.graph_breaks)
    grad, grad_none = Phase.GRAD, F.GRAD_NONE
    listed: dict[tuple, int] = {}
    for i in comp.indices(breaches_only=not show_all).tolist():
        ri, ci = int(comp.ref_index[i]), int(comp.cand_index[i])
        stage = int(ck.stage[ci]) if ci >= 0 else None
        ref_stage = int(rk.stage[ri]) if ri >= 0 else None
        ph, v = int(comp.when[i] & 0xF), int(comp.verdict[i])
        group = (ph, stage if stage is not None else (ref_stage or -1))
        listable = not (collapse and ph == grad and v == grad_none)
        n = listed.get(group, 0)
        if listable:
            listed[group] = n + 1
        if listable and (limit <= 0 or n < limit):
            yield report.finding(i).as_dict()
        else:
            yield {"key": {"phase": phase_name(ph)}, "stage": stage, "ref_stage": ref_stage,
                   "verdict": F.VERDICT_NAMES[v], "breach": bool(comp.breach[i]),
                   "order": int(comp.rank_in_order[i])}


def report_summary_line(report: Report) -> str:
    """The one-line summary of a comparison."""
    return summary_line(report.header_dict()["summary"])
