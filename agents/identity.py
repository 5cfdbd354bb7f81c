"""Who this rank is: torchrun's environment plus, where given, a DeviceMesh."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

ENV_TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
"""Set by torchrun: --rdzv-id, a fresh uuid with --standalone, and "none" by default."""
_PROCESS_JOB_ID = uuid.uuid4().hex
"""The job id of a job of one process: every agent this process attaches belongs to it."""
JOB_ID_STORE_KEY = "numaudit/job_id"
"""Key in the job's c10d store under which the ranks agree on one generated job id."""


@dataclass
class RankIdentity:
    """A rank's place in its job; sent once at registration."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    host: str = ""
    mesh_shape: tuple[int, ...] = ()
    mesh_dim_names: tuple[str, ...] = ()
    mesh_coordinate: tuple[int, ...] = ()
    dp_rank: int = 0
    """Position of this rank's slice of the batch (activations are pieces of one tensor)."""
    dp_size: int = 1
    dp_dim_names: tuple[str, ...] = ()
    """The mesh dims that split the batch, declared or recognized by name (`batch_dims`);
    empty when none is named (then the dp ranks come from dp_rank/dp_size or the world)."""
    dp_group: tuple[int, ...] = ()
    """Global ranks of this rank's dp group (the ranks that hold the other batch shares), in dp
    rank order: read from the mesh when its dims give the split; empty when unknown."""
    peers: tuple[int, ...] = ()
    """Global ranks of the identity mesh that hold this rank's batch share (tp, cp, ep, pp
    ranks; this rank included): empty when unknown."""
    stages: tuple[int, ...] = ()
    """Pipeline stage indices held by this rank; empty when not pipelined."""
    torch_version: str = field(default_factory=lambda: torch.__version__)
    dtype: str = ""
    """Training dtype as the user declares it, e.g. "float32"."""
    seed: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    """Free-form run labels (git commit, config name)."""
    grad_scale: float = 0.0
    """Activation gradients relative to one process on the whole microbatch (0 = undeclared)."""
    grad_scale_source: str = ""
    """How grad_scale was found: "declared", "inferred: ..."."""
    job_id: str = ""
    """The job this rank belongs to, the same on all its ranks ("" = unknown)."""
    job_id_source: str = ""
    """Where job_id came from: "declared", "torchrun", "c10d store", "generated"."""

    @property
    def ranks_per_dp_rank(self) -> int:
        """Ranks that hold the same dp rank's batch share (tp x cp x ep x pp ranks); 1 = pure dp."""
        return max(1, self.world_size // max(1, self.dp_size))

    @property
    def dp_dim_name(self) -> str:
        """The dims that split the batch, as one label ("dp_replicate+dp_shard"; "" = none)."""
        return "+".join(self.dp_dim_names)

    def spans_dp(self, mesh) -> bool:
        """Whether a DTensor on `mesh` spans the batch split: its mesh holds this rank's whole dp
        group (an FSDP2 parameter on the dp dims, under whatever names: torchtitan's ``fsdp``
        beside its data-loading ``batch``), rather than lying beside it (a tensor-parallel
        activation on the ``tp`` mesh: one dp rank's rows). Decided by ranks where the
        identity mesh gave the dp group, else by dim names."""
        if self.dp_group:
            return set(self.dp_group) <= _mesh_ranks(mesh)
        return bool(self.dp_dim_names) and any(
            n in self.dp_dim_names for n in (mesh.mesh_dim_names or ()))

    def lacks_peers(self, mesh) -> bool:
        """Whether ranks holding this rank's batch share lie outside `mesh` (an FSDP2 parameter
        on the dp mesh that no tensor-parallel plan covers: the tp ranks hold copies)."""
        if self.peers:
            return not set(self.peers) <= _mesh_ranks(mesh)
        names = tuple(mesh.mesh_dim_names or ())
        return any(n not in names for n in self.mesh_dim_names if n not in self.dp_dim_names)

    def is_dp_mesh(self, mesh) -> bool:
        """Whether 1-dim `mesh` is the batch split itself (a style's output placed over it is
        not a tensor-parallel block)."""
        if self.dp_group:
            return _mesh_ranks(mesh) == set(self.dp_group)
        names = tuple(mesh.mesh_dim_names or ())
        return bool(names) and names[0] in self.dp_dim_names


BATCH_DIM_NAMES = ("dp", "batch", "data", "ddp", "hsdp", "fsdp", "dp_replicate", "dp_shard",
                   "dp_shard_cp", "dp_cp")
"""Mesh dims that split the batch when none is declared: the README's ``dp``, torchtitan's
``batch`` (its data-loading mesh), ``dp_replicate`` x ``dp_shard`` (HSDP) and the flattened
``fsdp``, ``dp_shard_cp``, ``dp_cp`` (which fold context parallelism in: under CP, declare
``dp_dims``). ``dp`` or ``batch`` alone is the whole split; otherwise every such dim is part of
it, in mesh order."""
OTHER_DIM_NAMES = frozenset({"tp", "pp", "cp", "ep", "sp", "etp", "tensor", "pipeline",
                             "context", "expert"})
"""Mesh dims known not to split the batch: a mesh of only these that spans the world (pure
tensor or pipeline parallelism) has one dp rank."""


def batch_dims(names) -> tuple[str, ...]:
    """The dims of a mesh named `names` that split the batch (`BATCH_DIM_NAMES`), in mesh
    order; () when none is so named."""
    names = tuple(names or ())
    for whole in ("dp", "batch"):
        if whole in names:
            return (whole,)
    return tuple(n for n in names if n in BATCH_DIM_NAMES)


def device_mesh(mesh):
    """`mesh` as a DeviceMesh: a DeviceMesh as it is; torchtitan's ``ParallelDims`` as its
    data-loading mesh (``pp``, ``batch``, ``cp``, ``tp``: the dims it enables), or its
    ``world_mesh`` in releases that name the dp dims there; None stays None."""
    if mesh is None or hasattr(mesh, "get_coordinate"):
        return mesh
    if hasattr(mesh, "get_activated_mesh"):  # torchtitan >= 0.3
        return mesh.get_activated_mesh(["pp", "batch", "cp", "tp"])
    world = getattr(mesh, "world_mesh", None)
    if world is not None:
        return world
    raise ValueError(f"mesh: {type(mesh).__name__} is not a DeviceMesh (nor torchtitan's "
                     "ParallelDims)")


def rank_identity(
    mesh=None,
    *,
    dp_dim: str | None = None,
    dp_dims: tuple[str, ...] | None = None,
    dp_rank: int | None = None,
    dp_size: int | None = None,
    stages: tuple[int, ...] = (),
) -> RankIdentity:
    """Read rank and world size from torch.distributed (or torchrun's variables), mesh from `mesh`.

    The batch split, in order: the mesh dims named by `dp_dims` (or `dp_dim`); `dp_rank` /
    `dp_size`; the mesh dims whose names say they split the batch (`BATCH_DIM_NAMES`:
    torchtitan's included); one dp rank for a mesh of tensor or pipeline dims only that spans
    the world; else the whole world (plain data parallelism).
    """
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
    ident = RankIdentity(
        rank=rank,
        world_size=world,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        host=socket.gethostname(),
        stages=tuple(stages),
    )
    mesh = device_mesh(mesh)
    names: tuple[str, ...] = ()
    if mesh is not None:
        ident.mesh_shape = tuple(int(s) for s in mesh.mesh.shape)
        names = ident.mesh_dim_names = tuple(mesh.mesh_dim_names or ())
        coord = mesh.get_coordinate()
        ident.mesh_coordinate = tuple(int(c) for c in coord) if coord is not None else ()
    declared = tuple(dp_dims) if dp_dims else ((dp_dim,) if dp_dim is not None else ())
    if declared and mesh is None and world == 1:
        declared = ()  # one process: the README's snippet, unchanged, on a single-process reference
    if declared:
        field_name = "dp_dims" if dp_dims else "dp_dim"
        if mesh is None:
            raise ValueError(f"{field_name}: needs a device mesh (mesh=...)")
        for d in declared:
            if d not in names:
                raise ValueError(f"{field_name}: {d!r} is not a mesh dim ({list(names)})")
        _split_from_mesh(ident, mesh, declared)
    elif dp_rank is not None or dp_size is not None or mesh is None:
        ident.dp_rank = rank if dp_rank is None else dp_rank
        ident.dp_size = world if dp_size is None else dp_size
    elif found := batch_dims(names):
        _split_from_mesh(ident, mesh, found)
    elif names and set(names) <= OTHER_DIM_NAMES and mesh.mesh.numel() == world:
        _split_from_mesh(ident, mesh, ())  # tensor/pipeline dims only: one dp rank
    else:
        if set(names) <= OTHER_DIM_NAMES:
            log.warning("numaudit: the mesh %s covers %d of %d ranks and names no dim that "
                        "splits the batch; the whole world is taken as data-parallel: pass "
                        "dp_dims= (NUMAUDIT_DP_DIMS) or dp_rank=/dp_size=", list(names),
                        mesh.mesh.numel(), world)
        ident.dp_rank, ident.dp_size = rank, world
    if not 0 <= ident.dp_rank < ident.dp_size:
        raise ValueError(f"dp_rank: {ident.dp_rank} is outside [0, dp_size={ident.dp_size})")
    return ident


def _split_from_mesh(ident: RankIdentity, mesh, dims: tuple[str, ...]) -> None:
    """Set the dp rank and size, dims and groups from mesh dims `dims` (() = one dp rank):
    the dp rank is this rank's coordinate over them, row-major in mesh order."""
    names = list(mesh.mesh_dim_names or ())
    coord = mesh.get_coordinate()
    axes = sorted(names.index(d) for d in dims)
    ident.dp_dim_names = tuple(names[a] for a in axes)
    ident.dp_rank, ident.dp_size = 0, 1
    for a in axes:
        ident.dp_rank = ident.dp_rank * mesh.size(a) + (int(coord[a]) if coord is not None else 0)
        ident.dp_size *= mesh.size(a)
    if coord is None:  # not in the mesh: no groups to read
        return
    ranks = mesh.mesh
    at_dp = tuple(slice(None) if a in axes else int(c) for a, c in enumerate(coord))
    at_peers = tuple(int(c) if a in axes else slice(None) for a, c in enumerate(coord))
    ident.dp_group = tuple(int(r) for r in ranks[at_dp].flatten().tolist())
    ident.peers = tuple(int(r) for r in ranks[at_peers].flatten().tolist())


def _mesh_ranks(mesh) -> set[int]:
    """The global ranks of a DeviceMesh."""
    return {int(r) for r in mesh.mesh.flatten().tolist()}


def job_identity(declared: str | None = None) -> tuple[str, str]:
    """The job id all ranks of this job share, and where it came from.

    In order: a declared id (job_id= or NUMAUDIT_JOB_ID); torchrun's TORCHELASTIC_RUN_ID unless
    it is torchrun's default "none" (static rendezvous: every job would share it); one generated
    id agreed through the job's c10d store (needs torch.distributed initialized before attach: the
    first rank to ask sets it, the others read it, nobody waits); a generated id for a job of one
    process (one per process). A multi-process job with none of these gets "" and a warning: its
    sessions cannot be told from another job's, so pass job_id= (docs/agent.md).
    """
    if declared:
        return declared, "declared"
    run_id = os.environ.get(ENV_TORCHELASTIC_RUN_ID, "").strip()
    if run_id and run_id != "none":
        return run_id, "torchrun"
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            store = _get_default_store()
            agreed = store.compare_set(JOB_ID_STORE_KEY, "", uuid.uuid4().hex)
            return agreed.decode() if isinstance(agreed, bytes) else str(agreed), "c10d store"
        except Exception as exc:  # a store without compare_set: say so, do not guess
            log.warning("numaudit: could not agree on a job id through the c10d store (%r); "
                        "pass job_id= or NUMAUDIT_JOB_ID", exc)
            return "", ""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return _PROCESS_JOB_ID, "generated"
    log.warning("numaudit: no job id (no NUMAUDIT_JOB_ID, no torchrun run id, torch.distributed "
                "not initialized before attach): sessions of this job cannot be told from "
                "another job's under the same run name")
    return "", ""
