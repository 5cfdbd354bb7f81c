"""Op-level comparison: the first operation inside a module call whose output differs while its
inputs match (docs/drill-down.md).

Records of operations (sites ``<module>/<n>:<op>``, wire/ops.py) are kept out of the module-level
comparison and compared here: each module call's operations are aligned by order and name
(`auditor.compare.ops.align`: an operation one run adds or lacks is said, never paired with the
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

import itertools
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.merge import tiling as M
from numaudit.auditor.compare.ops.align import Alignment, align_ops, describe, unpaired_kind
from numaudit.auditor.compare.ops.causes import (
    BWD,
    FWD,
    OUT_ROLE,
    breaching,
    dtype_finding,
    keys_of,
    other_dtype,
    pair_finding,
    passes,
    unpaired_finding,
)
from numaudit.auditor.compare.ops.findings import OpFinding, OpReport
from numaudit.auditor.compare.read.columns import Catalog, RunColumns
from numaudit.auditor.compare.read.ranges import format_ranges
from numaudit.wire.ops import OP_SEP, is_view, op_site, parse_op_site


def split_ops(cols: RunColumns, catalog: Catalog) -> tuple[RunColumns, RunColumns]:
    """(records of modules, parameters and the rest; records of operations)."""
    if not len(cols):
        return cols, cols
    site = cols.where >> 32
    flags = np.zeros(int(site.max()) + 1, bool)
    for sid in np.unique(site).tolist():
        flags[sid] = OP_SEP in catalog.site_names.get(sid, "")
    mask = flags[site]
    if not mask.any():
        return cols, cols.take(mask)
    return cols.take(~mask), cols.take(mask)


def compare_ops(rc: RunColumns, cc: RunColumns, catalog: Catalog, policy, reader, *,
                bwd_factor: float = 1.0, mesh: dict | None = None, labels: dict | None = None,
                module_breaches: set | None = None) -> OpReport | None:
    """The op-level comparison of two runs' operation records; None when neither has any.
    `module_breaches`: (A, module site, call) of the module outputs that breach (an operation
    one run lacks is the finding when what follows differs)."""
    if not len(rc) and not len(cc):
        return None
    from numaudit.auditor.compare.measure.verdicts import evaluate

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
        combo = np.unique(np.stack([cols.when, cols.where >> 32, cols.where & 0x3FFF], axis=1),
                          axis=0)
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
    site, call = cols.where >> 32, cols.where & 0x3FFF
    new_site = np.full(len(cols), -1, np.int64)
    combo, inv = np.unique(np.stack([cols.when, site, call], axis=1), axis=0, return_inverse=True)
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
    out.where = (new_site[keep] << 32) | (out.where & 0xFFFFFFFF)
    out.sort()
    return out


def _key_index(comp) -> dict[tuple, list[tuple[int, int]]]:
    """(A, site id, role, call) -> [(index, key)] of the comparison's keys."""
    out: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    B = comp.where
    for i, (a, b) in enumerate(zip(comp.when.tolist(), B.tolist())):
        out[(a, b >> 32, (b >> 28) & 0xF, b & 0x3FFF)].append(((b >> 14) & 0x3FFF, i))
    return out


def _per_rank(comp) -> dict[int, tuple[bool, str]]:
    """Keys whose copies differ across ranks in both runs alike (a tensor-parallel module's
    shards or partial sums held as plain tensors, taken for replicas): compared rank by rank
    (the copies share one box, so their fingerprints compare): key -> (equal, why)."""
    out = {}
    rk, ck = comp.ref_keys, comp.cand_keys
    for i in np.flatnonzero(comp.verdict == F.REPLICA_DIVERGENCE).tolist():
        ri, ci = int(comp.ref_index[i]), int(comp.cand_index[i])
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
    # (place, "pair", (ref position, cand position)) or (place, "unpaired", (side, position))
    events: list[tuple[float, str, tuple[Any, int]]] = [
        (float(r), "pair", (r, c)) for r, c in pairs]
    events += [(p, "unpaired", (s, o)) for p, s, o in al.unpaired()]
    events.sort(key=lambda e: e[0], reverse=(phase == BWD))
    ids = {r: comp.catalog.site_id(op_site(module, r, al.names[("ref", r)])) for r, _ in pairs}

    def bad(r: int) -> bool:
        return breaching(comp, index, a, ids[r], OUT_ROLE[phase], call, per_rank)

    module_bad = phase == FWD and (a, module, call) in module_breaches
    # whether anything from each event on differs: a breaching operation, or the module's output
    later = [False] * (len(events) + 1)
    later[len(events)] = module_bad
    for n in range(len(events) - 1, -1, -1):
        kind, item = events[n][1], events[n][2]
        later[n] = later[n + 1] or (kind == "pair" and bad(item[0]))
    first_inherited: OpFinding | None = None
    first_cast: tuple[Any, int] | None = None
    for n, (_place, kind, item) in enumerate(events):
        if kind == "unpaired":
            if first_inherited is not None or not later[n + 1]:
                continue
            if unpaired_kind(al.names[item]) == "cast":
                # its effect shows as an operation computed in another dtype (below)
                first_cast = first_cast or item
                continue
            # the finding when what it feeds differs: the next operation both runs ran, or,
            # when none follows, the module's output
            nxt = next((e[2][0] for e in events[n + 1:] if e[1] == "pair"), None)
            if (nxt is not None and bad(nxt)) or (nxt is None and module_bad):
                # of the operations one run lacks here, a collective is the one to name
                run = [e[2] for e in itertools.takewhile(lambda e: e[1] == "unpaired",
                                                         events[n:])]
                side, o = next((x for x in run if unpaired_kind(al.names[x]) == "collective"),
                               item)
                return unpaired_finding(out, comp, al, side, o, nxt is not None, pairs,
                                         index, a, ids, phase, call)
            continue
        r, c = item
        if later[n] and not is_view(al.names[("ref", r)]):
            other = other_dtype(comp, al, r, index, a, ids[r], phase, call)
            if other:  # computed in another precision, and what follows differs
                return dtype_finding(out, comp, al, r, c, other, first_cast, index, a, ids[r],
                                      phase, call, per_rank)
        outs = keys_of(index, a, ids[r], OUT_ROLE[phase], call)
        bad_outs = [(k, i) for k, i in outs if not passes(comp, i, per_rank)]
        if bad_outs:
            got = pair_finding(replace(out), comp, al, r, c, bad_outs, index, a, ids[r],
                                phase, call, per_rank)
            if got.kind == "introduced":
                return got
            first_inherited = first_inherited or got
    if first_inherited is not None:  # nothing introduced inside: it came in from outside
        return first_inherited
    if first_cast is not None:
        return unpaired_finding(out, comp, al, first_cast[0], first_cast[1], False, pairs,
                                 index, a, ids, phase, call)
    if module_bad:
        out.kind = "unknown"
        out.reason = (f"every one of the {len(pairs)} operations both runs ran matches, yet the "
                      "module's output differs: what differs happens in no operation the "
                      "agents saw (a forward hook, or code outside torch's operations)")
    return out
