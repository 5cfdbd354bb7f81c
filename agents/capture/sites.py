"""Sites: what a module or parameter is called in a key, whatever wraps it.

FSDP1, activation checkpointing, torch.compile and DDP insert wrapper modules whose names show up
in FQNs; a key must not depend on them, so both runs align on the names of the plain model.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Sequence

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
    block_depth: int = 0,
) -> Iterator[tuple[str, torch.nn.Module]]:
    """(site, module) for every module worth hooking: matched, not excluded, not too deep.

    Not too deep: at most `max_depth` dotted levels, or at most `block_depth` levels inside a
    repeated block (`block_sites`) wherever that block sits, so the default sees a transformer
    block's attention, MLP and norms whether the model keeps its blocks at ``layers.N``
    (torchtitan) or at ``model.layers.N`` (transformers).

    The root itself is skipped (its output is the last hooked module's, or the stage's); wrapper
    modules are skipped in favour of the module they wrap, which carries the same site.
    """
    blocks = block_sites(model) if block_depth > 0 else frozenset()
    seen: set[str] = set()
    for fqn, module in model.named_modules():
        site = normalize_site(fqn)
        if not site or site in seen:
            continue
        last = fqn.rsplit(".", 1)[-1]
        if last in _WRAPPERS:
            continue
        if not matches(site, include) or matches(site, exclude):
            continue
        if depth(site) > max_depth and not _within_block(site, blocks, block_depth):
            continue
        seen.add(site)
        yield site, module


def block_sites(model: torch.nn.Module) -> frozenset[str]:
    """Sites of the repeated blocks of `model`: the children of its ModuleLists and
    ModuleDicts (``model.layers.0`` of a transformers model, ``layers.0`` of torchtitan's)."""
    out = set()
    for fqn, module in model.named_modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            for name, _ in module.named_children():
                out.add(normalize_site(f"{fqn}.{name}" if fqn else name))
    return frozenset(out)


def _within_block(site: str, blocks: frozenset[str], block_depth: int) -> bool:
    """Whether `site` lies at most `block_depth` levels inside its outermost enclosing block
    (the block itself included: a stack nested deeper than max_depth keeps its blocks)."""
    if not blocks:
        return False
    parts = site.split(".")
    for n in range(1, len(parts) + 1):
        if ".".join(parts[:n]) in blocks:
            return len(parts) - n <= block_depth
    return False
