"""What the agent needs to know about real frameworks' models without being told (issue 37):

- the batch split from the mesh's own dim names (torchtitan's ``batch``, ``dp_replicate`` x
  ``dp_shard``, ``fsdp``), a mesh of tensor/pipeline dims only (one dp rank), or ``dp_dims``;
- a default depth that sees inside every repeated block wherever it sits (transformers'
  ``model.layers.N.self_attn``);
- outputs that do not hold the batch (transformers' rotary cos/sin, ``[1, seq, dim]``) recorded
  as replicas, their gradients as sums over the dp ranks.

Each rank of a fake 4-rank world (no communication: values are meaningless, layouts are real).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import numaudit
from numaudit.agents.capture.capture import Capturer, Counters
from numaudit.agents.capture.sites import block_sites, select_modules
from numaudit.agents.config import AgentConfig, apply_env, check
from numaudit.agents.identity import rank_identity
from numaudit.agents.layout import PieceLayout, batch_rows, holds_batch
from numaudit.wire.vocabulary import PHASE_IDS

B, S, D = 4, 8, 16


# -- the batch split -------------------------------------------------------------------------------

@pytest.mark.parametrize("rank", [0, 3])
def test_torchtitan_data_loading_mesh_gives_the_split(fake_rank, rank):
    """torchtitan's data-loading mesh (pp, batch, cp, tp): `batch` splits the samples, the tp
    ranks of one batch rank hold the same share; no dp_dim declared."""
    fake_rank(rank)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("batch", "tp"))
    ident = rank_identity(mesh)
    assert (ident.dp_rank, ident.dp_size, ident.dp_dim_names) == (rank // 2, 2, ("batch",))
    assert ident.dp_group == (rank % 2, rank % 2 + 2) and ident.ranks_per_dp_rank == 2
    # torchtitan shards parameters over a mesh it calls `fsdp`: the same ranks, so it is the
    # dp split (a parameter there is not "beside dp"); its `tp` mesh lies beside it
    fsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    assert ident.spans_dp(fsdp["fsdp"]) and not ident.spans_dp(fsdp["tp"])
    assert ident.lacks_peers(fsdp["fsdp"]) and not ident.lacks_peers(fsdp)
    assert ident.is_dp_mesh(fsdp["fsdp"]) and not ident.is_dp_mesh(mesh["tp"])


def test_hsdp_dims_together_and_declared_dims(fake_rank):
    fake_rank(3)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    ident = rank_identity(mesh)
    assert (ident.dp_rank, ident.dp_size) == (3, 4) and ident.dp_dim_name == "dp_replicate+dp_shard"
    odd = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "model"))
    ident = rank_identity(odd, dp_dims=("replica",))
    assert (ident.dp_rank, ident.dp_size, ident.ranks_per_dp_rank) == (1, 2, 2)
    with pytest.raises(ValueError, match="dp_dims: 'data' is not a mesh dim"):
        rank_identity(odd, dp_dims=("data",))


def test_a_tensor_parallel_mesh_spanning_the_world_has_one_dp_rank(fake_rank):
    """Before, the agent took the whole world as data-parallel unless told dp_rank=0,
    dp_size=1; a mesh whose names say nothing keeps that default (the README's)."""
    fake_rank(2)
    ident = rank_identity(init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)))
    assert (ident.dp_rank, ident.dp_size, ident.ranks_per_dp_rank) == (0, 1, 4)
    ident = rank_identity(init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp")))
    assert (ident.dp_rank, ident.dp_size) == (0, 1)
    ident = rank_identity(init_device_mesh("cpu", (4,), mesh_dim_names=("world",)))
    assert (ident.dp_rank, ident.dp_size) == (2, 4)


def test_dp_dims_from_the_environment(fake_rank, monkeypatch):
    fake_rank(1)
    monkeypatch.setenv("NUMAUDIT_DP_DIMS", "rep,shard")
    cfg = apply_env(AgentConfig())
    check(cfg)
    assert cfg.dp_dims == ("rep", "shard")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    agent = numaudit.attach(None, mesh=mesh, dp_dim="dp")  # the environment wins
    assert (agent.ident.dp_rank, agent.ident.dp_size) == (1, 4)
    with pytest.raises(ValueError, match="dp_dims"):
        check(AgentConfig(dp_dims="dp"))


def test_torchtitan_parallel_dims_is_a_mesh(fake_rank):
    """attach(mesh=parallel_dims): torchtitan's ParallelDims, read as its data-loading mesh."""
    pd_module = pytest.importorskip("torchtitan.distributed.parallel_dims")
    fake_rank(1)
    pd_module.device_type = "cpu"
    dims = pd_module.ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=2, pp=1, ep=1,
                                  world_size=4, spmd_backend="partial_dtensor")
    dims.build_mesh()
    ident = rank_identity(dims)
    assert (ident.mesh_dim_names, ident.dp_rank, ident.dp_size) == (("batch", "tp"), 0, 2)


# -- depth -----------------------------------------------------------------------------------------

class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = torch.nn.Sequential(torch.nn.Linear(D, D))
        self.norm = torch.nn.LayerNorm(D)

    def forward(self, x):
        return x + self.self_attn(self.norm(x))


class _Inner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, D)
        self.layers = torch.nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return h


class _Rotary(torch.nn.Module):
    def forward(self, x, position_ids):
        return torch.sin(position_ids[..., None].float() * torch.ones(D))  # [1, S, D]


