"""Where a piece sits inside its logical tensor (DESIGN.md "piece and layout").

A record is one *piece* of a *logical* tensor: a box ``offsets .. offsets + shape`` inside
``logical_shape``. Pieces of one key from all ranks tile the logical tensor, which is what lets
the auditor rebuild a logical tensor's digest from shards computed under any parallelism.

Layouts come from two places: DTensor placements (:func:`dtensor_layout`) and the declared
data-parallel split of a batch (:func:`batch_layout`). Only boxes are representable; a placement
whose local piece is not one box (a ``_StridedShard`` that interleaves rows) raises
:class:`UnsupportedLayout` instead of being silently mis-indexed.

torch is imported lazily so that this module stays importable where torch is not wanted.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # pragma: no cover
    pass

logger = logging.getLogger(__name__)


class UnsupportedLayout(ValueError):
    """A tensor's placement cannot be described as one box of its logical tensor."""


@dataclass(frozen=True)
class PieceLayout:
    """One box of a logical tensor, plus how copies of the box relate across ranks."""

    logical_shape: tuple[int, ...]
    """Global shape of the logical tensor; ``()`` for a 0-dim tensor."""
    offsets: tuple[int, ...]
    """Start of the piece in each dim of the logical tensor."""
    shape: tuple[int, ...]
    """Extent of the piece in each dim; ``offsets[d] + shape[d] <= logical_shape[d]``."""
    replica: bool = False
    """Identical copies of this box exist on other ranks (a Replicate mesh dim)."""
    partial: bool = False
    """This piece is one addend of its box (a Partial placement): addends sum to the values."""
    reduce: str = ""
    """"mean" | "sum": this piece is this dp rank's reduction over its batch share; "" = not one."""
    reduce_weight: float = 1.0
    """MEAN: batch elements this addend averages over."""
    reduce_index: int = 0
    """The addend (the dp rank); pieces with the same index are replicas of one addend."""
    reduce_count: int = 1
    """Addends that make the whole (the dp size)."""
    ragged: RaggedParts | None = None
    """The logical tensor is a concatenation of parts on dim 0 and this piece holds some of them
    (:func:`ragged_layout`); None for every other piece."""
    flat: bool = False
    """``logical_shape`` is the tensor's flattening (one dim) and the piece a row-major range of
    it (:func:`flat_layout`): an FSDP1 rank's share of a parameter."""

    @classmethod
    def full(cls, shape: Sequence[int]) -> PieceLayout:
        """The whole tensor as one piece (no parallelism)."""
        shape = tuple(int(s) for s in shape)
        return cls(logical_shape=shape, offsets=(0,) * len(shape), shape=shape)

    @property
    def numel(self) -> int:
        """Elements in the piece."""
        return math.prod(self.shape)

    @property
    def logical_numel(self) -> int:
        """Elements in the logical tensor."""
        return math.prod(self.logical_shape)

    @property
    def is_full(self) -> bool:
        """The piece is the whole logical tensor."""
        return self.shape == self.logical_shape

    def validate(self) -> None:
        """Raise ValueError naming the offending field when the box is not inside the tensor."""
        n = len(self.logical_shape)
        for name in ("offsets", "shape"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"{name}: length {len(getattr(self, name))} != len(logical_shape) {n}"
                )
        for name in ("logical_shape", "offsets", "shape"):
            values = getattr(self, name)
            for d, v in enumerate(values):
                if not isinstance(v, int) or isinstance(v, bool):
                    raise ValueError(f"{name}[{d}]: {v!r} is not an int")
                if v < 0:
                    raise ValueError(f"{name}[{d}]: {v} is negative")
        for d, (o, s, g) in enumerate(zip(self.offsets, self.shape, self.logical_shape)):
            if o + s > g:
                raise ValueError(
                    f"shape[{d}]: offsets[{d}] + shape[{d}] = {o} + {s} > logical_shape[{d}] = {g}"
                )

    def to_proto(self, pb: Any, *, dtype: str, complex_as_real: bool = False) -> Any:
        """Fill a ``numaudit.v1.Layout`` message (``dtype`` without the ``torch.`` prefix)."""
        pb.logical_shape[:] = self.logical_shape
        pb.offsets[:] = self.offsets
        pb.shape[:] = self.shape
        pb.replica = self.replica
        pb.partial = self.partial
        pb.dtype = dtype
        pb.complex_as_real = complex_as_real
        fill_reduction(pb, self)
        if self.ragged is not None:
            pb.ragged_first, pb.ragged_span, pb.ragged_parts = self.ragged
        pb.flat = self.flat
        return pb

    @classmethod
    def from_proto(cls, pb: Any) -> PieceLayout:
        """Read a ``numaudit.v1.Layout`` message (dtype and complex_as_real are not kept)."""
        return cls(
            logical_shape=tuple(pb.logical_shape),
            offsets=tuple(pb.offsets),
            shape=tuple(pb.shape),
            replica=pb.replica,
            partial=pb.partial,
            ragged=(RaggedParts(pb.ragged_first, pb.ragged_span, pb.ragged_parts)
                    if pb.ragged_parts else None),
            flat=pb.flat,
        )


