"""How this run's loss is normalized, as the scale of its activation gradients
(docs/parallelisms.md).

`grad_scale` is what the agent sends at Register: this run's activation gradients (phase `bwd`)
relative to one process that runs the same microbatches with each microbatch's loss averaged over
the whole microbatch (all dp ranks' shares). The auditor compares activation gradients of two
runs after applying the ratio of their scales; parameter gradients are compared as they are.

- `per_rank_mean` (what ordinary DDP/FSDP code does, and the default): each rank's loss is the
  mean over its own share and the gradient reduction averages, so activation gradients are
  dp_size times the reference's while parameter gradients agree: scale dp_size.
- `global_mean`: each rank divides its summed loss by the whole microbatch's element count
  (then gradients are summed across ranks): scale 1.
- `sum`: the loss is a sum over the rank's elements: scale = elements of the whole microbatch
  (microbatch_size x dp_size; needs `microbatch_size`).
- `grad_scale=` declares the number itself (e.g. 1/n for a loss divided by n accumulation steps).

Pipeline schedules (torch.distributed.pipelining) call the loss function per microbatch and run
backward from that loss unscaled; `scale_grads=True` (their default) divides *parameter*
gradients by n_microbatches after the last backward (`PipelineStage.scale_grads`), which leaves
activation gradients alone. So a schedule changes no activation-gradient scale; `note_schedule`
records what it does to parameter gradients so a reader of `auditor show` can see it.

`note_batch_norms` and `note_dropouts` list, in run labels (wire/labels.py), the modules of the
user's code that make a correct run differ from the reference by design (each rank's batch
statistics; random masks), so that the auditor can say so where one introduces a difference.
`note_tied_parameters` lists the parameters held under two names (captured under the first only)
and `note_capture_depth` the agent's max_depth and block_depth (`note_block_lists` the containers
whose children are blocks), so that the auditor tells a parameter or module
that was not captured apart from one captured under another name or left out by the depth.
"""

from __future__ import annotations

from typing import Any

from numaudit.agents.capture.sites import normalize_site
from numaudit.agents.config import AgentConfig
from numaudit.agents.identity import RankIdentity
from numaudit.wire.labels import (
    BATCH_STATS_LABEL,
    BLOCK_DEPTH_LABEL,
    BLOCK_LISTS_LABEL,
    CAPTURE_DEPTH_LABEL,
    DROPOUT_LABEL,
    TIED_LABEL,
    UNPASSED_MESH_LABEL,
)


def grad_scale(config: AgentConfig, ident: RankIdentity) -> tuple[float, str]:
    """(grad_scale, grad_scale_source) for this rank; ValueError names a field that cannot work."""
    if config.grad_scale is not None:
        return float(config.grad_scale), "declared: grad_scale"
    dp = ident.dp_size
    norm = config.loss_normalization
    if norm is None:
        if dp > 1:
            return float(dp), (f"inferred: per-rank mean loss with gradients averaged over {dp} "
                               "dp ranks (DDP/FSDP default)")
        return 1.0, "inferred: one data-parallel rank"
    if norm == "per_rank_mean":
        return float(dp), f"declared: per_rank_mean over {dp} dp ranks"
    if norm == "global_mean":
        return 1.0, "declared: global_mean"
    if norm == "sum":
        if config.microbatch_size is None:
            raise ValueError("microbatch_size: loss_normalization='sum' needs this rank's batch "
                             "elements per microbatch (or declare grad_scale=)")
        n = config.microbatch_size * dp
        return float(n), f"declared: sum over {n} elements per microbatch"
    raise ValueError(f"loss_normalization: {norm!r} is not known")


def note_schedule(ident: RankIdentity, schedule: Any) -> None:
    """Record a pipeline schedule's parameter-gradient scaling in the run's labels."""
    n = getattr(schedule, "_n_microbatches", None)
    scale_grads = getattr(schedule, "scale_grads", None)
    if n is None or scale_grads is None:
        return
    ident.labels.setdefault("pp_schedule", type(schedule).__name__)
    ident.labels.setdefault("pp_microbatches", str(n))
    ident.labels.setdefault(
        "pp_param_grads", f"divided by {n} (scale_grads=True)" if scale_grads else "summed")


