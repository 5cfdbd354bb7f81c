"""State dicts as the auditor keys them (phase ``state``): DCP's flat names, every leaf a tensor.

A checkpoint holds a nested state dict (``{"model": ..., "optim": ..., "lr_scheduler": ...}``).
torch.distributed.checkpoint (DCP) saves it flattened: dict keys and list positions joined with
dots (``optim.state.layers.0.wq.weight.exp_avg``, ``optim.param_groups.0.lr``), tensors as
tensors (DTensors as their shards) and everything else (numbers, strings, lists of them) as
pickled bytes. Two sides must name and value every entry alike for a live capture
(`Agent.capture_state_dict`) to compare with the files it was saved to (`auditor checkpoint`):
both use :func:`flatten` for the names, :func:`expand` for bytes that are pickles of plain
data, and :func:`leaf_tensor` for the non-tensor values.

Nested data is walked without recursion and only to `MAX_DEPTH` levels (`TooDeep`, a
ValueError naming the entry): a state dict or a pickle of plain data nested thousands deep
would otherwise end in a RecursionError (DCP's own flattening recurses), or, for a dict key
nested in tuples, in a crashed interpreter (`agents.pickles`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from numaudit.agents.capture.sites import normalize_site
from numaudit.agents.pickles import BoundedUnpickler

MAX_DEPTH = 64
"""Deepest nesting of dicts, lists and tuples walked in a state dict or a pickled value."""


class TooDeep(ValueError):
    """Data nested deeper than `MAX_DEPTH`; the message names the entry."""


def check_depth(value: Any, name: str = "state dict") -> None:
    """TooDeep naming the first path below `name` that nests deeper than MAX_DEPTH (dicts,
    lists, tuples), walked without recursion."""
    todo: list[tuple[Any, tuple[str, ...]]] = [(value, ())]
    while todo:
        v, path = todo.pop()
        if isinstance(v, dict):
            parts: Any = ((str(k)[:64], x) for k, x in v.items())
        elif isinstance(v, (list, tuple)):
            parts = ((str(i), x) for i, x in enumerate(v)
                     if isinstance(x, (dict, list, tuple)))
        else:
            continue
        if len(path) >= MAX_DEPTH:
            where = ".".join((name, *path[:4]))
            raise TooDeep(f"{where}...: nested deeper than {MAX_DEPTH} levels")
        todo.extend((x, (*path, k)) for k, x in parts)


def flatten(state_dict: Any) -> Iterator[tuple[str, Any]]:
    """(name, leaf) of a nested state dict, named as DCP names them on disk.

    DCP's own flattening where this torch has it (lists of plain values stay one leaf, as DCP
    stores them); a traversal with the same rules otherwise. Names are normalized as sites are
    (wrapper components such as ``_orig_mod`` or ``_fsdp_wrapped_module`` dropped)."""
    try:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    except ImportError:  # pragma: no cover - every torch this project pins has it
        flat = dict(_walk(state_dict))
    else:
        flat, _ = flatten_state_dict(state_dict)
    for name, value in flat.items():
        for leaf, v in expand(str(name), value):
            yield normalize_site(leaf), v


MAX_PICKLED_BYTES = 1 << 20
"""Largest bytes value looked into by `expand`."""


def expand(name: str, value: Any) -> list[tuple[str, Any]]:
    """A leaf as the entries it is compared as: bytes holding a pickle of plain data (dicts,
    lists, numbers, strings: what torchtitan saves as a dataloader's state,
    ``{"dp_rank_0": pickle.dumps(loader.state_dict())}``) are that data's own leaves, named
    below `name` (``dataloader.dp_rank_0.samples_yielded``), so a report says which field
    differs; anything else, a pickle naming any class or function included (never loaded), is
    ``[(name, value)]``. The pickle is read by `agents.pickles` (pure data: every global refused,
    memory bounded, no deep hashing); data nested deeper than MAX_DEPTH is TooDeep."""
    if isinstance(value, (dict, list, tuple)):
        check_depth(value, name)
    if (not isinstance(value, (bytes, bytearray)) or value[:1] != b"\x80"
            or len(value) > MAX_PICKLED_BYTES):
        return [(name, value)]
    try:
        data = BoundedUnpickler(bytes(value), name).load()
    except Exception:  # not a pickle, or one of more than plain data: the bytes themselves
        return [(name, value)]
    check_depth(data, name)
    leaves = [(f"{name}.{sub}" if sub else name, v) for sub, v in _walk(data)]
    return leaves if isinstance(data, (dict, list)) and leaves else [(name, value)]


def _walk(value: Any) -> Iterator[tuple[str, Any]]:
    """(dotted path, leaf) of nested dicts and lists (a list of plain values is one leaf), in
    order, without recursion; the caller checked the depth."""
    todo: list[tuple[Any, tuple[str, ...]]] = [(value, ())]
    while todo:
        v, path = todo.pop()
        if isinstance(v, dict):
            todo.extend(reversed([(x, (*path, str(k))) for k, x in v.items()]))
        elif isinstance(v, list) and any(isinstance(x, (dict, list, torch.Tensor)) for x in v):
            todo.extend(reversed([(x, (*path, str(i))) for i, x in enumerate(v)]))
        else:
            yield ".".join(path), v


def leaf_tensor(value: Any) -> torch.Tensor:
    """A state dict leaf as the tensor the auditor digests.

    Tensors (DTensors included) are themselves. A bool is a bool tensor, an int int64, a float
    float64 (so a learning rate compares by value, under the policy's tolerance); a list or
    tuple of numbers (Adam's ``betas``) a 1-D tensor of them. Anything else (a string, None, a
    list of names) is the UTF-8 bytes of its ``repr``, a uint8 tensor compared bitwise.
    """
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, bool):
        return torch.tensor(value, dtype=torch.bool)
    if isinstance(value, int) and -(1 << 63) <= value < (1 << 63):
        return torch.tensor(value, dtype=torch.int64)
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float64)
    if (isinstance(value, (list, tuple)) and value
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
        if all(isinstance(v, int) for v in value) and all(-(1 << 63) <= v < (1 << 63)
                                                          for v in value):
            return torch.tensor(value, dtype=torch.int64)
        return torch.tensor([float(v) for v in value], dtype=torch.float64)
    return torch.frombuffer(bytearray(repr(value).encode("utf-8")), dtype=torch.uint8)
