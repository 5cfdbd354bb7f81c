"""FSDP1's flat parameters, seen as the original parameters they hold.

``FullyShardedDataParallel`` (FSDP1) concatenates the parameters of each wrapped module into one
1-D ``FlatParameter``, pads it and gives each rank an equal contiguous range of it. A rank's range
of one original parameter is therefore a run of that parameter's row-major elements, which is a
box of its own shape only by chance. The agent captures each original parameter under its own
site with a *flat* layout (agents.layout.flat_layout): the parameter's flattening, and the
elements of it this rank holds. Digests index elements by flat index, so the auditor merges the
ranks' ranges into the parameter's digest, which compares with a reference that holds the same
parameter whole or in boxes.

Both of FSDP1's forms are read from the ``FlatParameter``'s own metadata (``_fqns``,
``_numels_with_padding``, ``_is_padding_mask``, ``_shard_param_infos``):

- ``use_orig_params=False``: ``named_parameters()`` yields the ``FlatParameter``
  (``..._flat_param``) and the optimizer holds it: :func:`expand` turns it into one view per
  original parameter.
- ``use_orig_params=True``: ``named_parameters()`` yields the original parameters, each a 1-D view
  of this rank's range (empty where the rank holds none of it) with its gradient likewise:
  :func:`expand` gives each its flat layout.

A rank that holds none of a parameter records an empty piece, so that the auditor knows the range
is elsewhere rather than missing; its gradient is None only where the whole flat gradient is None
or the parameter does not require one, as on the ranks that hold it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from numaudit.agents.capture.sites import normalize_site
from numaudit.agents.layout import PieceLayout, flat_layout

if TYPE_CHECKING:  # the type FSDP1's flat parameters are read as (never imported to run)
    from torch.distributed.fsdp._flat_param import FlatParameter


@dataclasses.dataclass(frozen=True)
class FlatView:
    """This rank's range of one original parameter inside a FlatParameter."""

    site: str
    """The original parameter's site (its normalized FQN)."""
    flat: FlatParameter
    """The FlatParameter holding it (this rank's shard of it)."""
    param: torch.nn.Parameter | None
    """The original parameter (``use_orig_params=True``), else None."""
    offset: int
    """Where the range starts in the local shard."""
    start: int
    """Its first element's flat index in the parameter."""
    count: int
    """Elements this rank holds (0: none)."""
    unsharded_offset: int
    """Where the parameter starts in the unsharded FlatParameter (padding included)."""
    layout: PieceLayout
    """This rank's range of the parameter's flattening."""
    whole: PieceLayout
    """All of it, a replica: what every rank holds of its gradient under ``no_sync()``."""

    def part(self, t: torch.Tensor) -> torch.Tensor:
        """This view's range of `t`, a tensor shaped like its holder: the FlatParameter's local
        shard, or the original parameter's 1-D view of it."""
        t = t.detach()
        return t[self.offset:self.offset + self.count] if self.param is None else t.reshape(-1)

    def tensor(self, grads: bool) -> tuple[torch.Tensor | None, PieceLayout]:
        """This rank's range of the parameter's gradient (`grads`) or value, 1-D, and its
        layout; None where the gradient is None (on a rank that holds none of it: where the
        ranks that hold it have None). Under ``no_sync()`` the gradient is not reduce-scattered
        yet: each rank's whole unreduced gradient of the parameter, a replica of the others'
        (which a missing reduction makes them disagree with). ValueError where the tensor is
        not what the metadata places (an unsharded FlatParameter): never mislabelled."""
        flat, param = self.flat, self.param
        sharded = flat._sharded_size.numel()
        if grads:
            g = flat.grad
            if g is not None and g.numel() != sharded:
                at = self.unsharded_offset
                return g.detach()[at:at + self.whole.numel], self.whole
            if param is not None and not self.count:
                if g is None or not param.requires_grad:
                    return None, self.layout
                return g.detach()[:0], self.layout
            t = g if param is None else param.grad
        else:
            t = flat if param is None else param
        if t is None:
            return None, self.layout
        if param is None and t.numel() != sharded:
            raise ValueError(f"{self.site}: its FlatParameter holds {t.numel()} elements, "
                             f"not its shard's {sharded}")
        piece = self.part(t)
        if piece.numel() != self.count:
            raise ValueError(f"{self.site}: {piece.numel()} elements where this rank's range "
                             f"has {self.count}")
        return piece, self.layout


