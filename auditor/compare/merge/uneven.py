"""Uneven batch shares: ranks whose pieces of one key hold different row counts, placed in order.

A module whose rows are a per-rank count (the tokens a dp rank routed to an expert, sequences
packed per rank) and that the agent captured as an ordinary batch split gets, on each rank, the
logical shape ``rows x dp_size`` and the offset ``rows x dp_rank``: with different rows per
rank the pieces cannot tile one tensor. The agent cannot know the other ranks' counts without a
collective in a hook, which it never runs; the auditor can. Before the keys are built, this stage
recognizes the signature (`auditor.compare.merge.ragged_hint.undeclared_ragged`) and places each
piece after the rows of the ranks before it, in dp-rank order, so the logical tensor is their
concatenation: what a single process holds when each rank's rows come from its consecutive
share of the batch (an expert's tokens in token order).

A re-placed piece lies at another place than the one its digest was made for. Its fingerprint
(version 3, a sum of ``u * h**i`` terms over the global index i) follows it exactly: moving the
piece by d indices multiplies it by ``h**d`` (`Catalog.moved`), so the logical tensor's
fingerprint is rebuilt bitwise and two runs whose values agree bit for bit are *identical*
whatever their row counts. Its sketch does not follow (docs/digests.md "Placing pieces after the
fact"): it is never merged or compared. Its counts and moments still merge; keys whose pieces
carry payloads (the default for small tensors) are compared exactly from the bytes; the others
are identical when their fingerprints agree, and otherwise, with no distance to measure, breach
under a tolerance as uncertain, saying why. Declared ragged pieces (`Agent.capture(...,
rows=...)`) keep their sketches too. Fingerprints of version 2 (stores recorded before it) do
not move: such keys are compared as before, from payloads or as uncertain.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from numaudit.auditor.compare.merge.ragged_hint import undeclared_ragged
from numaudit.auditor.compare.merge.samples import share_dim
from numaudit.auditor.compare.read.align import phase_name
from numaudit.auditor.compare.read.columns import Catalog, RunColumns


def place_uneven(cols: RunColumns, catalog: Catalog, other: RunColumns
                 ) -> tuple[RunColumns, list[str]]:
    """``cols`` with the pieces of keys whose dp shares differ in rows re-placed in dp-rank
    order (module docstring), and a warning naming the sites (empty when there are none).

    Two signatures: the ranks' pieces disagree on the logical shape (each took its own rows for
    everyone's), which only uneven shares explain; or they agree but leave rows uncovered (a
    rank whose share routed no token to the expert never called it), re-placed only where that
    gives the shape the ``other`` run holds the key in: else a rank's records may be missing,
    and the key stays incomplete, saying so."""
    if not len(cols):
        return cols, []
    starts = np.flatnonzero(np.r_[True, (cols.when[1:] != cols.when[:-1])
                                  | (cols.where[1:] != cols.where[:-1])])
    logical_id, logical_numel, numel = _layout_arrays(catalog)
    codes = cols.layout
    lid = logical_id[codes]
    disagree = np.minimum.reduceat(lid, starts) != np.maximum.reduceat(lid, starts)
    uncovered = np.add.reduceat(numel[codes], starts) < logical_numel[codes[starts]]
    suspects = np.flatnonzero(disagree | uncovered)
    if not len(suspects):
        return cols, []
    ends = np.r_[starts[1:], len(cols)]
    layout, fp = codes.copy(), cols.fp.copy()
    sites: dict[str, int] = {}
    globs: set[str] = set()
    unshifted = False
    for k in suspects.tolist():
        rows = np.arange(starts[k], ends[k])
        pieces = [catalog.pieces[int(c)] for c in codes[rows]]
        present = [j for j, p in enumerate(pieces) if not p.is_none]
        if disagree[k]:
            if undeclared_ragged(pieces, present) is None:
                continue
        elif not _even_shares(pieces, present):
            continue
        placed = _placed(pieces, present, codes[rows], cols.fp[rows], catalog)
        if not disagree[k] and catalog.pieces[placed[0][1]].logical_shape != _shape_in(
                other, catalog, int(cols.when[rows[0]]), int(cols.where[rows[0]])):
            continue
        catalog.__dict__.setdefault("sample_dims", {})[
            (int(cols.when[rows[0]]), int(cols.where[rows[0]]))] = 0  # rows moved along dim 0
        for j, code, moved_fp in placed:
            layout[rows[j]], fp[rows[j]] = code, moved_fp
            unshifted |= not catalog.seeds_ok[code]
        site = catalog.site_names.get(int(cols.where[rows[0]] >> 32), "?")
        sites[site] = sites.get(site, 0) + 1
        globs.add(f"{phase_name(int(cols.when[rows[0]]) & 0xF)}:{_glob(site)}")
    if not sites:
        return cols, []
    out = RunColumns(cols.name, cols.side, cols.when, cols.where, cols.rank, cols.stage, cols.flags,
                     layout, fp, cols.rid, max_rid=cols.max_rid, order=cols.order)
    return out, [_warning(cols.name, sites, unshifted, sorted(globs))]


def _layout_arrays(catalog: Catalog) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per layout code: an id equal for equal logical shapes, the logical numel, the piece's
    numel (0 for a None piece)."""
    ids: dict[tuple[int, ...], int] = {}
    pieces = catalog.pieces or []
    lid = np.array([ids.setdefault(p.logical_shape, len(ids)) for p in pieces] or [0], np.int64)
    lnumel = np.array([0 if p.is_none else math.prod(p.logical_shape) for p in pieces] or [0],
                      np.int64)
    numel = np.array([0 if p.is_none else p.numel for p in pieces] or [0], np.int64)
    return lid, lnumel, numel


