"""Where each capture's piece sits in its logical tensor, and the caches of it: the Capturer's.

Functions of the `Capturer` (agents/capture/capture.py binds them as its methods, `cap` being
the capturer): the layout of a plain tensor captured at a site (a batch share, a replica, a
tensor-parallel block, a per-step value), cached per site and shape; a ragged segment's; a
DTensor shard's, placed in the job's world; a per-rank reduction's (a loss) and its weight; and
whether a plain tensor is a replica over the non-dp mesh dims (`replicated`). The caches are the
capturer's `LayoutCache` (``cap._layouts``)."""

from __future__ import annotations

import dataclasses
import weakref
from typing import NamedTuple

import torch

from numaudit.agents.capture.sharding import is_dtensor, local_shard
from numaudit.agents.capture.sites import matches
from numaudit.agents.layout import (
    PieceLayout,
    batch_layout,
    dim_shard_layout,
    dtensor_layout,
    ragged_layout,
    reduction_layout,
)

PER_STEP_PHASES = ("grad", "param", "optim_grad", "update", "state")
"""Phases captured once per step, of parameters and state_dict entries: full tensors (replicas
over dp) unless DTensors."""
MAX_CACHED_LAYOUTS = 8192


class MeshLayout(NamedTuple):
    """A DTensor shard's layout as `LayoutCache.dtensor` holds it (`dtensor_piece_layout`), with
    the mesh it was worked out for."""

    mesh: weakref.ref
    """A weak reference to the DeviceMesh: tells a reused ``id(mesh)`` apart without keeping
    the mesh, and with it its process groups, alive until the interpreter's teardown."""
    layout: PieceLayout
    """This rank's shard's layout, placed in the job's world (`in_world`)."""


class LayoutCache:
    """The capturer's cached piece layouts (``Capturer._layouts``), one dict per kind, each
    bounded by MAX_CACHED_LAYOUTS: a layout is the same for every capture of a site and shape,
    and worked out once."""

    __slots__ = ("plain", "ragged", "dtensor")

    def __init__(self) -> None:
        self.plain: dict[tuple[str, str, tuple[int, ...], bool | None, int], PieceLayout] = {}
        """(phase, site, shape, replicate, batch dim) -> a plain tensor's layout (`plain_layout`):
        cleared, with the plans worked out from them, when a site's outputs turn out not to hold
        the batch or its tensor-parallel block changes (agents/capture/module_hooks.py)."""
        self.ragged: dict[tuple[int, tuple[int, ...], int, int, int, int, int], PieceLayout] = {}
        """(rows, inner shape, offset, total, part, parts, span) -> a segment's ragged layout
        (`segment_layouts`)."""
        self.dtensor: dict[tuple[int, tuple, torch.Size, str], MeshLayout] = {}
        """(id(mesh), placements, global shape, phase) -> this rank's shard's layout and its
        mesh (`dtensor_piece_layout`): worked out once, as torch's local shape and offset
        computation cost ~50 us a capture."""


def per_sample(cap, t: torch.Tensor | None) -> bool:
    """A loss that holds the batch (``reduction="none"``): not a 0-dim scalar, and as many
    elements on the batch dim as this rank's samples in the microbatch (`_rows`). It is
    this rank's rows of the batch's losses, joined with the other dp ranks' on that dim,
    not a reduction over them. False where the samples are not known."""
    if t is None or t.dim() == 0 or is_dtensor(t) or cap._rows is None:
        return False
    dim = cap.config.batch_dim if cap.config.batch_dim < t.dim() else 0
    return int(t.shape[dim]) == cap._rows


def dtensor_reduction(cap, t, reduce: str, weight, microbatch: int, phase: str, site: str,
                       replicate) -> tuple[PieceLayout | None, torch.Tensor]:
    """(layout, tensor) of a DTensor that is this rank's reduction over its batch share: a
    loss computed from DTensor logits. Replicated (loss_parallel's cross entropy): its
    local tensor is the value, an addend over dp like a plain loss. A mean left
    Partial(avg) (``logits.square().mean()`` of column-sharded logits): its local tensor
    is one addend of a mean over the partial mesh dims too, so the addends are indexed
    over dp x those dims. Anything else: (None, t), placed by its own layout."""
    from torch.distributed.tensor.placement_types import Partial, Replicate

    placements = tuple(t.placements)
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None, t
    partial = [d for d, p in enumerate(placements)
               if isinstance(p, Partial) and p.reduce_op == "avg"]
    if any(not isinstance(p, Replicate) for d, p in enumerate(placements)
           if d not in partial) or (partial and reduce != "mean"):
        return None, t
    index, count = 0, 1
    for d in partial:
        index, count = index * mesh.size(d) + int(coordinate[d]), count * mesh.size(d)
    ident = cap.ident
    if not ident.spans_dp(mesh):
        index, count = ident.dp_rank * count + index, ident.dp_size * count
    local = local_shard(t)
    layout = reduction_layout(tuple(local.shape), reduce, cap._weight(weight, microbatch),
                              index, count, replica=cap.replicated(phase, site, replicate))
    return layout, local


def weight(cap, weight: float | None, microbatch: int) -> float:
    if weight is not None:
        return float(weight)
    if cap.config.microbatch_size is not None:
        return float(cap.config.microbatch_size)
    return float(cap._local_batch.get((cap.step, microbatch), 1))


def replicated(cap, phase: str, site: str, override: bool | None = None) -> bool:
    """Whether a plain tensor captured here is a replica of the same box on other ranks.

    Per capture `replicate=`, then `shard_sites` / `replicate_sites` globs on "phase:site";
    else inferred: every rank holding the same dp rank (tp, cp, ep ranks) captures it too.
    """
    if override is not None:
        return override
    key = f"{phase}:{site}"
    if cap.config.shard_sites and matches(key, cap.config.shard_sites):
        return False
    if cap.config.replicate_sites and matches(key, cap.config.replicate_sites):
        return True
    return cap.ident.ranks_per_dp_rank > 1