def sweep(items: Iterable[tuple[str, int, torch.Tensor]], views: dict[int, list[FlatView]],
          grads: bool, failed: Callable[[str, Exception], None],
          ) -> Iterator[tuple[str, int, torch.Tensor | None, PieceLayout | None]]:
    """``(site, stage, parameter)`` items as ``(site, stage, gradient or value, layout)``: a
    parameter in `views` (:func:`expand`) becomes its original parameters' ranges with their
    flat layouts, any other keeps its own tensor (layout None: worked out as usual). A view
    that cannot be read is left out and told to `failed` (never recorded as None)."""
    for site, stage, p in items:
        held = views.get(id(p))
        if held is None:
            yield site, stage, (p.grad if grads else p), None
            continue
        for view in held:
            try:
                t, layout = view.tensor(grads)
            except Exception as exc:
                failed(f"reading {view.site} from its FSDP1 FlatParameter", exc)
                continue
            yield view.site, stage, t, layout


def is_flat_parameter(p: torch.Tensor) -> bool:
    """FSDP1 makes its FlatParameters plain Parameters marked ``_is_flat_param``."""
    return getattr(p, "_is_flat_param", False) is True and hasattr(p, "_shard_param_infos")


def expand(model: torch.nn.Module, dp_size: int, copies: bool) -> dict[int, list[FlatView]]:
    """id(p) -> its views, for every parameter of `model` that lives in an FSDP1 FlatParameter:
    a FlatParameter (``use_orig_params=False``) maps to a view per original parameter, an
    original parameter (``use_orig_params=True``) to its own.

    A range is a replica (held by other ranks too, which must agree) under NO_SHARD, under
    HYBRID_SHARD (FSDP1's shard group smaller than the `dp_size` ranks the batch splits over)
    and when `copies` (ranks beside the data-parallel ones, tensor or pipeline parallel, hold
    the same parameters)."""
    out: dict[int, list[FlatView]] = {}
    for prefix, flat, group in _flat_parameters(model):
        replica = copies or not _sharded(flat) or (group is not None and group < dp_size)
        views = list(_views(prefix, flat, replica))
        if flat._params is None:
            out[id(flat)] = views
        else:
            for p, view in zip(flat._params, views):
                out[id(p)] = [view]
    return out


def _flat_parameters(model: torch.nn.Module) -> Iterator[tuple[str, FlatParameter,
                                                               int | None]]:
    """(FQN prefix of the module it flattens, FlatParameter, its shard group's size or None),
    each once. An FSDP module's handle holds it; when the model was attached from inside the
    root wrapper, the root's is found registered on the wrapped module as ``_flat_param``
    (``use_orig_params=False``), without its group."""
    seen: set[int] = set()
    for name, module in model.named_modules():
        handle = getattr(module, "_handle", None)
        flat = getattr(handle, "flat_param", None)
        group = None
        if flat is not None and type(module).__name__ == "FullyShardedDataParallel":
            group = module.process_group.size()
        else:
            flat = module._parameters.get("_flat_param")
        if flat is None or not is_flat_parameter(flat) or id(flat) in seen:
            continue
        seen.add(id(flat))
        yield name, flat, group


def _sharded(flat) -> bool:
    """Whether each rank holds its own range (not NO_SHARD's whole copy on every rank)."""
    sharded = getattr(flat, "_sharded_size", None)
    unsharded = getattr(flat, "_unpadded_unsharded_size", None)
    return sharded is not None and unsharded is not None and sharded != unsharded


def _views(prefix: str, flat, replica: bool) -> Iterator[FlatView]:
    params = flat._params
    numels = [n for n, pad in zip(flat._numels_with_padding, flat._is_padding_mask) if not pad]
    starts = [int(a) for a, pad in zip(itertools.accumulate((0,) + flat._numels_with_padding),
                                        flat._is_padding_mask) if not pad]
    infos = flat._shard_param_infos
    for i, (fqn, numel, info) in enumerate(zip(flat._fqns, numels, infos)):
        site = normalize_site(f"{prefix}.{fqn}" if prefix else fqn)
        if info.in_shard:
            start, count, offset = (info.intra_param_start_idx, info.numel_in_shard,
                                    info.offset_in_shard)
        else:
            start, count, offset = 0, 0, 0
        yield FlatView(site=site, flat=flat, param=None if params is None else params[i],
                       offset=offset, start=start, count=count, unsharded_offset=starts[i],
                       layout=flat_layout(int(numel), start, count, replica=replica),
                       whole=flat_layout(int(numel), 0, int(numel), replica=True))
