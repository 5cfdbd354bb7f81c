"""How the agent's hooks run: eagerly under torch.compile, gradient hooks added cheaply.

The capturer (agents/capture.py) decides what a hook captures; this module owns how hooks are
registered and entered: module forward hooks and tensor gradient hooks are disabled for
torch.compile (run eagerly, so the agent's state never becomes a guard of the model's graphs),
and a gradient hook is put in the tensor's hook dict without a RemovableHandle (one per hooked
output and forward: the handle was half of a hook's registration cost in a training step).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import torch


def in_backward() -> bool:
    """True while the autograd engine runs: forwards seen now are checkpoint recomputations."""
    return torch._C._current_graph_task_id() != -1


def grad_role(role: str) -> str:
    """Role of the gradient reaching a tensor captured under `role`: an input's is grad_input,
    anything else's grad_output (so a site's input and output gradients are two keys)."""
    return "grad_input" if role == "input" else "grad_output"


@torch.compiler.disable
def run_grad_hook(capturer, site: str, index: int, call: int, mb: int, stage: int,
                   step: int, layout, role: str, grad) -> None:
    """A hooked tensor's gradient hook (see run_backward_hook); returns None."""
    capturer._grad_hook_body(site, index, call, mb, stage, step, layout, role, grad)


@torch.compiler.disable
def run_backward_hook(capturer, key: tuple, step: int, capture, grad) -> None:
    """Tensor hooks run eagerly (see not_traced); returns None: the gradient is unchanged."""
    capturer._backward_hook_body(key, step, capture, grad)


def not_traced(hook):
    """Hooks run eagerly even inside a ``torch.compile``d model: traced, the agent's code would
    put guards on its own state (site names, data pointers, whether this step is captured) into
    the model's graphs, and turning capture on or off would recompile them. A disabled hook is a
    graph break at each hooked module instead (docs/agent.md, torch.compile)."""
    return torch.compiler.disable(hook)


_HOOK_KEYS = itertools.count(-1, -1)
"""Keys of the hooks add_grad_hook puts in a tensor's hook dict: negative, so they never meet
the ids of torch's RemovableHandles (counted up from 0)."""


def add_grad_hook(t: torch.Tensor, hook) -> None:
    """``t.register_hook(hook)`` for a plain non-leaf tensor, without its handle.

    What Tensor.register_hook does, less the torch-function check, the import and the
    RemovableHandle (a weakref and a class counter) that the agent never uses: it cost ~20 us
    per hooked output inside a training step, once per output and forward. Anything else (a
    subclass, a leaf, a torch without these internals) goes through register_hook.
    """
    if type(t) is torch.Tensor and t.grad_fn is not None:
        try:
            hooks = t._backward_hooks
            if hooks is None:
                hooks = t._backward_hooks = OrderedDict()
                t.grad_fn._register_hook_dict(t)
            hooks[next(_HOOK_KEYS)] = hook
            return
        except AttributeError:  # pragma: no cover - a torch without these internals
            pass
    t.register_hook(hook)
