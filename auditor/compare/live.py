"""The live comparison behind `auditor watch`: report keys as they become final."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from numaudit.auditor.compare.digests.metrics import PayloadUnavailable
from numaudit.auditor.compare.explain.finding import finding
from numaudit.auditor.compare.explain.localize import localize
from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.measure.order import APPROXIMATED
from numaudit.auditor.compare.measure.verdicts import evaluate
from numaudit.auditor.compare.merge import tiling as M
from numaudit.auditor.compare.merge.keys import LogicalKeys
from numaudit.auditor.compare.merge.ranks import mesh_of
from numaudit.auditor.compare.merge.regroup import rescale_declared
from numaudit.auditor.compare.merge.replicas import regroup_with_replicas
from numaudit.auditor.compare.merge.uneven import place_uneven
from numaudit.auditor.compare.noise.judge import NoiseSpec, apply_bands, noise_pieces, resolve_bands
from numaudit.auditor.compare.ops.comparison import split_ops
from numaudit.auditor.compare.ops.escalation import (
    LiveDrill,
    directive_status,
    drill_status,
    latest_step,
)
from numaudit.auditor.compare.policy.load import Policy
from numaudit.auditor.compare.read.columns import Catalog, ReadMark, RunColumns
from numaudit.auditor.compare.read.segments import ranges_index
from numaudit.auditor.store import Reader


@dataclass
class LiveEvent:
    """What `LiveComparison.poll` reports: a finding (maybe the first divergence) or a status."""

    finding: F.Finding | None = None
    first_divergence: bool = False
    status: str = ""
    directive: dict | None = None
    """With escalation: a directive to send both runs' agents (`ops.escalation`)."""
    drill: dict | None = None
    """With escalation: the op-level comparison of an escalated module's step."""


