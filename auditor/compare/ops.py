"""Op-level comparison: the first operation inside a module call whose output differs while its
inputs match (docs/drill-down.md).

Records of operations (sites ``<module>/<n>:<op>``, wire/ops.py) are kept out of the module-level
comparison and compared here: each module call's operations are aligned by order and name
(`auditor.compare.op_align`: an operation one run adds or lacks is said, never paired with the
wrong partner), the candidate's records are re-keyed onto the reference's operations they pair
with, and the pairs are judged by the same engine, policy and conventions as module keys
(`verdicts.evaluate`). Then, per call, in execution order (forward: the operations' order;
backward: the reverse), the first operation whose outputs breach while every input passes
*introduced* the difference — an exact factor, a dtype, a float argument (a softmax scale) that
differs is named; one whose input already differs *inherited* it (from the module's input or
a parameter); an operation one run lacks that the rest of the call depends on (an all-reduce
left out) is the finding itself. Values that ranks of a tensor-parallel module hold each their
own (shards, partial sums) are compared rank by rank when both runs hold them so.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace

import numpy as np

from auditor.compare import findings as F
from auditor.compare import merge as M
from auditor.compare.align import PHASE_IDS, ROLE_IDS
from auditor.compare.columns import Catalog, RunColumns
from auditor.compare.op_align import Alignment, align_ops, describe, op_text, unpaired_kind
from auditor.compare.ranges import format_ranges
from wire.ops import OP_SEP, SCALAR_INDEX, is_cast, op_site, parse_op_site

FWD, BWD = PHASE_IDS["fwd"], PHASE_IDS["bwd"]
IN_ROLE = {FWD: ROLE_IDS["input"], BWD: ROLE_IDS["grad_output"]}
OUT_ROLE = {FWD: ROLE_IDS["output"], BWD: ROLE_IDS["grad_input"]}
PASSING = (F.IDENTICAL, F.CLOSE, F.IGNORED)
MAX_LISTED = 1000
"""Calls whose op-level findings the JSON report lists (the text report summarizes them all)."""


def split_ops(cols: RunColumns, catalog: Catalog) -> tuple[RunColumns, RunColumns]:
    """(records of modules, parameters and the rest; records of operations)."""
    if not len(cols):
        return cols, cols
    site = cols.B >> 32
    flags = np.zeros(int(site.max()) + 1, bool)
    for sid in np.unique(site).tolist():
        flags[sid] = OP_SEP in catalog.site_names.get(sid, "")
    mask = flags[site]
    if not mask.any():
        return cols, cols.take(mask)
    return cols.take(~mask), cols.take(mask)


@dataclass
class OpFinding:
    """What the op-level comparison says of one module call."""

    step: int
    microbatch: int
    phase: str
    module: str
    call: int
    kind: str
    """"introduced", "inherited", "absent" (an operation the candidate lacks), "added" (one it
    runs and the reference does not), "unknown", or "identical" (every operation matches)."""
    op: str = ""
    """The operation named, as ``aten.mm (op 3)`` (the reference's numbering)."""
    reason: str = ""
    breach: bool = False
    finding: dict | None = None
    """The first differing output's finding (as the report's findings), when one differs."""
    structure: list[str] = field(default_factory=list)
    """How the runs' operation sequences differ (op_align.describe)."""
    compared: int = 0
    """Operations both runs ran, compared."""

    def as_dict(self) -> dict:
        return {"step": self.step, "microbatch": self.microbatch, "phase": self.phase,
                "module": self.module, "call": self.call, "kind": self.kind, "op": self.op,
                "reason": self.reason, "breach": self.breach, "finding": self.finding,
                "structure": self.structure, "compared": self.compared}

    def where(self) -> str:
        mb = f", microbatch {self.microbatch}" if self.microbatch >= 0 else ""
        call = f", call {self.call}" if self.call else ""
        return f"{self.phase} {self.module} @ step {self.step}{mb}{call}"


@dataclass
class OpReport:
    """The op-level comparison of two runs."""

    calls: list[OpFinding]
    """Every compared module call, in execution order."""
    warnings: list[str] = field(default_factory=list)

    @property
    def breaches(self) -> int:
        return sum(f.breach for f in self.calls)

    def differing(self) -> list[OpFinding]:
        return [f for f in self.calls if f.kind != "identical"]

    def as_dict(self) -> dict:
        diff = self.differing()
        return {"calls": len(self.calls), "breaches": self.breaches,
                "modules": sorted({f.module for f in self.calls}),
                "findings": [f.as_dict() for f in diff[:MAX_LISTED]],
                "findings_omitted": max(0, len(diff) - MAX_LISTED),
                "warnings": self.warnings}


def compare_ops(rc: RunColumns, cc: RunColumns, catalog: Catalog, policy, reader, *,
                bwd_factor: float = 1.0, mesh: dict | None = None, labels: dict | None = None,
                module_breaches: set | None = None) -> OpReport | None:
    """The op-level comparison of two runs' operation records; None when neither has any.
    `module_breaches`: (A, module site, call) of the module outputs that breach (an operation
    one run lacks is the finding when what follows differs)."""
    if not len(rc) and not len(cc):
        return None
    from auditor.compare.verdicts import evaluate

    tables = {side: _table(cols, catalog) for side, cols in (("ref", rc), ("cand", cc))}
    groups = sorted(set(tables["ref"].groups) | set(tables["cand"].groups))
    aligned: dict[tuple, Alignment] = {}
    for g in groups:
        ref_ops = tables["ref"].groups.get(g, [])
        cand_ops = tables["cand"].groups.get(g, [])
        twin = (g[0] - BWD + FWD, *g[1:]) if g[0] & 0xF == BWD else None
        al = aligned.get(twin) if twin is not None else None
        if al is None or not _covers(al, ref_ops, cand_ops):
            al = align_ops(ref_ops, cand_ops)
        aligned[g] = al
    rc2 = _rekey(rc, tables["ref"], aligned, catalog, "ref")
    cc2 = _rekey(cc, tables["cand"], aligned, catalog, "cand")
    comp = evaluate(rc2, cc2, catalog, policy, reader, bwd_factor=bwd_factor)
    comp.mesh, comp.labels = mesh or {}, labels or {}
    index = _key_index(comp)
    per_rank = _per_rank(comp)
    out = []
    for g in groups:
        out.append(_call_finding(comp, g, aligned[g], tables, index, per_rank,
                                 module_breaches or set()))
    out.sort(key=lambda f: (f.step, f.phase != "fwd", f.microbatch, f.module, f.call))
    report = OpReport(out)
    only = [g for g in groups if g not in tables["ref"].groups or g not in tables["cand"].groups]
    for side, name in (("ref", comp.ref.name), ("cand", comp.cand.name)):
        n = sum(1 for g in only if g not in tables[side].groups)
        if n:
            report.warnings.append(f"{n} module calls have operation captures in "
                                   f"{comp.cand.name if side == 'ref' else comp.ref.name} only "
                                   f"(not in {name}): capture the same modules and steps in "
                                   "both runs (NUMAUDIT_OPS, NUMAUDIT_STEPS, or one plan file)")
    return report


@dataclass
class _Table:
    groups: dict[tuple, list[tuple[int, str]]]
    """(A, module, call) -> [(ordinal, name)] sorted by ordinal."""
    site_of: dict[tuple, int]
    """(A, module, call, ordinal) -> the run's site id of that operation."""
    parsed: dict[int, tuple[str, int, str]]


def _table(cols: RunColumns, catalog: Catalog) -> _Table:
    groups: dict[tuple, dict[int, str]] = defaultdict(dict)
    site_of: dict[tuple, int] = {}
    parsed: dict[int, tuple[str, int, str]] = {}
    if len(cols):
        combo = np.unique(np.stack([cols.A, cols.B >> 32, cols.B & 0x3FFF], axis=1), axis=0)
        for a, sid, call in combo.tolist():
            p = parsed.get(sid)
            if p is None:
                p = parsed[sid] = parse_op_site(catalog.site_names.get(sid, "")) or ("", -1, "")
            module, ordinal, name = p
            if ordinal < 0:
                continue
            groups[(a, module, call)][ordinal] = name
            site_of[(a, module, call, ordinal)] = sid
    return _Table({g: sorted(ops.items()) for g, ops in groups.items()}, site_of, parsed)


def _covers(al: Alignment, ref_ops: list, cand_ops: list) -> bool:
    """Whether a forward alignment names every operation of its backward twin."""
    return ({("ref", o) for o, _ in ref_ops} | {("cand", o) for o, _ in cand_ops}) <= \
        set(al.names)


def _rekey(cols: RunColumns, table: _Table, aligned: dict, catalog: Catalog,
           side: str) -> RunColumns:
    """The run's operation records under the reference's sites of the operations they pair
    with; records of unpaired operations are left out (said by the alignment instead)."""
    if not len(cols):
        return cols
    site, call = cols.B >> 32, cols.B & 0x3FFF
    new_site = np.full(len(cols), -1, np.int64)
    combo, inv = np.unique(np.stack([cols.A, site, call], axis=1), axis=0, return_inverse=True)
    targets = np.full(len(combo), -1, np.int64)
    for k, (a, sid, c) in enumerate(combo.tolist()):
        module, ordinal, name = table.parsed.get(sid, ("", -1, ""))
        al = aligned.get((a, module, c))
        if al is None or ordinal < 0:
            continue
        if side == "ref":
            ref_ord = ordinal if ("ref", ordinal) not in al.place else None
        else:
            ref_ord = al.cand_of().get(ordinal)
        if ref_ord is None:
            continue
        target = catalog.site_id(op_site(module, ref_ord, al.names[("ref", ref_ord)]))
        if target is not None:
            targets[k] = target
    new_site = targets[inv.reshape(-1)]
    keep = new_site >= 0
    out = cols.take(keep)
    out.B = (new_site[keep] << 32) | (out.B & 0xFFFFFFFF)
    out.sort()
    return out


def _key_index(comp) -> dict[tuple, list[tuple[int, int]]]:
    """(A, site id, role, call) -> [(index, key)] of the comparison's keys."""
    out: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    B = comp.B
    for i, (a, b) in enumerate(zip(comp.A.tolist(), B.tolist())):
        out[(a, b >> 32, (b >> 28) & 0xF, b & 0x3FFF)].append(((b >> 14) & 0x3FFF, i))
    return out


def _per_rank(comp) -> dict[int, tuple[bool, str]]:
    """Keys whose copies differ across ranks in both runs alike (a tensor-parallel module's
    shards or partial sums held as plain tensors, taken for replicas): compared rank by rank
    (the copies share one box, so their fingerprints compare): key -> (equal, why)."""
    out = {}
    rk, ck = comp.ref_keys, comp.cand_keys
    for i in np.flatnonzero(comp.verdict == F.REPLICA_DIVERGENCE).tolist():
        ri, ci = int(comp.ri[i]), int(comp.ci[i])
        if ri < 0 or ci < 0 or rk.status[ri] != M.REPLICA_DIVERGENCE \
                or ck.status[ci] != M.REPLICA_DIVERGENCE or rk.count[ri] != ck.count[ci]:
            continue
        s, t, n = int(rk.first[ri]), int(ck.first[ci]), int(rk.count[ri])
        fr, fc = comp.ref.fp[s:s + n], comp.cand.fp[t:t + n]
        ranks = comp.cand.rank[t:t + n]
        bad = [int(r) for r, a, b in zip(ranks, fr, fc) if a != b]
        if bad:
            out[i] = (False, f"its ranks hold values of their own in both runs (shards or "
                             f"partial sums), and ranks {format_ranges(bad)} of "
                             f"{comp.cand.name} differ from {comp.ref.name}'s")
        else:
            out[i] = (True, "its ranks hold values of their own in both runs (shards or partial "
                            "sums), bitwise equal rank by rank")
    return out


def _passes(comp, i: int, per_rank: dict) -> bool:
    if i in per_rank:
        return per_rank[i][0]
    return int(comp.verdict[i]) in PASSING


def _call_finding(comp, g: tuple, al: Alignment, tables: dict, index: dict, per_rank: dict,
                  module_breaches: set) -> OpFinding:
    a, module, call = g
    step, mb, phase = a >> 24, ((a >> 4) & 0xFFFFF) - 1, a & 0xF
    out = OpFinding(step, mb, "bwd" if phase == BWD else "fwd", module, call, "identical",
                    structure=describe(al, comp.ref.name, comp.cand.name))
    present = [(s, g in tables[s].groups) for s in ("ref", "cand")]
    if not all(p for _, p in present):
        missing = next(s for s, p in present if not p)
        out.kind = "unknown"
        out.reason = (f"no operation of this call was captured in "
                      f"{comp.ref.name if missing == 'ref' else comp.cand.name}")
        return out
    pairs = al.pairs
    out.compared = len(pairs)
    # events in execution order (the reference's numbering; backward runs it in reverse)
    events = [(float(r), "pair", (r, c)) for r, c in pairs]
    events += [(p, "unpaired", (s, o)) for p, s, o in al.unpaired()]
    events.sort(key=lambda e: e[0], reverse=(phase == BWD))
    ids = {r: comp.catalog.site_id(op_site(module, r, al.names[("ref", r)])) for r, _ in pairs}

    def bad(r: int) -> bool:
        return _breaching(comp, index, a, ids[r], OUT_ROLE[phase], call, per_rank)

    module_bad = phase == FWD and (a, module, call) in module_breaches
    first_inherited: OpFinding | None = None
    for n, (place, kind, item) in enumerate(events):
        if kind == "unpaired" and first_inherited is None:
            # the finding when what it feeds differs: the next operation both runs ran, or,
            # when none follows, the module's output
            nxt = next((e[2][0] for e in events[n + 1:] if e[1] == "pair"), None)
            if (nxt is not None and bad(nxt)) or (nxt is None and module_bad):
                return _unpaired_finding(out, comp, al, item[0], item[1], nxt is not None,
                                         pairs, index, a, ids, phase, call)
            continue
        if kind == "unpaired":
            continue
        r, c = item
        outs = _keys(index, a, ids[r], OUT_ROLE[phase], call)
        breaching = [(k, i) for k, i in outs if not _passes(comp, i, per_rank)]
        if breaching:
            got = _pair_finding(replace(out), comp, al, r, c, breaching, index, a, ids[r],
                                phase, call, per_rank)
            if got.kind == "introduced":
                return got
            first_inherited = first_inherited or got
    if first_inherited is not None:  # nothing introduced inside: it came in from outside
        return first_inherited
    if module_bad:
        out.kind = "unknown"
        out.reason = (f"every one of the {len(pairs)} operations both runs ran matches, yet the "
                      "module's output differs: what differs happens in no operation the "
                      "agents saw (a forward hook, or code outside torch's operations)")
    return out


def _keys(index: dict, a: int, sid: int | None, role: int, call: int) -> list[tuple[int, int]]:
    return sorted(index.get((a, sid, role, call), ())) if sid is not None else []


def _breaching(comp, index, a, sid, role, call, per_rank) -> bool:
    return any(not _passes(comp, i, per_rank) for _, i in _keys(index, a, sid, role, call))


def _dtype(comp, i: int, side: str) -> str | None:
    k = int(comp.ri[i] if side == "ref" else comp.ci[i])
    lk = comp.ref_keys if side == "ref" else comp.cand_keys
    if k < 0 or lk.dtype[k] < 0:
        return None
    return comp.catalog.dtypes[int(lk.dtype[k])]


def _scalar(comp, i: int, side: str) -> float | None:
    """The value of a 0-dim key (a float argument), from its record's moments."""
    k = int(comp.ri[i] if side == "ref" else comp.ci[i])
    lk, cols = (comp.ref_keys, comp.ref) if side == "ref" else (comp.cand_keys, comp.cand)
    if k < 0:
        return None
    rid = cols.rid[int(lk.first[k]):int(lk.first[k]) + 1]
    try:
        got = comp.catalog.fetch_digests(rid)
        return float(got["sum"][0])
    except Exception:  # digests unavailable: say the argument differs, without values
        return None


AMPLIFICATION = 100.0
"""An operation whose output differs this many times more (relative L2) than any of its inputs
introduced that difference itself, whatever its inputs carry (weights already apart after a
few steps of training, a rounding difference upstream)."""


def _pair_finding(out: OpFinding, comp, al: Alignment, r: int, c: int, bad: list, index: dict,
                  a: int, sid: int, phase: int, call: int, per_rank: dict) -> OpFinding:
    """A paired operation whose outputs breach: introduced or inherited (`out` filled)."""
    name = al.names[("ref", r)]
    out.op = f"{name} (op {r}{'' if c == r else f'; op {c} in {comp.cand.name}'})"
    j, i = bad[0]
    f = comp.finding(i)
    out.finding, out.breach = f.as_dict(), True
    what = "output" if phase == FWD else "gradient for input"
    rel = "" if i not in per_rank else f"; {per_rank[i][1]}"
    head = f"its {what} {j} is {f.verdict} ({F.measure_text(f.as_dict()) or f.verdict}{rel})"
    inputs = _keys(index, a, sid, IN_ROLE[phase], call)
    tensors = [(k, x) for k, x in inputs if k < SCALAR_INDEX]
    scalars = [(k, x) for k, x in inputs if k >= SCALAR_INDEX]
    bad_in = [(k, x) for k, x in tensors if not _passes(comp, x, per_rank)]
    bad_scalar = [(k, x) for k, x in scalars if not _passes(comp, x, per_rank)]
    notes = _dtype_note(comp, i, tensors)
    factor = comp.scaled_by[i] if comp.scaled_by is not None else math.nan
    if math.isfinite(factor) and not bad_in and "scaled by" not in head:
        notes.append(f"{comp.cand.name}'s = {comp.ref.name}'s x{F.format_float(float(factor))}")
    inp = "input" if phase == FWD else "gradient reaching output"
    forward = _forward_differs(comp, index, a, sid, call, per_rank) if phase == BWD else None
    amplified = _amplified(comp, i, bad_in)
    if bad_scalar:
        k, x = bad_scalar[0]
        vr, vc = _scalar(comp, x, "ref"), _scalar(comp, x, "cand")
        values = (f" ({F.format_float(vr)} in {comp.ref.name}, {F.format_float(vc)} in "
                  f"{comp.cand.name})" if vr is not None and vc is not None else "")
        out.kind = "introduced"
        match = "match" if not bad_in else "differ far less" if amplified else "differ too"
        out.reason = (f"{head}; its tensor inputs ({len(tensors)}) {match} and its float "
                      f"argument {k - SCALAR_INDEX} differs{values}: this operation is called "
                      "otherwise (a scale, an epsilon, a probability)")
    elif forward is not None and not (bad_in and not amplified):
        out.kind = "inherited"
        out.reason = (f"{head}; its forward already differs ({forward}), and its backward "
                      "computes from what the forward saved")
    elif bad_in and amplified:
        out.kind = "introduced"
        out.reason = (f"{head}, far beyond what its inputs carry ({amplified}): this operation "
                      "computes otherwise")
    elif bad_in:
        k, x = bad_in[0]
        out.kind = "inherited"
        where = ("the difference comes into the module call from outside its operations (its "
                 "input, a parameter, or a tensor made elsewhere)" if phase == FWD else
                 "the gradient comes into the module call already different (from what runs "
                 "after the module, or a forward that differs)")
        out.reason = (f"{head}; its {inp} {k} already differs ({comp.key(x)} "
                      f"{F.VERDICT_NAMES[int(comp.verdict[x])]}): {where}")
    else:
        out.kind = "introduced"
        states = {F.VERDICT_NAMES[int(comp.verdict[x])] for _, x in tensors} or {"none"}
        n = len(tensors)
        which = f"its {inp}" if n == 1 else f"all {n} of its {inp}s"
        why = (f"{which} {'is' if n == 1 else 'are'} identical" if states == {"identical"}
               else f"{which} match{'es' if n == 1 else ''} (within tolerance: "
                    f"{', '.join(sorted(states))})" if tensors else "it has no tensor input")
        out.reason = f"{head}, while {why}: this operation computes otherwise"
    if notes:
        out.reason += "; " + "; ".join(notes)
    return out


def _amplified(comp, i: int, bad_in: list) -> str:
    """Where output key i differs AMPLIFICATION times more than every breaching input: the
    relative L2 distances, as text ("" when not, or not measured)."""
    out_rel = float(comp.rel_l2[i])
    ins = [float(comp.rel_l2[x]) for _, x in bad_in]
    if not bad_in or not math.isfinite(out_rel) or not all(math.isfinite(v) for v in ins):
        return ""
    worst = max(ins)
    if out_rel <= AMPLIFICATION * max(worst, 1e-12):
        return ""
    return (f"rel_l2 {F.format_float(out_rel)} against at most {F.format_float(worst)} "
            "in its inputs")


def _forward_differs(comp, index: dict, a: int, sid: int, call: int,
                     per_rank: dict) -> str | None:
    """For an operation's backward: its forward's first input or output that breaches (what
    the backward saved from it), as text; None when the forward matched."""
    fa = a - BWD + FWD
    for role in (ROLE_IDS["input"], ROLE_IDS["output"]):
        for _, x in _keys(index, fa, sid, role, call):
            if not _passes(comp, x, per_rank):
                return f"{comp.key(x)} {F.VERDICT_NAMES[int(comp.verdict[x])]}"
    return None


def _dtype_note(comp, i: int, tensors: list) -> list[str]:
    """Where the operation's output or inputs hold another dtype in each run."""
    dr, dc = _dtype(comp, i, "ref"), _dtype(comp, i, "cand")
    ins = {(_dtype(comp, x, "ref"), _dtype(comp, x, "cand")) for _, x in tensors}
    ins = {p for p in ins if p[0] != p[1]}
    if dr != dc and dr and dc:
        return [f"dtype: computed in {dc} in {comp.cand.name}, {dr} in {comp.ref.name}"]
    if ins:
        pr, pc = sorted(ins)[0]
        return [f"dtype: its inputs are {pc} in {comp.cand.name}, {pr} in {comp.ref.name}"]
    return []


def _unpaired_finding(out: OpFinding, comp, al: Alignment, side: str, o: int, bad_after: bool,
                      pairs: list, index: dict, a: int, ids: dict, phase: int,
                      call: int) -> OpFinding:
    """An operation one run lacks, with what follows it differing."""
    name = al.names[(side, o)]
    kind = unpaired_kind(name)
    out.breach = True
    follows = ("the operation after it differs" if bad_after else
               "the module's output differs")
    before = [r for r, _ in pairs if r < al.place[(side, o)]]
    matched = (f"the {len(before)} operations before it match" if before else
               "it is the call's first operation")
    if side == "ref":
        out.kind = "absent"
        out.op = f"{name} (op {o} in {comp.ref.name})"
        out.reason = (f"{comp.ref.name} runs the {kind} {name} (op {o}) and {comp.cand.name} "
                      f"does not: {matched}, and {follows}")
        if kind == "collective":
            out.reason += (f": the {kind} {comp.cand.name} leaves out (an all-reduce of a "
                           "tensor-parallel block's partial sums, an all-gather of its shards)")
    else:
        out.kind = "added"
        out.op = f"{name} (op {o} in {comp.cand.name})"
        out.reason = (f"{comp.cand.name} runs the {kind} {name} (op {o}) and {comp.ref.name} "
                      f"does not: {matched}, and {follows}")
        if is_cast(name):
            first = _first_other_dtype(comp, al, o, pairs, index, a, ids, phase, call)
            if first:
                out.reason += f"; {first}"
    return out


def _first_other_dtype(comp, al: Alignment, o: int, pairs: list, index: dict, a: int,
                       ids: dict, phase: int, call: int) -> str:
    """After a cast only the candidate runs: the first paired operation computed in another
    dtype than the reference's ("aten.mm (op 3) runs in bfloat16 in cand, float32 in ref")."""
    for r, c in pairs:
        if c < o:
            continue
        outs = _keys(index, a, ids[r], OUT_ROLE[phase], call)
        for _, i in outs:
            dr, dc = _dtype(comp, i, "ref"), _dtype(comp, i, "cand")
            if dr and dc and dr != dc:
                return (f"from it on {op_text(al, 'ref', r)} computes in {dc} in "
                        f"{comp.cand.name} and in {dr} in {comp.ref.name}")
        ins = _keys(index, a, ids[r], IN_ROLE[phase], call)
        for _, i in ins:
            dr, dc = _dtype(comp, i, "ref"), _dtype(comp, i, "cand")
            if dr and dc and dr != dc:
                return (f"{op_text(al, 'ref', r)} gets {dc} inputs in {comp.cand.name}, {dr} "
                        f"in {comp.ref.name}")
    return ""