class RaggedParts(NamedTuple):
    """Which parts of a ragged logical tensor a piece holds (proto ``Layout.ragged_*``)."""

    first: int
    """First part held: the piece's position in the concatenation order (e.g. its dp rank)."""
    span: int
    """Consecutive parts held (1, or the source ranks an all-to-all delivered to this rank)."""
    parts: int
    """Parts the logical tensor is the concatenation of (e.g. the dp size)."""


def ragged_layout(local_shape: Sequence[int], row_offset: int, total_rows: int, *, part: int,
                  parts: int, span: int = 1, replica: bool = False) -> PieceLayout:
    """Layout of a piece whose rows are a slice of a concatenation with per-part row counts.

    The logical tensor is parts ``0 .. parts - 1`` concatenated on dim 0 (the tokens each dp rank
    routed to one expert, in dp-rank order); this piece holds parts ``part .. part + span - 1``,
    which start at logical row ``row_offset`` of ``total_rows``. A piece with no rows is valid
    (an expert that got no tokens on this rank): its part must still be declared, so the auditor
    knows the part is empty rather than missing. Offsets come from every part's row count:
    :func:`agents.ragged.ragged_rows` gathers them with one collective.
    """
    local_shape = tuple(int(s) for s in local_shape)
    if not local_shape:
        raise ValueError("local_shape: a ragged piece has rows (at least one dim)")
    if parts < 1:
        raise ValueError(f"parts: {parts} < 1")
    if span < 1 or not part >= 0 or part + span > parts:
        raise ValueError(f"part: parts {part} .. {part + span - 1} not within [0, {parts})")
    if row_offset < 0 or row_offset + local_shape[0] > total_rows:
        raise ValueError(f"row_offset: rows {row_offset} + {local_shape[0]} exceed total_rows "
                         f"{total_rows}")
    layout = PieceLayout(
        logical_shape=(int(total_rows), *local_shape[1:]),
        offsets=(int(row_offset),) + (0,) * (len(local_shape) - 1),
        shape=local_shape,
        replica=replica,
        ragged=RaggedParts(int(part), int(span), int(parts)),
    )
    layout.validate()
    return layout


def flat_layout(numel: int, start: int, count: int, *, replica: bool = False) -> PieceLayout:
    """Layout of elements ``start .. start + count`` (row-major) of a tensor of `numel` elements,
    whatever its shape: the piece is a range of the tensor's flattening, which the digest indexes
    as it indexes the tensor itself (by flat index). FSDP1 holds each rank's share of a
    parameter this way; ``count`` 0 is a rank that holds none of it."""
    if not start >= 0 or not count >= 0 or start + count > numel:
        raise ValueError(f"start: elements {start} + {count} exceed numel {numel}")
    layout = PieceLayout(logical_shape=(int(numel),), offsets=(int(start),), shape=(int(count),),
                         replica=replica, flat=True)
    layout.validate()
    return layout


def batch_layout(local_shape: Sequence[int], dp_rank: int, dp_size: int,
                 dim: int = 0) -> PieceLayout:
    """Layout of a data-parallel rank's activations: the batch is split on dim `dim` (0; 1 for
    a sequence-first tensor or an RNN's hidden state; a tensor without that dim: 0).

    The logical tensor is the concatenation of all dp ranks' local tensors on that dim, in
    dp-rank order: each rank's consecutive share of the batch. (A DistributedSampler deals the
    samples in turn instead; the auditor recognizes that order from the rows themselves,
    docs/comparison.md section 1a.) A 0-dim tensor (a per-rank scalar
    loss) becomes element ``dp_rank`` of a logical vector of ``dp_size`` elements.
    """
    local_shape = tuple(int(s) for s in local_shape)
    if dp_size < 1:
        raise ValueError(f"dp_size: {dp_size} < 1")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank: {dp_rank} not in [0, {dp_size})")
    if dp_size == 1:
        return PieceLayout.full(local_shape)
    if not local_shape:
        return PieceLayout(logical_shape=(dp_size,), offsets=(dp_rank,), shape=(1,))
    d = dim if dim < len(local_shape) else 0
    rows = local_shape[d]
    return PieceLayout(
        logical_shape=(*local_shape[:d], rows * dp_size, *local_shape[d + 1:]),
        offsets=(0,) * d + (dp_rank * rows,) + (0,) * (len(local_shape) - d - 1),
        shape=local_shape,
    )