class LiveComparison:
    """Compare two runs while they are still being written (``auditor watch``).

    Each `poll` reads the records stored since the last one and reports every key that became
    *final*: its pieces tile the logical tensor in both runs and no further piece can change
    it. A key whose pieces are all disjoint shards is final as soon as they tile it; a key with
    replicas or Partial addends (more copies may still arrive) once every rank of both runs has
    moved past its step (sent a record of a later step, or closed its session). When both runs
    have finished (every rank registered and closed) everything left is reported, missing keys
    included. The first divergence is announced once: when every key up to its step has been
    reported in both runs, so that no earlier divergence can still appear.

    Runs that group a step's samples into other microbatches (`auditor.compare.merge.regroup`) are
    regrouped once that step is complete in both runs (every rank past it, or finished): until
    then a step whose keys disagree in logical shape between the runs holds back its
    per-microbatch keys, which would otherwise read as shape differences and missing keys.

    Each poll reports its keys in execution order, the order the agents' hooks fired
    (`auditor.compare.measure.order`); for runs stored by agents before capture numbers it is
    storage order, which a status event says once.
    """

    def __init__(self, reader: Reader, ref: str, cand: str, policy: Policy | None = None, *,
                 noise: NoiseSpec | None = None, escalate: bool = False) -> None:
        self.reader = reader
        self.names = {"ref": ref, "cand": cand}
        self.policy = policy or Policy()
        reader.run_id(ref)
        reader.run_id(cand)
        self.noise = noise
        """Noise bands the keys are judged against (`auditor.compare.noise.judge`): measured here
        from the reference's reruns, which must be stored already."""
        if noise is not None:
            resolve_bands(reader, ref, noise, self.policy)
        self.catalog = Catalog(reader, self.policy.renames)
        from numaudit.auditor.compare.conventions.activation_grads import bwd_factor
        self.bwd_factor, _ = bwd_factor(reader.run_info(ref), reader.run_info(cand))
        self.cols = {side: RunColumns.empty(name, side) for side, name in self.names.items()}
        self.marks = {side: ReadMark() for side in self.names}
        """How far each run was read (`ReadMark`: never past a record that commits late)."""
        self.done = {side: np.zeros(0, bool) for side in self.names}
        self.reported: set[tuple[int, int]] = set()
        self.breach_steps: set[int] = set()
        self.announced = False
        self.finished = False
        self.emitted = 0
        self._late_warned = False
        self._last_past = -math.inf
        self._notes: set[str] = set()
        """Regrouping lines already reported (one status event each)."""
        self._lines: list[str] = []
        """The last regrouping's lines."""
        self.drill = LiveDrill(self.names, self.catalog) if escalate else None
        """Escalation (`auditor watch --escalate`): operation records go there, and modules
        that introduce a divergence get directives (`auditor.compare.ops.escalation`)."""

    def _progress(self, side: str) -> tuple[float, bool]:
        """(the step every rank of the run is past, whether the run is finished)."""
        run_id = self.reader.run_id(self.names[side])
        world = self.reader.conn.execute("SELECT world_size FROM runs WHERE run_id = ?",
                                         (run_id,)).fetchone()[0]
        sessions = self.reader.conn.execute(
            "SELECT rank, closed IS NOT NULL FROM sessions WHERE run_id = ?", (run_id,)).fetchall()
        closed = {r for r, c in sessions if c}
        ranks = {r for r, _ in sessions}
        finished = len(ranks) >= world and closed >= ranks
        if len(ranks) < world:
            return -1.0, False
        cols = self.cols[side]
        latest = np.full(max(ranks, default=0) + 1, -1, np.int64)
        if len(cols):
            np.maximum.at(latest, cols.rank, cols.when >> 24)
        past = min((float(latest[r]) for r in ranks - closed), default=math.inf)
        return past, finished

    def poll(self) -> list[LiveEvent]:
        """Read what arrived and report the keys that became final."""
        events: list[LiveEvent] = []
        new_rows = 0
        for side in ("ref", "cand"):
            old = self.cols[side]
            fresh, self.marks[side] = self.catalog.load_new(self.names[side], side,
                                                            self.marks[side])
            fresh, op_rows = split_ops(fresh, self.catalog)  # compared by the drill, if any
            if self.drill is not None:
                self.drill.add(side, op_rows)
            if not len(fresh):
                continue
            new_rows += len(fresh)
            late = np.array([(int(a), int(b)) in self.reported
                             for a, b in zip(fresh.when, fresh.where)],
                            bool) if self.reported else np.zeros(len(fresh), bool)
            if late.any() and not self._late_warned:
                self._late_warned = True
                events.append(LiveEvent(status=f"{self.names[side]}: {int(late.sum())} pieces "
                                               "arrived for keys already reported; ignored"))
            fresh.max_rid = max(fresh.max_rid, old.max_rid)
            merged = old.concat(fresh)
            done = np.concatenate([self.done[side], late])
            # keep `done` aligned with the re-sorted rows
            order = np.lexsort((np.concatenate([old.rank, fresh.rank]),
                                np.concatenate([old.where, fresh.where]),
                                np.concatenate([old.when, fresh.when])))
            self.done[side] = done[order]
            self.cols[side] = merged
        (past_r, fin_r), (past_c, fin_c) = self._progress("ref"), self._progress("cand")
        self.finished = fin_r and fin_c
        past = min(past_r if not fin_r else math.inf, past_c if not fin_c else math.inf)
        if new_rows or self.finished or past != self._last_past:
            events.extend(self._emit(past, everything=self.finished))
        self._last_past = past
        if not self.announced and self.breach_steps:
            s = min(self.breach_steps)
            if s < past or self.finished:
                events.extend(self._announce(s))
        if self.drill is not None:
            events.extend(self._drilled(past, self.finished))
        return events

    def _drilled(self, past: float, finished: bool) -> list[LiveEvent]:
        """The escalated modules' op-level comparisons whose step both runs are past, and the
        directives asked again for those a run passed without captures (`ops.escalation`)."""
        assert self.drill is not None  # called only when there is a drill (`poll`)
        if not self.drill.ready(past, finished):
            return []
        mesh = {side: mesh_of(self.reader, name) for side, name in self.names.items()}
        labels = {side: self.reader.run_info(name)["labels"]
                  for side, name in self.names.items()}
        reports, again = self.drill.progress(past, finished, latest_step(self.cols),
                                             self.policy, self.reader, self._bwd_factor(),
                                             mesh, labels)
        return ([LiveEvent(status=drill_status(r), drill=r) for r in reports]
                + [LiveEvent(status=directive_status(d, self.names), directive=d)
                   for d in again])

    def flush(self) -> list[LiveEvent]:
        """Report everything left (the runs ended or the watch timed out)."""
        events = self._emit(math.inf, everything=True)
        if not self.announced and self.breach_steps:
            events.extend(self._announce(min(self.breach_steps)))
        if self.drill is not None:
            events.extend(self._drilled(math.inf, True))
        return events

    def _pending(self, side: str) -> RunColumns:
        return self.cols[side].take(np.flatnonzero(~self.done[side]))

    def _evaluate(self, rc: RunColumns, cc: RunColumns, regroup_before: float = math.inf):
        """The comparison of these records, as `compare` makes it: with the runs' activation
        gradient scale, mesh coordinates and labels (read each poll: ranks may register
        late), and the steps before ``regroup_before`` (complete in both runs) regrouped."""
        rc = place_uneven(rc, self.catalog, cc)[0]
        cc = place_uneven(cc, self.catalog, rc)[0]
        rc, cc = self._regroup(rc, cc, regroup_before)
        comp = evaluate(rc, cc, self.catalog, self.policy, self.reader,
                        bwd_factor=self._bwd_factor())
        comp.mesh = {side: mesh_of(self.reader, name) for side, name in self.names.items()}
        comp.labels = {side: self.reader.run_info(name)["labels"]
                       for side, name in self.names.items()}
        if self.noise is not None:
            comp.noise_summary = apply_bands(comp, self.noise)
            comp.noise_summary.pop("warnings")
        return comp

    def _bwd_factor(self) -> float:
        """The runs' activation-gradient factor, their declared scales made relative to the
        microbatches their steps were re-keyed into so far (`regroup.rescale_declared`)."""
        if not self.catalog.__dict__.get("regrouped_sizes"):
            return self.bwd_factor
        from numaudit.auditor.compare.conventions.activation_grads import bwd_factor
        infos = {side: self.reader.run_info(name) for side, name in self.names.items()}
        rescale_declared(infos, self.catalog)
        return bwd_factor(infos["ref"], infos["cand"])[0]

    def _regroup(self, rc: RunColumns, cc: RunColumns, before: float
                 ) -> tuple[RunColumns, RunColumns]:
        """The rows of steps before ``before`` regrouped (`regroup`), the others as they are;
        the regrouping's lines are kept in ``_lines`` (`_emit` reports each once)."""
        old_r, old_c = before > (rc.when >> 24), before > (cc.when >> 24)
        if not old_r.any() or not old_c.any():
            return rc, cc
        gr, gc, lines = regroup_with_replicas(rc.take(np.flatnonzero(old_r)),
                                              cc.take(np.flatnonzero(old_c)), self.catalog)
        self._lines = lines
        if old_r.all() and old_c.all():
            return gr, gc
        return (gr.concat(rc.take(np.flatnonzero(~old_r))),
                gc.concat(cc.take(np.flatnonzero(~old_c))))

    def _emit(self, past: float, *, everything: bool) -> list[LiveEvent]:
        rc, cc = self._pending("ref"), self._pending("cand")
        if not len(rc) and not len(cc):
            return []
        self._lines = []
        comp = self._evaluate(rc, cc, math.inf if everything else past)
        # the regrouping's lines, and whether execution order rests on storage order (runs
        # stored by agents before capture numbers): each reported once
        lines = self._lines + [w for w in self.catalog.warnings if w.startswith(APPROXIMATED)]
        fresh = [line for line in lines if line not in self._notes]
        self._notes.update(fresh)
        rk, ck = comp.ref_keys, comp.cand_keys
        step = comp.when >> 24
        if everything:
            final = np.ones(len(comp), bool)
        else:
            hr, hc = comp.ref_index >= 0, comp.cand_index >= 0
            st_r = np.where(hr, rk.status[np.maximum(comp.ref_index, 0)] if len(rk) else -1, -1)
            st_c = np.where(hc, ck.status[np.maximum(comp.cand_index, 0)] if len(ck) else -1, -1)
            copies_r = _has_copies(rk, self.catalog, rc)
            copies_c = _has_copies(ck, self.catalog, cc)
            cp_r = np.where(hr, copies_r[np.maximum(comp.ref_index, 0)] if len(rk) else False,
                            False)
            cp_c = np.where(hc, copies_c[np.maximum(comp.cand_index, 0)] if len(ck) else False,
                            False)
            tiled = hr & hc & np.isin(st_r, (M.OK, M.NONE)) & np.isin(st_c, (M.OK, M.NONE)) \
                & ~cp_r & ~cp_c
            final = (tiled & ~_grouped_otherwise(comp, hr, hc, step, past)) | (step < past)
        events = [LiveEvent(status=line) for line in fresh]
        for i in comp.order[final[comp.order]]:
            i = int(i)
            if comp.verdict[i] == F.IGNORED:
                continue
            f = finding(comp, i)
            events.append(LiveEvent(finding=f))
            if f.breach:
                self.breach_steps.add(f.key.step)
        self.emitted += sum(e.finding is not None for e in events)
        if self.drill is not None:  # modules that introduce a divergence: ask for their ops
            events += [LiveEvent(status=directive_status(d, self.names), directive=d)
                       for d in self.drill.flagged([e.finding for e in events if e.finding],
                                                   latest_step(self.cols))]
        # mark the rows of reported keys (by record id: regrouping re-sorts the rows)
        for which, lk, cols, keys in (("ref", rk, comp.ref, comp.ref_index),
                                      ("cand", ck, comp.cand, comp.cand_index)):
            g = keys[final & (keys >= 0)]
            if not len(g):
                continue
            rows, _ = ranges_index(lk.first[g], lk.first[g] + lk.count[g])
            self.done[which] |= np.isin(self.cols[which].rid, cols.rid[rows])
        for a, b in zip(comp.when[final].tolist(), comp.where[final].tolist()):
            self.reported.add((a, b))
        return events

    def _announce(self, step: int) -> list[LiveEvent]:
        """Evaluate every key up to ``step`` in both runs and announce the earliest breach."""
        parts = {}
        for side in ("ref", "cand"):
            c = self.cols[side]
            parts[side] = c.take(np.flatnonzero(step >= (c.when >> 24)))
        comp = self._evaluate(parts["ref"], parts["cand"], step + 1)
        fd = comp.first_divergence()
        if fd < 0:
            return []
        if comp.verdict[fd] in (F.DIVERGED, F.NONFINITE) and comp.ref_index[fd] >= 0 \
                and comp.cand_index[fd] >= 0:
            try:
                got = localize(comp, fd)
            except PayloadUnavailable:
                got = None
            if got is not None:
                comp.pieces[fd] = got
            if self.noise is not None:
                noise_pieces(comp)  # boxes beyond their own noise band, not the preset's
        self.announced = True
        return [LiveEvent(finding=finding(comp, fd), first_divergence=True)]


