"""Ragged pieces: rows whose count differs per rank (issue 11; docs/agent.md "Ragged pieces").

The tokens a data-parallel rank routes to one expert are a contiguous slice of the logical tensor
"every token routed to that expert", the concatenation of all ranks' rows in dp-rank order. The
fingerprint and the sketch key every element by its global flat index, so a piece must know
where its rows start before it is digested, which depends on the other ranks' row counts. The
agent does not find that out by itself (that would be a blocking collective inside a forward
hook): the code that routes tokens declares it, with `Agent.capture(..., rows=...)`, and gets the
offsets from

- :func:`ragged_rows`: one ``all_gather`` of a vector of row counts (one count per segment, e.g.
  per expert) over the group whose ranks' rows are concatenated — one call per MoE layer and
  microbatch covers every expert of the layer; or
- :func:`rows_from_counts`: the same arithmetic on counts the caller already has (an expert
  parallel layer exchanges its counts before its all-to-all anyway).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RaggedRows:
    """Where a piece's rows sit in a ragged logical tensor (the ``rows=`` of a capture)."""

    offset: int
    """Logical row of the piece's first row."""
    total: int
    """Rows of the logical tensor (all parts together)."""
    part: int
    """First part the piece holds: its position in the concatenation order (e.g. its dp rank)."""
    parts: int
    """Parts concatenated (e.g. the dp size)."""
    span: int = 1
    """Consecutive parts the piece holds (an expert-parallel owner holds every source's rows)."""


def rows_from_counts(counts: Sequence[Sequence[int]], part: int, span: int = 1
                     ) -> list[RaggedRows]:
    """Rows of parts ``part .. part + span - 1`` in each segment, from every part's counts.

    ``counts[p][s]``: rows part ``p`` contributes to segment ``s`` (e.g. tokens dp rank ``p``
    routed to expert ``s``). Returns one :class:`RaggedRows` per segment: the logical tensor of
    segment ``s`` is the concatenation of ``counts[0][s], counts[1][s], ...`` rows.
    """
    parts = len(counts)
    if not part >= 0 or span < 1 or part + span > parts:
        raise ValueError(f"part: parts {part} .. {part + span - 1} not within [0, {parts})")
    n_seg = len(counts[0]) if parts else 0
    if any(len(c) != n_seg for c in counts):
        raise ValueError("counts: every part must give one count per segment")
    out = []
    for s in range(n_seg):
        before = sum(int(counts[p][s]) for p in range(part))
        total = sum(int(counts[p][s]) for p in range(parts))
        out.append(RaggedRows(offset=before, total=total, part=part, parts=parts, span=span))
    return out


def ragged_rows(counts, group=None) -> list[RaggedRows]:
    """Gather every rank's row counts over ``group`` (one all_gather) and place this rank's rows.

    ``counts``: this rank's rows per segment (a 1-D integer tensor or a list, e.g. tokens per
    expert). Parts are the ranks of ``group`` in group-rank order (a data-parallel group: the
    concatenation order of the batch). Collective: every rank of ``group`` must call it, in the
    same order, whether or not its agent is auditing. Without an initialized process group (a
    single process) this rank is the only part and nothing is communicated.
    """
    import torch
    import torch.distributed as dist

    local = torch.as_tensor(counts, dtype=torch.int64).reshape(-1)
    if not (dist.is_available() and dist.is_initialized()):
        return rows_from_counts([local.tolist()], 0)
    size = dist.get_world_size(group)
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    local = local.to(device)
    gathered = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(gathered, local, group=group)
    table = torch.stack(gathered).tolist()
    return rows_from_counts(table, dist.get_rank(group))