class _CausalLM(torch.nn.Module):
    """The shape of a transformers model: blocks at model.layers.N, a rotary module whose
    output does not hold the batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = _Inner()
        self.rotary = _Rotary()
        self.head = torch.nn.Linear(D, 32)

    def forward(self, input_ids):
        h = self.model(input_ids)
        pos = torch.arange(input_ids.shape[1])[None]
        return self.head(h + self.rotary(h, pos))


def test_default_depth_sees_inside_blocks_wherever_they_sit():
    sites = [s for s, _ in select_modules(_CausalLM(), ["*"], [], 3, 1)]
    assert "model.layers.0.self_attn" in sites and "model.layers.1.norm" in sites
    assert "model.layers.0.self_attn.0" not in sites  # two levels in: block_depth=2
    assert "model.layers.0.self_attn.0" in [s for s, _ in select_modules(_CausalLM(), ["*"],
                                                                         [], 3, 2)]
    assert [s for s, _ in select_modules(_CausalLM(), ["*"], [], 3, 0)] == [
        "model", "model.embed", "model.layers", "model.layers.0", "model.layers.1", "rotary",
        "head"]
    assert block_sites(_CausalLM()) == {"model.layers.0", "model.layers.1"}
    assert AgentConfig().block_depth == 1


# -- outputs that do not hold the batch ------------------------------------------------------------

def test_holds_batch_and_batch_rows():
    hidden = [(4, S, D), (1, S)]  # a rotary module's inputs: hidden states and position ids
    assert not holds_batch((1, S, D), 0, 4, hidden) and holds_batch((4, S, D), 0, 4, hidden)
    assert holds_batch((1, S, D), 0, 1, [(1, S, D)])  # one sample per rank: cannot tell
    assert holds_batch((1, S, D), 0, None, hidden)
    assert holds_batch((1, D), 0, 4, [(1, D)])  # an expert routed one token: one row in, out
    assert holds_batch((1, S, D), 0, 4, [(1, S)])  # from position ids alone: cannot tell
    assert holds_batch((), 0, 4, hidden) and not holds_batch((S, 1, D), 1, 4, [(S, 4, D)])
    ids, pos = torch.zeros(4, S), torch.zeros(1, S)
    assert batch_rows((ids,), {}, 0) == 4
    assert batch_rows((), {"position_ids": pos, "input_ids": ids}, 0) == 4
    assert batch_rows((), {"flag": True}, 0) is None


@pytest.mark.parametrize("rows", [B, 1])
def test_rotary_output_is_a_replica_and_its_gradient_a_sum_over_dp(fake_rank, rows):
    """dp=4 with `rows` samples per rank: [1, S, D] rotary output is a replica of one box
    (not a share of [4, S, D]) and its gradient each dp rank's addend of a sum; with one sample
    per rank the agent cannot tell, records a share, and the auditor decides by fingerprints
    (tests/auditor/compare/merge/test_replicas.py)."""
    fake_rank(1)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    batches = []
    cap = Capturer(AgentConfig(phases=("fwd", "bwd")), rank_identity(mesh, dp_dim="dp"),
                   batches.append, Counters())
    model = _CausalLM()
    model.rotary.register_forward_hook(lambda m, i, o: o.requires_grad_())  # a learned one
    cap.hook_modules(model)
    cap.start_step(0)
    model(torch.randint(0, 32, (rows, S))).sum().backward()
    cap.flush()
    lays = {(c.phase, c.site): c.layout for b in batches for c in b.captures}
    fwd, bwd = lays[(PHASE_IDS["fwd"], "rotary")], lays[(PHASE_IDS["bwd"], "rotary")]
    assert not cap.counters.errors
    if rows > 1:
        assert fwd == PieceLayout((1, S, D), (0, 0, 0), (1, S, D), replica=True)
        assert (bwd.reduce, bwd.reduce_index, bwd.reduce_count) == ("sum", 1, 4)
        assert lays[(PHASE_IDS["fwd"], "model.embed")] == PieceLayout(
            (4 * B, S, D), (B, 0, 0), (B, S, D))
    else:
        assert fwd == PieceLayout((4, S, D), (1, 0, 0), (1, S, D))
    # a microbatch of more samples shows the rotary output does not hold the batch; from then
    # on it is a replica in a microbatch of one sample per rank too
    for mb, n in ((1, B), (2, 1)):
        cap.microbatch = mb
        model(torch.randint(0, 32, (n, S))).sum().backward()
    cap.flush()
    lays = {(c.microbatch, c.phase, c.site): c.layout for b in batches for c in b.captures}
    assert lays[(1, PHASE_IDS["fwd"], "rotary")].replica
    assert lays[(2, PHASE_IDS["fwd"], "rotary")] == PieceLayout((1, S, D), (0, 0, 0), (1, S, D),
                                                                replica=True)


class _Routed(torch.nn.Module):
    """Top-1 routing to two experts: an expert sees only the tokens routed to it."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList([torch.nn.Linear(D, D), torch.nn.Linear(D, D)])

    def forward(self, x):
        flat = x.reshape(-1, D)
        return torch.cat([self.experts[0](flat[:1]), self.experts[1](flat[1:])]).reshape(x.shape)


def test_an_expert_routed_one_token_holds_a_share(fake_rank):
    """An expert that gets one token while the microbatch holds 4 samples a rank: its output
    is [1, D] from an input of one row, a share of the expert's tokens, not a replica."""
    fake_rank(1)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    batches = []
    cap = Capturer(AgentConfig(phases=("fwd",)), rank_identity(mesh), batches.append, Counters())
    model = _Routed()
    cap.hook_modules(model)
    cap.start_step(0)
    model(torch.randn(B, S, D))
    cap.flush()
    lays = {c.site: c.layout for b in batches for c in b.captures}
    assert lays["experts.0"] == PieceLayout((4, D), (1, 0), (1, D))