def _grouped_otherwise(comp, hr: np.ndarray, hc: np.ndarray, step: np.ndarray,
                       past: float) -> np.ndarray:
    """Per key: a per-microbatch key of a step not yet complete in both runs (``step >=
    past``) in which some key has other logical shapes in the two runs, the sign of samples
    grouped into other microbatches (or of a real shape difference, reported once the step is
    complete): such keys wait for the step to be regrouped."""
    rk, ck = comp.ref_keys, comp.cand_keys
    both = hr & hc
    differ = np.zeros(len(comp), bool)
    if both.any():
        differ[both] = rk.shape[comp.ref_index[both]] != ck.shape[comp.cand_index[both]]
    open_steps = np.unique(step[differ & (step >= past)])
    per_mb = ((comp.when >> 4) & 0xFFFFF) > 0  # microbatch + 1: 0 for per-step keys
    return per_mb & np.isin(step, open_steps)


def _has_copies(lk: LogicalKeys, catalog: Catalog, cols: RunColumns) -> np.ndarray:
    """Keys whose pieces include replicas or Partial addends (more copies may still arrive)."""
    if not len(lk):
        return np.zeros(0, bool)
    flagged = np.array([p.replica or p.partial for p in catalog.pieces], bool)
    per_row = flagged[cols.layout] if len(cols) else np.zeros(0, bool)
    return np.logical_or.reduceat(per_row, lk.first) if len(per_row) else np.zeros(len(lk), bool)
