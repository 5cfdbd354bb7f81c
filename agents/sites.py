"""Sites: what a module or parameter is called in a key, whatever wraps it.

FSDP1, activation checkpointing, torch.compile and DDP insert wrapper modules whose names show up
in FQNs; a key must not depend on them, so both runs align on the names of the plain model.
"""

from __future__ import annotations

import fnmatch
from typing import Iterator, Sequence

import torch

# Wrapper components dropped wherever they appear.
_WRAPPERS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
# DDP's and DataParallel's wrapper: only as the first component.
_LEADING_WRAPPERS = frozenset({"module"})


def normalize_site(fqn: str) -> str:
    """`_orig_mod.module.layers.0._checkpoint_wrapped_module.moe` → `layers.0.moe`."""
    parts = [p for p in fqn.split(".") if p and p not in _WRAPPERS]
    while parts and parts[0] in _LEADING_WRAPPERS:
        parts.pop(0)
    return ".".join(parts)


def depth(site: str) -> int:
    return 0 if not site else site.count(".") + 1


def matches(name: str, globs: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, g) for g in globs)


def select_modules(
    model: torch.nn.Module,
    include: Sequence[str],
    exclude: Sequence[str],
    max_depth: int,
) -> Iterator[tuple[str, torch.nn.Module]]:
    """(site, module) for every module worth hooking: matched, not excluded, not too deep.

    The root itself is skipped (its output is the last hooked module's, or the stage's); wrapper
    modules are skipped in favour of the module they wrap, which carries the same site.
    """
    seen: set[str] = set()
    for fqn, module in model.named_modules():
        site = normalize_site(fqn)
        if not site or site in seen:
            continue
        last = fqn.rsplit(".", 1)[-1]
        if last in _WRAPPERS:
            continue
        if depth(site) > max_depth or not matches(site, include) or matches(site, exclude):
            continue
        seen.add(site)
        yield site, module