def note_batch_norms(ident: RankIdentity, module: Any) -> None:
    """Record the BatchNorm modules (SyncBatchNorm aside) of a data-parallel run in its labels:
    in training mode each normalizes its rank's share of the batch with that share's mean and
    variance, which is not what one process does over the whole batch. The auditor names this
    where such a module introduces a difference (docs/parallelisms.md)."""
    import torch
    from torch.nn.modules.batchnorm import _BatchNorm

    if ident.dp_size <= 1:
        return
    _note_sites(ident, BATCH_STATS_LABEL, [
        name for name, m in module.named_modules()
        if isinstance(m, _BatchNorm) and not isinstance(m, torch.nn.SyncBatchNorm)])


def note_dropouts(ident: RankIdentity, module: Any) -> None:
    """Record the modules that drop elements at random in training (torch's dropout modules with
    p > 0, MultiheadAttention with dropout > 0) in the run's labels, whatever its parallelism:
    runs whose random streams differ (one process against data-parallel ranks, another schedule,
    another seed) drop different elements there, so their outputs differ by design. The auditor
    names this where such a module, or a module holding one, introduces a difference. Modules
    in eval mode when the model is attached (which drop nothing) are left out."""
    import torch
    from torch.nn.modules.dropout import _DropoutNd

    _note_sites(ident, DROPOUT_LABEL, [
        name for name, m in module.named_modules()
        if m.training and ((isinstance(m, _DropoutNd) and m.p > 0)
                           or (isinstance(m, torch.nn.MultiheadAttention) and m.dropout > 0))])


def note_tied_parameters(ident: RankIdentity, module: Any) -> None:
    """Record the parameters ``module`` holds under more than one name (``model.output.weight =
    model.tok_embeddings.weight``) in the run's labels, as "alias=name" with ``name`` the first
    one, the name `named_parameters()` gives it and the agent captures it under: the auditor
    then knows why the alias has no captures, and says so where the other run holds the two
    names as separate parameters."""
    first: dict[int, str] = {}
    pairs = []
    for name, p in module.named_parameters(remove_duplicate=False):
        site = normalize_site(name)
        if id(p) not in first:
            first[id(p)] = site
        elif site != first[id(p)]:
            pairs.append(f"{site}={first[id(p)]}")
    _note_sites(ident, TIED_LABEL, pairs)


def note_block_lists(ident: RankIdentity, module: Any) -> None:
    """Record the ModuleLists and ModuleDicts of ``module`` in the run's labels: their children
    are the repeated blocks `block_depth` counts levels from (agents/capture/sites.py), so the
    auditor can tell a module left out by block_depth from one left out by max_depth."""
    import torch

    _note_sites(ident, BLOCK_LISTS_LABEL, [
        name for name, m in module.named_modules()
        if isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict))])


def note_unpassed_mesh(ident: RankIdentity, module: Any) -> None:
    """A model holding DTensors while attach got no mesh: the job has a mesh the agent could
    name dims by (UNPASSED_MESH_LABEL)."""
    if ident.mesh_shape or UNPASSED_MESH_LABEL in ident.labels:
        return
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return
    if any(isinstance(p, DTensor) for p in module.parameters()):
        ident.labels[UNPASSED_MESH_LABEL] = "1"


def note_capture_depth(ident: RankIdentity, config: AgentConfig) -> None:
    """Record the agent's max_depth and block_depth in the run's labels: a module deeper than
    they reach has no fwd or bwd captures, and the auditor says so (and which of the two to
    raise) rather than asking to capture a phase that was."""
    ident.labels.setdefault(CAPTURE_DEPTH_LABEL, str(config.max_depth))
    ident.labels.setdefault(BLOCK_DEPTH_LABEL, str(config.block_depth))


def _note_sites(ident: RankIdentity, label: str, names: list[str], max_chars: int = 1024) -> None:
    """Add the normalized sites of ``names`` to the run label ``label`` (", "-joined, sites of
    models attached earlier first); past the label's limit, the first ones that fit and "..."."""
    known = [s for s in ident.labels.get(label, "").split(", ") if s]
    merged = list(dict.fromkeys(known + [s for s in map(normalize_site, names) if s]))
    text = ", ".join(merged)
    while len(text) > max_chars and merged:
        merged.pop()
        text = ", ".join(merged + ["..."])
    if merged:
        ident.labels[label] = text
