"""Ranks as a report names them: mesh coordinates, and the boxes a key's pieces occupy.

A rank's mesh coordinate and the run's mesh dim names are what the agents registered
(``sessions.mesh_coordinate``, ``runs.mesh_dim_names``); `mesh_of` reads them once while the store
is open. `fixed_dims` names what a group of ranks share ("dp=1" for the two tp replicas of dp
rank 1) and `varying_dims` the dims they spread over (the dim a collective must reduce over).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence

from numaudit.auditor.compare.read.pieces import Piece


def mesh_of(reader, run: str) -> dict:
    """``{"dims": [name, ...], "coords": {rank: (c0, c1, ...)}}`` of a run (a rank's latest
    session wins; ranks that registered no coordinate are absent)."""
    try:
        run_id = reader.run_id(run)
        row = reader.conn.execute("SELECT mesh_dim_names FROM runs WHERE run_id = ?",
                                  (run_id,)).fetchone()
        names = list(json.loads(row[0]) if row and row[0] else [])
        coords: dict[int, tuple[int, ...]] = {}
        for rank, text in reader.conn.execute(
                "SELECT rank, mesh_coordinate FROM sessions WHERE run_id = ?"
                " ORDER BY rank, registered", (run_id,)):
            c = json.loads(text) if text else []
            if c:
                coords[int(rank)] = tuple(int(x) for x in c)
    except (sqlite3.Error, ValueError, TypeError, LookupError):
        return {"dims": [], "coords": {}}  # a store without these columns: no mesh to name
    return {"dims": names, "coords": coords}


def _dim_name(mesh: dict, d: int) -> str:
    dims = mesh.get("dims") or []
    return dims[d] if d < len(dims) and dims[d] else f"dim{d}"


def fixed_dims(mesh: dict | None, ranks: Sequence[int]) -> dict[str, int]:
    """Mesh dims on which every rank of ``ranks`` has the same coordinate ({} when unknown)."""
    mesh = mesh or {}
    coords = mesh.get("coords") or {}
    got = [coords.get(int(r)) for r in ranks]
    cs = [c for c in got if c is not None]
    if not got or len(cs) < len(got) or len({len(c) for c in cs}) != 1:
        return {}
    return {_dim_name(mesh, d): cs[0][d] for d in range(len(cs[0]))
            if all(c[d] == cs[0][d] for c in cs)}


def varying_dims(mesh: dict | None, ranks: Sequence[int]) -> list[str]:
    """Mesh dims along which ``ranks`` differ: what they are replicas over ([] when unknown)."""
    mesh = mesh or {}
    coords = mesh.get("coords") or {}
    got = [coords.get(int(r)) for r in ranks]
    cs = [c for c in got if c is not None]
    if len(got) < 2 or len(cs) < len(got) or len({len(c) for c in cs}) != 1:
        return []
    return [_dim_name(mesh, d) for d in range(len(cs[0])) if len({c[d] for c in cs}) > 1]


def mesh_text(mesh: dict[str, int]) -> str:
    """``{"dp": 1, "tp": 0}`` → ``dp=1, tp=0``."""
    return ", ".join(f"{k}={v}" for k, v in mesh.items())


def box_text(offsets: Sequence[int], shape: Sequence[int]) -> str:
    """A box as slices: ``[4:8, 0:16]`` (``[]`` for a scalar)."""
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(offsets, shape)) + "]"


def key_boxes(comp, side: str, g: int) -> dict[tuple, list[int]]:
    """The boxes the pieces of logical key ``g`` of one side occupy → the rows holding each
    (several rows: replicas or addends), in rank order; empty pieces and None pieces left out."""
    cols = comp.ref if side == "ref" else comp.cand
    lk = comp.ref_keys if side == "ref" else comp.cand_keys
    first, count = int(lk.first[g]), int(lk.count[g])
    out: dict[tuple, list[int]] = {}
    for r in range(first, first + count):
        p: Piece = comp.catalog.pieces[int(cols.layout[r])]
        if p.is_none or p.numel == 0:
            continue
        out.setdefault(p.box, []).append(r)
    return out
