"""Why an operation's output differs: the causes of the op-level comparison (docs/drill-down.md).

`auditor.compare.ops.comparison` aligns and judges each module call's operations; the functions here
say, for the operation it stops at, whether it *introduced* the difference (its inputs match, a
float argument differs, it computes in another dtype, or its output differs far more than its
inputs) or *inherited* it (an input, or for a backward its forward, already differs), and, for an
operation one run lacks, what kind it is and what follows from it. The same vocabulary as the
module-level causes (`auditor.compare.explain.causes`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from numaudit.auditor.compare.explain.finding import finding
from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.ops.align import Alignment, op_text, unpaired_kind
from numaudit.wire.ops import SCALAR_INDEX, is_cast, is_view
from numaudit.wire.vocabulary import Phase, Role

if TYPE_CHECKING:
    from numaudit.auditor.compare.ops.findings import OpFinding

FWD, BWD = Phase.FWD, Phase.BWD
IN_ROLE: dict[int, int] = {FWD: Role.INPUT, BWD: Role.GRAD_OUTPUT}
"""What an operation reads: forward, its inputs; backward, the gradients reaching its outputs."""
OUT_ROLE: dict[int, int] = {FWD: Role.OUTPUT, BWD: Role.GRAD_INPUT}
PASSING = (F.IDENTICAL, F.CLOSE, F.IGNORED)


def passes(comp, i: int, per_rank: dict) -> bool:
    if i in per_rank:
        return per_rank[i][0]
    return int(comp.verdict[i]) in PASSING


def other_dtype(comp, al: Alignment, r: int, index: dict, a: int, sid: int, phase: int,
                 call: int) -> tuple[str, str] | None:
    """(ref dtype, cand dtype) where the operation's output or an input holds another float
    dtype in each run: it computes in another precision."""
    for role in (OUT_ROLE[phase], IN_ROLE[phase]):
        for k, x in keys_of(index, a, sid, role, call):
            if k >= SCALAR_INDEX:
                continue
            dr, dc = _dtype(comp, x, "ref"), _dtype(comp, x, "cand")
            if dr and dc and dr != dc:
                return dr, dc
    return None


def dtype_finding(out: OpFinding, comp, al: Alignment, r: int, c: int, dtypes: tuple,
                   cast, index: dict, a: int, sid: int, phase: int, call: int,
                   per_rank: dict) -> OpFinding:
    """An operation computed in another dtype than the reference's, with what follows it
    differing: introduced there (the casts before it only feed it)."""
    dr, dc = dtypes
    out.kind, out.breach = "introduced", True
    out.op = f"{al.names[('ref', r)]} (op {r}{'' if c == r else f'; op {c} in {comp.cand.name}'})"
    outs = keys_of(index, a, sid, OUT_ROLE[phase], call)
    if outs:
        f = finding(comp, outs[0][1])
        out.finding = f.as_dict()
        state = f"its output is {f.verdict} ({F.measure_text(out.finding) or f.verdict})"
    else:
        state = "it has no output compared"
    by = (f", its inputs cast by {op_text(al, cast[0], cast[1])}"
          f"{'' if cast[0] == 'ref' else f' of {comp.cand.name}'}") if cast else ""
    out.reason = (f"dtype: it computes in {dc} in {comp.cand.name} and in {dr} in "
                  f"{comp.ref.name}{by}; {state}, and what follows it in the call differs")
    return out


def keys_of(index: dict, a: int, sid: int | None, role: int, call: int) -> list[tuple[int, int]]:
    return sorted(index.get((a, sid, role, call), ())) if sid is not None else []


def breaching(comp, index, a, sid, role, call, per_rank) -> bool:
    return any(not passes(comp, i, per_rank) for _, i in keys_of(index, a, sid, role, call))


def _dtype(comp, i: int, side: str) -> str | None:
    k = int(comp.ref_index[i] if side == "ref" else comp.cand_index[i])
    lk = comp.ref_keys if side == "ref" else comp.cand_keys
    if k < 0 or lk.dtype[k] < 0:
        return None
    return comp.catalog.dtypes[int(lk.dtype[k])]


def _scalar(comp, i: int, side: str) -> float | None:
    """The value of a 0-dim key (a float argument), from its record's moments."""
    k = int(comp.ref_index[i] if side == "ref" else comp.cand_index[i])
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


def pair_finding(out: OpFinding, comp, al: Alignment, r: int, c: int, bad: list, index: dict,
                  a: int, sid: int, phase: int, call: int, per_rank: dict) -> OpFinding:
    """A paired operation whose outputs breach: introduced or inherited (`out` filled)."""
    name = al.names[("ref", r)]
    out.op = f"{name} (op {r}{'' if c == r else f'; op {c} in {comp.cand.name}'})"
    j, i = bad[0]
    f = finding(comp, i)
    out.finding, out.breach = f.as_dict(), True
    what = "output" if phase == FWD else "gradient for input"
    rel = "" if i not in per_rank else f"; {per_rank[i][1]}"
    head = f"its {what} {j} is {f.verdict} ({F.measure_text(f.as_dict()) or f.verdict}{rel})"
    if f.verdict in ("missing_in_ref", "missing_in_cand", "incomplete"):
        out.kind = "unknown"  # nothing to judge: the next operation may say more
        out.reason = (f"its {what} {j} could not be compared ({f.verdict}"
                      f"{': ' + f.detail if f.detail else ''})")
        return out
    inputs = keys_of(index, a, sid, IN_ROLE[phase], call)
    tensors = [(k, x) for k, x in inputs if k < SCALAR_INDEX]
    scalars = [(k, x) for k, x in inputs if k >= SCALAR_INDEX]
    bad_in = [(k, x) for k, x in tensors if not passes(comp, x, per_rank)]
    bad_scalar = [(k, x) for k, x in scalars if not passes(comp, x, per_rank)]
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
        n = len(tensors)
        match = ("match" if not bad_in else "differ far less" if amplified else "differ too")
        which = ("its tensor input "
                 f"{match.replace('match', 'matches').replace('differ', 'differs')}"
                 if n == 1 else f"its {n} tensor inputs {match}")
        out.reason = (f"{head}; {which} and its float argument {k - SCALAR_INDEX} "
                      f"differs{values}: this operation is called otherwise (a scale, an "
                      "epsilon, a probability)")
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
    for role in (Role.INPUT, Role.OUTPUT):
        for _, x in keys_of(index, fa, sid, role, call):
            if not passes(comp, x, per_rank):
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


def unpaired_finding(out: OpFinding, comp, al: Alignment, side: str, o: int, bad_after: bool,
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
        if c < o or is_view(al.names[("ref", r)]):  # the first operation that computes
            continue
        got = _dtypes_differ(comp, keys_of(index, a, ids[r], OUT_ROLE[phase], call))
        if got:
            return (f"from it on {op_text(al, 'ref', r)} computes in {got[1]} in "
                    f"{comp.cand.name} and in {got[0]} in {comp.ref.name}")
        got = _dtypes_differ(comp, keys_of(index, a, ids[r], IN_ROLE[phase], call))
        if got:
            return (f"{op_text(al, 'ref', r)} gets {got[1]} inputs in {comp.cand.name}, "
                    f"{got[0]} in {comp.ref.name}")
    return ""


def _dtypes_differ(comp, keys) -> tuple[str, str] | None:
    """(ref's dtype, cand's) of the first of ``keys`` both runs hold in different dtypes."""
    for _, i in keys:
        dr, dc = _dtype(comp, i, "ref"), _dtype(comp, i, "cand")
        if dr and dc and dr != dc:
            return dr, dc
    return None
