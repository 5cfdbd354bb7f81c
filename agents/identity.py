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
    dp_dim_name: str = ""
    """The mesh dim that splits the batch ("" = none named)."""
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


def rank_identity(
    mesh=None,
    *,
    dp_dim: str | None = None,
    dp_rank: int | None = None,
    dp_size: int | None = None,
    stages: tuple[int, ...] = (),
) -> RankIdentity:
    """Read rank and world size from torch.distributed (or torchrun's variables), mesh from `mesh`.

    The batch split defaults to the whole world (plain data parallelism); name a mesh dim with
    `dp_dim` or give `dp_rank`/`dp_size` when other dims (pipeline, tensor) do not split the batch.
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
    if mesh is not None:
        ident.mesh_shape = tuple(int(s) for s in mesh.mesh.shape)
        ident.mesh_dim_names = tuple(mesh.mesh_dim_names or ())
        coord = mesh.get_coordinate()
        ident.mesh_coordinate = tuple(int(c) for c in coord) if coord is not None else ()
    if dp_dim is not None and mesh is None and world == 1:
        dp_dim = None  # one process: the README's snippet, unchanged, on a single-process reference
    if dp_dim is not None:
        if mesh is None:
            raise ValueError("dp_dim: needs a device mesh (mesh=...)")
        names = list(mesh.mesh_dim_names or ())
        if dp_dim not in names:
            raise ValueError(f"dp_dim: {dp_dim!r} is not a mesh dim ({names})")
        ident.dp_rank = mesh.get_local_rank(dp_dim)
        ident.dp_size = mesh.size(names.index(dp_dim))
        ident.dp_dim_name = dp_dim
    else:
        ident.dp_rank = rank if dp_rank is None else dp_rank
        ident.dp_size = world if dp_size is None else dp_size
    if not 0 <= ident.dp_rank < ident.dp_size:
        raise ValueError(f"dp_rank: {ident.dp_rank} is outside [0, dp_size={ident.dp_size})")
    return ident


def job_identity(declared: str | None = None) -> tuple[str, str]:
    """The job id all ranks of this job share, and where it came from.

    In order: a declared id (job_id= or NUMAUDIT_JOB_ID); torchrun's TORCHELASTIC_RUN_ID unless
    it is torchrun's default "none" (static rendezvous: every job would share it); one generated
    id agreed through the job's c10d store (needs torch.distributed initialized before attach: the
    first rank to ask sets it, the others read it, nobody waits); a generated id for a job of one
    process (one per process). A multi-process job with none of these gets "" and a warning: its sessions cannot
    be told from another job's, so pass job_id= (docs/agent.md).
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