def holds_batch(shape: Sequence[int], dim: int, rows: int | None,
                inputs: Sequence[Sequence[int]]) -> bool:
    """Whether a module's output of `shape` holds its rank's share of the batch on batch dim
    `dim`, given the shapes of the module's tensor inputs and this rank's `rows` samples in the
    microbatch (`batch_rows`).

    False for an output of size 1 on that dim computed from an input that holds the
    microbatch's samples there (more than one): the module dropped the batch, and its output is
    the same on every dp rank, such as transformers' rotary ``cos``/``sin`` of shape
    ``[1, seq, dim]`` from the hidden states ``[batch, seq, hidden]``: a replica, not a rank's
    share. True otherwise: an expert that was routed one token gets one row as its input too
    (its rows are tokens, not samples); with one sample per rank nothing tells (the auditor
    recognizes such replicas by their fingerprints); and so does an output computed from inputs
    without the batch (``position_ids`` of ``[1, seq]``).
    """
    if rows is None or rows <= 1 or dim >= len(shape) or int(shape[dim]) != 1:
        return True
    return not any(len(s) > dim and int(s[dim]) == rows for s in inputs)


def batch_rows(args: Sequence[Any], kwargs: dict, dim: int) -> int | None:
    """A model call's samples: the size on batch dim `dim` of its first positional tensor, else
    the largest among its keyword tensors (transformers' ``input_ids``, ``attention_mask`` and
    ``labels`` hold the batch where ``position_ids`` may be ``[1, seq]``); None without one."""
    for a in args:
        if isinstance(a, _tensor_type()) and a.dim() > dim:
            return int(a.shape[dim])
    sizes = [int(v.shape[dim]) for v in kwargs.values()
             if isinstance(v, _tensor_type()) and v.dim() > dim]
    return max(sizes) if sizes else None


def _tensor_type():
    import torch

    return torch.Tensor


def reduction_layout(local_shape: Sequence[int], reduce: str, weight: float, dp_rank: int,
                     dp_size: int, *, replica: bool = False) -> PieceLayout:
    """Layout of a value that is this dp rank's reduction (mean or sum) over its batch share.

    The piece is the whole logical tensor; the auditor combines the dp ranks' addends by `reduce`
    (a mean weighted by `weight`), so a per-rank scalar loss rebuilds as the global-batch loss.
    """
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce: {reduce!r} is not 'mean', 'sum' or None")
    if not (math.isfinite(weight) and weight > 0):
        raise ValueError(f"weight: {weight} is not a finite number > 0")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank: {dp_rank} not in [0, {dp_size})")
    full = PieceLayout.full(local_shape)
    return dataclasses.replace(full, replica=replica, reduce=reduce, reduce_weight=float(weight),
                               reduce_index=dp_rank, reduce_count=dp_size)


def dim_shard_layout(layout: PieceLayout, dim: int, shards: int, coordinate: int) -> PieceLayout:
    """`layout` with dim `dim` (negative: from the end) one of `shards` equal blocks, block
    `coordinate`: a tensor-parallel output held as a plain tensor (a ColwiseParallel output's
    columns, dim -1; a sequence-parallel output's tokens, dim 1). Dim 0, the batch dim the
    data-parallel split owns, and dims the tensor does not have leave `layout` as it is."""
    n = len(layout.shape)
    d = dim + n if dim < 0 else dim
    if not 0 < d < n or shards <= 1:
        return layout
    size = layout.shape[d]
    return dataclasses.replace(
        layout, logical_shape=(*layout.logical_shape[:d], size * shards,
                               *layout.logical_shape[d + 1:]),
        offsets=(*layout.offsets[:d], size * coordinate, *layout.offsets[d + 1:]), replica=False)


def fill_reduction(msg: Any, layout: PieceLayout) -> None:
    """Set a ``numaudit.v1.Layout`` message's reduction fields from `layout` (none: untouched)."""
    if not layout.reduce:
        return
    from numaudit.protos import numaudit_pb2 as pb

    msg.reduce = pb.REDUCTION_MEAN if layout.reduce == "mean" else pb.REDUCTION_SUM
    msg.reduce_weight = layout.reduce_weight
    msg.reduce_index = layout.reduce_index
    msg.reduce_count = layout.reduce_count


def complex_real_layout(layout: PieceLayout) -> PieceLayout:
    """Layout of ``torch.view_as_real`` of a complex piece: a trailing dim of 2, taken whole."""
    return dataclasses.replace(
        layout,
        logical_shape=(*layout.logical_shape, 2),
        offsets=(*layout.offsets, 0),
        shape=(*layout.shape, 2),
    )


