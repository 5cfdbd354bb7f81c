"""Who this rank is: torchrun's environment plus, where given, a DeviceMesh."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

import torch


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
    stages: tuple[int, ...] = ()
    """Pipeline stage indices held by this rank; empty when not pipelined."""
    torch_version: str = field(default_factory=lambda: torch.__version__)
    dtype: str = ""
    """Training dtype as the user declares it, e.g. "float32"."""
    seed: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    """Free-form run labels (git commit, config name)."""


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
    if dp_dim is not None:
        if mesh is None:
            raise ValueError("dp_dim: needs a device mesh (mesh=...)")
        names = list(mesh.mesh_dim_names or ())
        if dp_dim not in names:
            raise ValueError(f"dp_dim: {dp_dim!r} is not a mesh dim ({names})")
        ident.dp_rank = mesh.get_local_rank(dp_dim)
        ident.dp_size = mesh.size(names.index(dp_dim))
    else:
        ident.dp_rank = rank if dp_rank is None else dp_rank
        ident.dp_size = world if dp_size is None else dp_size
    if not 0 <= ident.dp_rank < ident.dp_size:
        raise ValueError(f"dp_rank: {ident.dp_rank} is outside [0, dp_size={ident.dp_size})")
    return ident
