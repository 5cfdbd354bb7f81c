"""Operation keys: how a capture made inside a module names the operation it comes from.

Op-level captures (agents/capture/ops.py, docs/drill-down.md) are ordinary records whose site names
the
module, the operation's place in that module's call and the operation:

    layers.1.attention/12:aten.mm            the 13th operation of a call of layers.1.attention

with the record's `call` the module's call and its `role` and `index` saying which tensor of the
operation it is (forward: `input` i, `output` j; backward: `grad_output` j, the gradient reaching
output j, and `grad_input` i, the gradient the operation's backward produced for input i). A
float argument of the operation (a softmax scale, an epsilon) is input ``SCALAR_INDEX + k``, the
k-th float argument, captured as a 0-dim float64 tensor. Module FQNs never hold '/', so a site
holding one is an operation's. Both sides import this module: the agent writes these sites and
the auditor reads them.
"""

from __future__ import annotations

OP_SEP = "/"
"""Between the module site and the operation's ordinal."""
SCALAR_INDEX = 1024
"""Role-input index of an operation's first float argument (tensor inputs count from 0)."""
COLLECTIVE_PREFIXES = ("c10d.", "_c10d_functional.", "_c10d_functional_autograd.",
                       "_dtensor.")
"""Namespaces of torch's collectives as dispatch sees them: the in-place ProcessGroup ops
(``c10d.allreduce_``) and the functional ones (``_c10d_functional.all_reduce``)."""
CAST_OPS = ("aten._to_copy", "aten.to", "aten._autocast_to_reduced_precision",
            "aten._autocast_to_full_precision", "aten.copy_")
"""Operations that change a tensor's dtype (the names a dtype cast dispatches as)."""


VIEW_OPS = ("aten.t", "aten.view", "aten._unsafe_view", "aten.transpose", "aten.permute",
            "aten.expand", "aten.reshape", "aten.squeeze", "aten.unsqueeze", "aten.slice",
            "aten.select", "aten.split", "aten.split_with_sizes", "aten.chunk", "aten.detach",
            "aten.alias", "aten.clone", "aten.contiguous", "aten.as_strided", "aten.unbind")
"""Operations that move or alias values without computing new ones."""


def op_site(module: str, ordinal: int, name: str) -> str:
    """``layers.1.attention``, 12, ``aten.mm`` → ``layers.1.attention/12:aten.mm``."""
    return f"{module}{OP_SEP}{ordinal}:{name}"


def parse_op_site(site: str) -> tuple[str, int, str] | None:
    """(module site, ordinal, operation name) of an operation's site; None for any other site."""
    module, sep, rest = site.partition(OP_SEP)
    if not sep:
        return None
    ordinal, colon, name = rest.partition(":")
    if not colon or not ordinal.isdigit() or not name:
        return None
    return module, int(ordinal), name


def is_op_site(site: str) -> bool:
    return OP_SEP in site


def op_name(func) -> str:
    """The name an operation's key carries: torch's ``str(func)`` without ``.default``
    (``aten.mm``, ``aten.add.Tensor``, ``c10d.allreduce_``)."""
    name = str(func)
    return name[:-len(".default")] if name.endswith(".default") else name


def is_collective(name: str) -> bool:
    return name.startswith(COLLECTIVE_PREFIXES)


def is_view(name: str) -> bool:
    """An operation that moves or aliases values (``aten.t``, ``aten.view``...)."""
    return any(name == c or name.startswith(c + ".") for c in VIEW_OPS)


def is_cast(name: str) -> bool:
    """A dtype cast (``aten._to_copy`` and the like; with any overload)."""
    return any(name == c or name.startswith(c + ".") for c in CAST_OPS)
