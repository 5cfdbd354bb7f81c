"""Owns the diagnosis of ragged outputs captured without being declared ragged.

A module whose output rows are a per-rank count (the tokens a dp rank routed to an expert,
sequences packed per rank) and that is captured as an ordinary batch split gets the logical shape
`rows x dp_size` on each rank, with different rows per rank: the pieces cannot tile one tensor
and the key is `incomplete`. The agent cannot tell by itself without a collective in a hook (it
never blocks training), so the auditor recognizes the signature and says how to declare it.
"""

from __future__ import annotations

from collections.abc import Sequence


def undeclared_ragged(pieces: Sequence, present: list[int]) -> tuple[list[list[int]], str] | None:
    """(position groups by row count, text with {r0}, {r1} ... for their ranks) when `pieces`
    (merge.Piece) are dp batch shares whose row counts differ, else None.

    The signature: every piece is its rank's share of an evenly split batch (logical rows =
    rows x n, offset = rows x its dp rank, for one n >= 2), same trailing dims everywhere, none
    declared ragged, a reduction or a Partial addend, and at least two distinct row counts.
    """
    if any(pieces[i].ragged is not None or pieces[i].reduce or pieces[i].partial
           for i in present):
        return None
    dp_sizes: set[int] = set()
    trailing: set[tuple[int, ...]] = set()
    by_rows: dict[int, list[int]] = {}
    for i in present:
        p = pieces[i]
        if (not p.shape or len(p.logical_shape) != len(p.shape)
                or p.logical_shape[1:] != p.shape[1:] or any(p.offsets[1:])):
            return None
        rows = p.shape[0]
        if rows:
            if p.logical_shape[0] % rows or p.offsets[0] % rows:
                return None
            dp_sizes.add(p.logical_shape[0] // rows)
        elif p.logical_shape[0] or p.offsets[0]:
            return None
        trailing.add(tuple(p.shape[1:]))
        by_rows.setdefault(rows, []).append(i)
    if len(dp_sizes) != 1 or min(dp_sizes) < 2 or len(trailing) != 1 or len(by_rows) < 2:
        return None
    counts = ", ".join(f"{rows} on ranks {{r{k}}}" for k, rows in enumerate(by_rows))
    text = (f"the dp ranks' row counts differ ({counts}) but each piece was placed as its "
            "rank's share of an evenly split batch: the signature of a ragged output (tokens "
            "routed to an expert, sequences packed per rank) whose rows concatenate in dp-rank "
            "order. Declare it where it is captured: Agent.capture(t, ..., rows=...) with rows "
            "from numaudit.agents.ragged.ragged_rows(counts, dp_group), or "
            "Agent.capture_segments for grouped experts (docs/agent.md, Ragged pieces); or "
            "exclude the module")
    return list(by_rows.values()), text