def _even_shares(pieces: list, present: list[int]) -> bool:
    """Every present piece is its dp rank's share of an evenly split batch on dim 0 (the layout
    an ordinary hook records: `samples.share_dim`), all of one dp size."""
    if not present or any(share_dim(pieces[j]) != 0 for j in present):
        return False
    return len({pieces[j].logical_shape[0] // pieces[j].shape[0] for j in present}) == 1


def _shape_in(cols: RunColumns, catalog: Catalog, a: int, b: int) -> tuple[int, ...] | None:
    """The logical shape of key (a, b)'s first present piece in ``cols`` (sorted by A, B)."""
    lo, hi = np.searchsorted(cols.when, a, "left"), np.searchsorted(cols.when, a, "right")
    lo2 = lo + int(np.searchsorted(cols.where[lo:hi], b, "left"))
    hi2 = lo + int(np.searchsorted(cols.where[lo:hi], b, "right"))
    for code in cols.layout[lo2:hi2]:
        piece = catalog.pieces[int(code)]
        if not piece.is_none:
            return piece.logical_shape
    return None


def _placed(pieces: list, present: list[int], codes: np.ndarray, fps: np.ndarray,
            catalog: Catalog) -> list[tuple[int, int, int]]:
    """(position, new layout code, fingerprint there) of each present piece: its dp rank's rows
    after those of the ranks before it (`Catalog.moved`). A piece's dp rank is its offset over its
    rows (the agent's even split); an empty piece holds nothing and sits at the end. Replicas of
    one share (the same dp rank) share a place."""
    share: dict[int, int] = {}
    for j in present:
        p = pieces[j]
        if p.shape[0]:
            share[p.offsets[0] // p.shape[0]] = p.shape[0]
    before, at = {}, 0
    for dp_rank in sorted(share):
        before[dp_rank] = at
        at += share[dp_rank]
    out = []
    for j in present:
        p = pieces[j]
        offset = before[p.offsets[0] // p.shape[0]] if p.shape[0] else at
        moved = replace(p, logical_shape=(at, *p.logical_shape[1:]),
                        offsets=(offset, *p.offsets[1:]))
        code, fp = catalog.moved(moved, int(codes[j]), int(fps[j]))
        out.append((j, code, fp))
    return out


def _glob(site: str) -> str:
    """A site's name with its numbered components as ``*`` (``layers.*.experts.*``): one
    payload glob covers every layer's and every expert's key."""
    return ".".join("*" if part.isdigit() else part for part in site.split("."))


def _warning(run: str, sites: dict[str, int], unshifted: bool, globs: list[str]) -> str:
    names = sorted(sites)
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    keys = sum(sites.values())
    head = (f"{run}: {keys} key{'s' if keys > 1 else ''} at {shown} "
            f"{'hold' if keys > 1 else 'holds'} different row counts on their dp ranks (tokens "
            "routed per rank, packed sequences): each rank's rows were placed after those of the "
            "ranks before it, in dp-rank order; ")
    if unshifted:
        return head + ("their fingerprints could not all move with them (made before "
                       "fingerprint version 3, or with other seeds): such keys are compared from "
                       "their payloads, and without payloads from both runs they breach as "
                       "uncertain (declaring the rows, Agent.capture(..., rows=...), keeps them "
                       "exact)")
    return head + ("their fingerprints moved with them (bitwise equality is exact), but their "
                   "sketches describe the even split the agent assumed: a key whose bits differ "
                   "is measured from payloads, and without payloads from both runs it breaches "
                   "as uncertain under a tolerance; to measure such keys, run both with "
                   f"NUMAUDIT_PAYLOAD={','.join(globs)} (or declare the rows, "
                   "Agent.capture(..., rows=...), which keeps the sketches too)")