def placements_layout(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Any],
) -> PieceLayout:
    """Layout of the piece held at mesh ``coordinate`` of a tensor with these placements.

    The pure core of :func:`dtensor_layout`, usable without a process group. Plain ``Shard``
    pieces are always one box (sharding a contiguous range contiguously stays contiguous), uneven
    and empty shards included (an empty shard's offset is the dim's size, which torch reports).
    ``_StridedShard`` pieces are boxes in the FSDP2 + TP pattern and are accepted when they are;
    otherwise :class:`UnsupportedLayout` names the placement.
    """
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    global_shape = tuple(int(s) for s in global_shape)
    _check_placements(placements, len(global_shape))
    local_shape, offsets = _compute_local_shape_and_global_offset(
        global_shape, tuple(mesh_shape), list(coordinate), placements
    )
    return _finish(global_shape, mesh_shape, coordinate, placements, local_shape, offsets)


def dtensor_layout(dt: Any) -> PieceLayout:
    """Layout of this rank's local shard of a DTensor (``dt.to_local()``).

    Uses torch's ``compute_local_shape_and_global_offset`` (uneven shards, Shard on any dim,
    multi-dim meshes). ``replica`` is set when any mesh dim is Replicate, ``partial`` when any
    placement is Partial. A rank outside the DTensor's mesh holds nothing: its layout is an empty
    box at the origin.
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = dt.device_mesh
    placements = tuple(dt.placements)
    global_shape = tuple(int(s) for s in dt.shape)
    _check_placements(placements, len(global_shape))
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        zeros = (0,) * len(global_shape)
        return PieceLayout(logical_shape=global_shape, offsets=zeros, shape=zeros)
    local_shape, offsets = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    return _finish(global_shape, tuple(mesh.shape), coordinate, placements, local_shape, offsets)


def _check_placements(placements: Sequence[Any], ndim: int) -> None:
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

    for p in placements:
        if isinstance(p, (Shard, _StridedShard)):
            if not 0 <= p.dim < ndim:
                raise UnsupportedLayout(f"placement {p!r}: dim out of range for {ndim}-dim tensor")
        elif not isinstance(p, (Replicate, Partial)):
            raise UnsupportedLayout(f"placement {p!r} is not Shard, Replicate or Partial")


def _finish(
    global_shape: tuple[int, ...],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Any],
    local_shape: Sequence[int],
    offsets: Sequence[int],
) -> PieceLayout:
    from torch.distributed.tensor.placement_types import Partial, Replicate, _StridedShard

    local_shape = tuple(int(s) for s in local_shape)
    offsets = tuple(int(o) for o in offsets)
    if any(isinstance(p, _StridedShard) for p in placements):
        _check_strided_is_box(global_shape, mesh_shape, coordinate, placements, local_shape,
                              offsets)
    layout = PieceLayout(
        logical_shape=global_shape,
        offsets=offsets,
        shape=local_shape,
        replica=any(isinstance(p, Replicate) for p in placements),
        partial=any(isinstance(p, Partial) for p in placements),
    )
    layout.validate()
    return layout


def _check_strided_is_box(
    global_shape: tuple[int, ...],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Any],
    local_shape: tuple[int, ...],
    offsets: tuple[int, ...],
) -> None:
    """Replay the split of each dim that a ``_StridedShard`` touches, as distribute_tensor does.

    The replay splits an index vector with the placements' own ``_split_tensor`` (mesh dims left
    to right), so it follows whatever torch does; a piece whose indices are not one contiguous
    range, or that disagrees with torch's (shape, offset), is refused.
    """
    import torch
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    strided_dims = {p.dim for p in placements if isinstance(p, _StridedShard)}
    for dim in sorted(strided_dims):
        index = torch.arange(global_shape[dim])
        culprit = None
        for mesh_dim, p in enumerate(placements):
            if not isinstance(p, (Shard, _StridedShard)) or p.dim != dim:
                continue
            if isinstance(p, _StridedShard):
                culprit = p
                splitter: Any = _StridedShard(0, split_factor=p.split_factor)
            else:
                splitter = Shard(0)
            pieces, _ = splitter._split_tensor(index, int(mesh_shape[mesh_dim]), with_padding=False)
            index = pieces[int(coordinate[mesh_dim])]
        n = index.numel()
        if n == 0:
            ok = local_shape[dim] == 0
        else:
            start = int(index[0])
            ok = (
                bool(torch.equal(index, torch.arange(start, start + n)))
                and local_shape[dim] == n
                and offsets[dim] == start
            )
        if not ok:
            raise UnsupportedLayout(
                f"placement {culprit!r} on dim {dim} at mesh coordinate {tuple(coordinate)}: "
                "the local piece is not one contiguous box of the logical tensor"
            )
