"""How the agent's hooks run: eagerly under torch.compile, gradient hooks added cheaply.

The capturer (agents/capture/capture.py) decides what a hook captures; this module owns how hooks
are registered and entered: module forward hooks and tensor gradient hooks are disabled for
torch.compile (run eagerly, so the agent's state never becomes a guard of the model's graphs)
at no cost to an eager model, and a gradient hook is put in the tensor's hook dict without a
RemovableHandle (one per hooked output and forward: the handle was half of a hook's
registration cost in a training step).
"""

from __future__ import annotations

import functools
import itertools
from collections import OrderedDict
from collections.abc import Callable

import torch

_dynamo_callback: Callable[[], object] | None  # None: a torch without Dynamo's C internals
try:
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _dynamo_callback
    from torch._C._dynamo.eval_frame import set_code_exec_strategy as _set_strategy
except ImportError:  # pragma: no cover - a torch without these internals: always the wrapper
    _dynamo_callback = None


def _skip_code(code) -> None:
    """What ``torch._dynamo.eval_frame.skip_code`` does (Dynamo never compiles a frame of
    `code`), through the C extension: importing ``torch._dynamo`` costs 0.6-0.8 s, which a
    process that never compiles (a training script without torch.compile, `auditor
    checkpoint`) need not pay."""
    _set_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))


graph_task_id = torch._C._current_graph_task_id
"""-1 outside the autograd engine; while it runs, a forward a hook sees is a checkpoint's
recomputation."""


def grad_role(role: str) -> str:
    """Role of the gradient reaching a tensor captured under `role`: an input's is grad_input,
    anything else's grad_output (so a site's input and output gradients are two keys)."""
    return "grad_input" if role == "input" else "grad_output"


def not_traced(fn):
    """``fn`` run eagerly even inside a ``torch.compile``d model: traced, the agent's code would
    put guards on its own state (site names, data pointers, whether this step is captured) into
    the model's graphs, and turning capture on or off would recompile them. A disabled hook is a
    graph break at each hooked module instead (docs/agent.md, torch.compile).

    What ``torch.compiler.disable(fn)`` does, without its cost where nothing is compiled: its
    wrapper sets and restores the frame evaluation hook on every call (1.1 us against 0.15 for a
    plain call; ~830 hook calls a step at scale 1 of the DS3-style model). This one calls ``fn``
    straight when no compiled code runs on this thread, and the disabled ``fn`` when some does.
    Dynamo never traces it: it carries the disable mark (a graph break where a compiled frame
    calls it, guarded on ``fn`` as disable's is) and its code is on Dynamo's skip list (a frame
    of it is never compiled).
    """
    if _dynamo_callback is None:  # pragma: no cover
        return torch.compiler.disable(fn)
    disabled = None
    """``torch.compiler.disable(fn)``, made at the first call that compiled code makes (Dynamo
    is loaded then): made here, it would import torch._dynamo in every process."""

    @functools.wraps(fn)
    def eager_or_disabled(*args, **kwargs):
        nonlocal disabled
        if _dynamo_callback() is None:
            return fn(*args, **kwargs)
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    eager_or_disabled._torchdynamo_disable = True
    eager_or_disabled._torchdynamo_disable_msg = None  # disable's, without a reason
    eager_or_disabled._torchdynamo_orig_callable = fn
    eager_or_disabled._torchdynamo_disable_recursive = True
    _skip_code(eager_or_disabled.__code__)  # one code object for all: idempotent
    return eager_or_disabled


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
