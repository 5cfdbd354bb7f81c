"""Where a module's output sits across tensor-parallel ranks, and DTensors read as their bytes.

Owns what a tensor-parallel style states about a module's output (`output_sharding`: a block of
one dim, an `OutputBlock`, or a replica), the mark a plain tensor-parallel output carries so
that the modules it flows into can tell their outputs are blocks too (`SHARD_MARK`, `set_mark`,
`mark_of`, `followed`), the dim torch's own modules hold the batch on (`output_batch_dims`),
and reading a DTensor without its dispatch: `is_dtensor`, `local_shard`, `avg_ranks`. Used by
the capturer's hooks and layouts (agents/capture/module_hooks.py, piece_layouts.py,
fused_plans.py, capture.py).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from numaudit.agents.identity import RankIdentity


class OutputBlock(NamedTuple):
    """This rank's block of a tensor-parallel output held as a plain tensor: dim `dim` cut into
    `shards` equal blocks, of which this rank holds block `coordinate`
    (agents.layout.dim_shard_layout places it in the logical tensor)."""

    dim: int
    """The sharded dim (negative: from the end, as a style's ``Shard(-1)`` says)."""
    shards: int
    """How many equal blocks the dim is cut into (the tensor-parallel mesh dim's size)."""
    coordinate: int
    """Which block this rank holds (its coordinate on that mesh dim)."""


SHARD_MARK = "_numaudit_shard"
"""Attribute a plain tensor-parallel output carries: its `OutputBlock`, so that the modules it
flows into can tell their outputs are blocks too (`Capturer._follow_shards`)."""


def set_mark(t: torch.Tensor, shards: OutputBlock) -> None:
    """Mark `t`, and its base when `t` is a whole view of it: a module's input is often such
    a view of what an earlier module returned (FSDP2's pre-forward hands its module views of
    the arguments, and their base is the tensor the previous module's view was made from)."""
    try:
        setattr(t, SHARD_MARK, shards)
        if t._is_view():
            base = t._base  # a view's: not None
            if base is not None and base.shape == t.shape:
                setattr(base, SHARD_MARK, shards)
    except (AttributeError, TypeError, RuntimeError):  # a subclass without attributes: the
        pass  # modules it flows into are taken as replicas


def mark_of(x: torch.Tensor) -> OutputBlock | None:
    """The block `x` is marked as: its own mark, or its base's when it is a whole view of it."""
    mark = getattr(x, SHARD_MARK, None)
    if mark is None and x._is_view():
        base = x._base  # a view's: not None
        if base is not None and base.shape == x.shape:
            mark = getattr(base, SHARD_MARK, None)
    return mark


def followed(mark: OutputBlock, x: torch.Tensor, tensors: list) -> OutputBlock | None:
    """The block of a module's output whose input `x` is the block `mark`: the same when the
    first output keeps x's rank and the sharded dim's size, else None."""
    dim, shards, coordinate = mark
    n = x.dim()
    d = dim + n if dim < 0 else dim
    out = tensors[0] if tensors else None
    if (out is None or is_dtensor(out) or out.dim() != n or not 0 < d < n
            or out.shape[d] != x.shape[d]):
        return None
    return mark if d == dim else OutputBlock(d, shards, coordinate)


def output_sharding(module: torch.nn.Module,
                    ident: RankIdentity) -> tuple[bool, OutputBlock | None]:
    """(declared, block): whether a tensor-parallel style states `module`'s output layout,
    and if so the block of the plain tensor each rank holds (None: a replica, or a DTensor
    that carries its own layout).

    A ColwiseParallel or RowwiseParallel module converts its output to ``output_layouts`` in a
    forward hook (``torch.distributed.tensor.parallel``), and hands each rank its local tensor
    when ``use_local_output``: a Shard(d) there is a block of dim d (Colwise's default Shard(-1)
    is a column block, a sequence-parallel Rowwise's Shard(1) a block of tokens); Replicate is
    a replica. PrepareModuleOutput states it the same way. (A sharded weight says nothing by
    itself: FSDP2 shards weights on dim 0 too, and gathers them before the forward.)
    """
    declared = _style_output(module)
    if declared is None:
        return False, None
    placements, local, mesh = declared
    return True, (_mesh_block(placements, mesh, ident) if local else None)


def _style_output(module: torch.nn.Module):
    """(output placements, use_local_output, mesh) a tensor-parallel style's forward hook on
    `module` converts its output to, or None (no such hook, or one this cannot read)."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.parallel import PrepareModuleOutput
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    for hook in module._forward_hooks.values():
        cells = []
        for cell in getattr(hook, "__closure__", None) or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        mesh = next((c for c in cells if isinstance(c, DeviceMesh)), None)
        if mesh is None:
            continue
        for c in cells:
            if (isinstance(c, functools.partial) and len(c.args) == 2
                    and getattr(c.func, "__name__", "") == "_prepare_output_fn"):
                return tuple(c.args[0]), bool(c.args[1]), mesh  # Colwise/RowwiseParallel
            if isinstance(c, PrepareModuleOutput) and len(c.desired_output_layouts) == 1:
                return tuple(c.desired_output_layouts), bool(c.use_local_output), mesh
    return None


def _mesh_block(placements: tuple, mesh, ident: RankIdentity) -> OutputBlock | None:
    """The block of this rank's local tensor under `placements` on a 1-dim non-dp `mesh` when
    they shard one dim; None for a replica (or what this cannot place)."""
    from torch.distributed.tensor.placement_types import Shard

    if mesh.ndim != 1 or len(placements) != 1 or not isinstance(placements[0], Shard):
        return None
    coordinate = mesh.get_coordinate()
    if coordinate is None or ident.is_dp_mesh(mesh):
        return None
    return OutputBlock(int(placements[0].dim), int(mesh.size(0)), int(coordinate[0]))


_DTENSOR: list = []


def output_batch_dims(module: torch.nn.Module) -> dict[int, int]:
    """Output index -> the dim holding the batch, for torch modules that say so themselves:
    RNNs (output: 0 with `batch_first`, else 1; the hidden states (h_n, c_n): always 1),
    MultiheadAttention (output as `batch_first` says; attention weights: 0) and the Transformer
    layers and stacks (`batch_first`). Other modules: {} (config.batch_dim)."""
    nn = torch.nn
    if isinstance(module, nn.RNNBase):
        return {0: 0 if module.batch_first else 1, 1: 1, 2: 1}
    if isinstance(module, nn.MultiheadAttention):
        return {0: 0 if module.batch_first else 1, 1: 0}
    if isinstance(module, nn.Transformer):
        first = module.batch_first
    elif isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        first = module.self_attn.batch_first
    elif isinstance(module, (nn.TransformerEncoder, nn.TransformerDecoder)) and module.layers:
        first = module.layers[0].self_attn.batch_first
    else:
        return {}
    return {0: 0 if first else 1}


def avg_ranks(t) -> int:
    """The addends a DTensor's Partial("avg") placements average over (1: none)."""
    n = 1
    for d, p in enumerate(t.placements):
        if p.is_partial() and getattr(p, "reduce_op", "") == "avg":
            n *= t.device_mesh.size(d)
    return n


def local_shard(t):
    """A DTensor's local shard as its bytes are: the tensor it wraps (``to_local()`` would
    dispatch an autograd function to return a view of it)."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t.to_local()


def is_dtensor(t: torch.Tensor) -> bool:
    if type(t) is torch.Tensor:  # the common case, without the isinstance below
        return False
    if not _DTENSOR:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # pragma: no cover - torch without distributed
            _DTENSOR.append(())  # isinstance against no type: never a DTensor
        else:
            _DTENSOR.append(DTensor)
    return isinstance(t, _DTENSOR[0])