def plain_layout(cap, t: torch.Tensor, phase: str, site: str,
                  replicate: bool | None, index: int = 0) -> PieceLayout:
    shape = tuple(t.shape)
    if phase == "input" and shape:
        dim = cap.config.batch_dim
        rows = cap._local_batch[(cap.step, cap.microbatch)] = shape[dim if dim < len(shape)
                                                                       else 0]
        if rows > 1 or cap._rows is None:
            cap._set_rows(rows)
    dim = cap._batch_dims.get((site, index), cap.config.batch_dim)
    key = (phase, site, shape, replicate, dim)
    cache = cap._layouts.plain
    layout = cache.get(key)
    if layout is None:
        if len(cache) >= MAX_CACHED_LAYOUTS:
            cache.clear()
        layout = cache[key] = cap._new_plain_layout(shape, phase, site, replicate, dim)
    return layout


def new_plain_layout(cap, shape: tuple[int, ...], phase: str, site: str,
                      replicate: bool | None, dim: int) -> PieceLayout:
    if phase in PER_STEP_PHASES:
        layout = PieceLayout.full(shape)
        replica = cap.ident.dp_size > 1 or cap.replicated(phase, site, replicate)
        return dataclasses.replace(layout, replica=replica)
    if (site, shape) in cap._batchless and phase in ("fwd", "bwd"):
        # the same on every dp rank (rotary cos/sin): a replica; its gradient, each dp
        # rank's sum over its samples, an addend of a sum over the dp ranks
        replica = cap.ident.dp_size > 1 or cap.replicated(phase, site, replicate)
        if phase == "bwd" and cap.ident.dp_size > 1:
            return reduction_layout(shape, "sum", 1.0, cap.ident.dp_rank,
                                    cap.ident.dp_size,
                                    replica=cap.replicated(phase, site, replicate))
        return dataclasses.replace(PieceLayout.full(shape), replica=replica)
    layout = batch_layout(shape, cap.ident.dp_rank, cap.ident.dp_size, dim)
    shards = cap._output_shards.get(site) if phase in ("fwd", "bwd") else None
    if shards is not None and replicate is None and not (
            cap.config.replicate_sites
            and matches(f"{phase}:{site}", cap.config.replicate_sites)):
        return dim_shard_layout(layout, *shards)
    return dataclasses.replace(layout, replica=cap.replicated(phase, site, replicate))


def segment_layouts(cap, rest: tuple[int, ...], counts: list[int],
                     rows) -> list[PieceLayout]:
    """The ragged layout of each segment (``rows[e]`` places segment e's ``counts[e]``
    rows), one object per distinct place: cached, as a segment's layout repeats whenever
    its expert's share of the routing does."""
    cache = cap._layouts.ragged
    out = []
    for n, r in zip(counts, rows):
        key = (n, rest, r.offset, r.total, r.part, r.parts, r.span)
        layout = cache.get(key)
        if layout is None:
            layout = ragged_layout((n, *rest), r.offset, r.total, part=r.part,
                                   parts=r.parts, span=r.span)
            if len(cache) >= MAX_CACHED_LAYOUTS:
                cache.clear()
            cache[key] = layout
        out.append(layout)
    return out


def dtensor_piece_layout(cap, t, phase: str) -> PieceLayout:
    """The layout of this rank's shard of DTensor ``t`` (agents.layout.dtensor_layout)
    captured under `phase` (:meth:`_in_world`), cached per mesh, placements, global
    shape and phase."""
    mesh = t.device_mesh
    key = (id(mesh), tuple(t.placements), t.shape, phase)
    cache = cap._layouts.dtensor
    hit = cache.get(key)
    if hit is None or hit.mesh() is not mesh:
        # raises for placements it cannot place: not cached
        layout = cap._in_world(dtensor_layout(t), mesh, phase)
        if len(cache) >= MAX_CACHED_LAYOUTS:
            cache.clear()
        hit = cache[key] = MeshLayout(weakref.ref(mesh), layout)
    return hit.layout


def in_world(cap, layout: PieceLayout, mesh, phase: str) -> PieceLayout:
    """Place a DTensor whose mesh leaves out some dims of the job's mesh (the one given to
    attach). Without the dp dim (a tensor-parallel activation on ``mesh["tp"]`` beside
    FSDP2 or DDP) it is one dp rank's value: its activations are that dp rank's rows of
    the batch, placed as a plain tensor's are, and its per-step values replicas over dp.
    Without another dim (an FSDP2 parameter on ``mesh["dp"]`` that no tensor-parallel plan
    covers) the ranks along that dim hold copies of it: replicas, which the comparison
    checks against each other. (Along a pipeline's dim the copies are other stages' other
    sites: each box still has one holder.)"""
    ident = cap.ident
    beside_dp = ident.dp_size > 1 and bool(ident.dp_dim_names) and not ident.spans_dp(mesh)
    copies = ident.lacks_peers(mesh)
    if (beside_dp and phase in PER_STEP_PHASES) or (copies and not layout.partial):
        layout = dataclasses.replace(layout, replica=True)
    if not beside_dp or phase in PER_STEP_PHASES or phase == "loss" or not layout.shape:
        return layout
    rows = layout.logical_shape[0]
    return dataclasses.replace(
        layout, logical_shape=(rows * ident.dp_size, *layout.logical_shape[1:]),
        offsets=(layout.offsets[0] + ident.dp_rank * rows, *layout.offsets[1:]))
