"""Plain tensor-parallel outputs: which are replicas and which are each rank's block.

A tensor-parallel style states its module's output layout (torch.distributed.tensor.parallel);
the agent reads it (`output_sharding`), and follows a block of tokens through the modules no
style declares, such as a sequence-parallel transformer block (`Capturer._follow_shards`).
Each rank of a fake 4-rank world (no communication: values are meaningless, layouts are real).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from numaudit.agents.capture.capture import Capturer, Counters
from numaudit.agents.capture.sharding import output_sharding
from numaudit.agents.config import AgentConfig
from numaudit.agents.identity import rank_identity
from numaudit.agents.layout import PieceLayout, dim_shard_layout

B, S, D, H, V = 2, 8, 4, 8, 12
TP = 4


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(D)
        self.w1 = torch.nn.Linear(D, H)
        self.act = torch.nn.GELU()
        self.w2 = torch.nn.Linear(H, D)

    def forward(self, x):
        return x + self.w2(self.act(self.w1(self.norm(x))))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = torch.nn.Embedding(V, D)
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.norm = torch.nn.LayerNorm(D)
        self.out = torch.nn.Linear(D, V)
        self.pool = torch.nn.Identity()  # applied to a mean over tokens: not a block of them

    def forward(self, x):
        h = self.tok(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(self.norm(h)), self.pool(h.mean(1))


def _sequence_parallel(model: Model, mesh) -> None:
    plan = {"tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    for i in range(len(model.layers)):
        plan[f"layers.{i}.norm"] = SequenceParallel()
        plan[f"layers.{i}.w1"] = ColwiseParallel(input_layouts=Shard(1))
        plan[f"layers.{i}.w2"] = RowwiseParallel(output_layouts=Shard(1))
    parallelize_module(model, mesh, plan)


@pytest.mark.parametrize("rank", [0, 2])
def test_each_style_states_its_output_layout(fake_rank, rank):
    fake_rank(rank)
    mesh = init_device_mesh("cpu", (1, TP), mesh_dim_names=("dp", "tp"))
    ident = rank_identity(mesh, dp_dim="dp")

    def styled(module, style):
        return output_sharding(parallelize_module(module, mesh["tp"], style), ident)

    lin, emb = (lambda: torch.nn.Linear(D, H)), (lambda: torch.nn.Embedding(V, D))
    assert styled(lin(), ColwiseParallel()) == (True, (-1, TP, rank))  # column blocks
    assert styled(emb(), ColwiseParallel()) == (True, (-1, TP, rank))
    assert styled(lin(), ColwiseParallel(output_layouts=Replicate())) == (True, None)
    assert styled(lin(), ColwiseParallel(use_local_output=False)) == (True, None)  # a DTensor
    assert styled(lin(), RowwiseParallel()) == (True, None)  # all-reduced: a replica
    assert styled(lin(), RowwiseParallel(output_layouts=Shard(1))) == (True, (1, TP, rank))
    assert styled(emb(), RowwiseParallel(input_layouts=Replicate(),
                                         output_layouts=Shard(1))) == (True, (1, TP, rank))
    assert styled(torch.nn.GELU(), PrepareModuleOutput(
        output_layouts=Replicate(), desired_output_layouts=Shard(1))) == (True, (1, TP, rank))
    # SequenceParallel outputs DTensors; a module without a style states nothing
    assert styled(torch.nn.LayerNorm(D), SequenceParallel()) == (False, None)
    assert output_sharding(torch.nn.Linear(D, H), ident) == (False, None)


def _captured_layouts(rank: int, **config) -> dict[tuple[str, str], PieceLayout]:
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    # DTensor caches sharding propagation by specs that compare equal across ranks: another
    # rank in this process would get the previous rank's mesh back
    _clear_sharding_prop_cache()
    mesh = init_device_mesh("cpu", (1, TP), mesh_dim_names=("dp", "tp"))
    model = Model()
    _sequence_parallel(model, mesh["tp"])
    batches = []
    cap = Capturer(AgentConfig(phases=("fwd", "bwd"), **config), rank_identity(mesh, dp_dim="dp"),
                   batches.append, Counters())
    cap.hook_modules(model)
    cap.start_step(0)
    tokens = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(rank))
    logits, pooled = model(tokens)
    (logits.float().sum() + pooled.sum()).backward()
    cap.flush()
    return {(c.phase, c.site): c.layout for b in batches for c in b.captures}


@pytest.mark.parametrize("rank", [0, 3])
def test_tokens_are_followed_through_blocks_no_style_declares(fake_rank, rank):
    """The embedding's and every block's output hold this rank's S/TP tokens: pieces of the
    logical (B, S, D) activation at token offset rank * S/TP, not replicas; so are the modules
    inside a block that keep the tokens (an activation between w1 and w2 keeps w1's columns),
    and their gradients. What gathers the tokens or reduces them away is not a block."""
    from numaudit.wire.vocabulary import PHASE_IDS

    fake_rank(rank)
    lays = _captured_layouts(rank)
    fwd, bwd = PHASE_IDS["fwd"], PHASE_IDS["bwd"]
    tokens = PieceLayout((B, S, D), (0, rank * S // TP, 0), (B, S // TP, D))
    for site in ("tok", "layers.0", "layers.1", "layers.0.w2", "layers.1.w2"):
        for phase in (fwd, bwd):
            assert lays[(phase, site)] == tokens, (phase, site)
    columns = PieceLayout((B, S, H), (0, 0, rank * H // TP), (B, S, H // TP))
    for site in ("layers.0.w1", "layers.0.act"):
        assert lays[(fwd, site)] == columns, site
    # SequenceParallel norms output DTensors: the same block, from the DTensor's own layout
    assert lays[(fwd, "layers.1.norm")] == tokens
    # the head gathers the tokens and replicates its output; the pool sees a mean over them
    assert lays[(fwd, "out")].replica and lays[(fwd, "out")].logical_shape == (B, S, V)
    assert lays[(fwd, "pool")].replica and lays[(fwd, "pool")].logical_shape == (B, D)


def test_dim_shard_layout_places_a_block_of_any_dim_but_the_batch_dim():
    piece = PieceLayout((6, 5, 4), (2, 0, 0), (2, 5, 4))  # a dp rank's rows
    assert dim_shard_layout(piece, 1, 5, 3) == PieceLayout((6, 25, 4), (2, 15, 0), (2, 5, 4))
    assert dim_shard_layout(piece, -1, 2, 1) == PieceLayout((6, 5, 8), (2, 0, 4), (2, 5, 4))
    assert dim_shard_layout(piece, 0, 2, 1) == piece  # dim 0 is the data-parallel split's
    assert dim_shard_layout(piece, 3, 2, 1) == piece  # a dim it does not have
    assert dim_shard_layout(piece, 1, 1, 0) == piece  # one shard: the whole dim


def test_replicate_sites_overrides_a_followed_block(fake_rank):
    fake_rank(1)
    lays = _captured_layouts(1, replicate_sites=("fwd:layers.1",))
    from numaudit.wire.vocabulary import PHASE_IDS

    assert lays[(PHASE_IDS["fwd"], "layers.1")].replica  # as declared
    assert lays[(PHASE_IDS["fwd"], "layers.1")].logical_shape == (B, S // TP, D)
    assert not lays[(PHASE_IDS["bwd"], "layers.1")].replica  # the glob names fwd only
    assert not lays[(PHASE_IDS["fwd"], "layers.0")].replica


def test_dtensors_on_part_of_the_mesh_are_placed_in_the_whole(fake_rank):
    """On a dp=2 x tp=2 mesh: a DTensor on the tp mesh only (a SequenceParallel norm's
    output beside FSDP2) holds this dp rank's rows; a per-step DTensor on the tp mesh is a
    replica over dp, and one on the dp mesh only (an FSDP2 parameter no tensor-parallel plan
    covers) a replica over tp; a DTensor on both dims is placed by them."""
    from torch.distributed.tensor import DTensor

    from numaudit.wire.vocabulary import PHASE_IDS

    rank = 3
    fake_rank(rank)
    dp, tp = divmod(rank, 2)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    batches = []
    cap = Capturer(AgentConfig(phases=("fwd", "grad")), rank_identity(mesh, dp_dim="dp"),
                   batches.append, Counters())
    act = DTensor.from_local(torch.randn(B, S // 2, D), mesh["tp"], [Shard(1)], run_check=False)
    grad_tp = DTensor.from_local(torch.randn(D, 3), mesh["tp"], [Shard(1)], run_check=False)
    grad_dp = DTensor.from_local(torch.randn(2, D), mesh["dp"], [Shard(0)], run_check=False)
    both = DTensor.from_local(torch.randn(2, 3), mesh, [Shard(0), Shard(1)], run_check=False)
    cap.capture(act, phase="fwd", site="norm")
    for site, t in (("tp", grad_tp), ("dp", grad_dp), ("both", both)):
        cap.capture(t, phase="grad", site=site)
    cap.flush()
    lays = {(c.phase, c.site): c.layout for b in batches for c in b.captures}
    fwd, grad = PHASE_IDS["fwd"], PHASE_IDS["grad"]
    assert not cap.counters.errors
    assert lays[(fwd, "norm")] == PieceLayout((2 * B, S, D), (dp * B, tp * S // 2, 0),
                                              (B, S // 2, D))
    assert lays[(grad, "tp")] == PieceLayout((D, 6), (0, 3 * tp), (D, 3), replica=True)
    assert lays[(grad, "dp")] == PieceLayout((4, D), (2 * dp, 0), (2, D), replica=True)
    assert lays[(grad, "both")] == PieceLayout((4, 6), (2 * dp, 3 * tp), (2, 3))


def test_a_whole_view_of_a_block_is_the_block():
    """FSDP2's pre-forward hands its module views of the arguments: a whole view of a marked
    block, or of the tensor a marked whole view was made from, is the same block; a slice of
    it is not."""
    from numaudit.agents.capture.sharding import mark_of, set_mark

    x = torch.randn(B, S, D)
    set_mark(x, (1, TP, 2))
    assert mark_of(x.view_as(x)) == (1, TP, 2)
    base = torch.randn(B, S, D)
    set_mark(base.view_as(base), (1, TP, 1))  # marks its base too
    assert mark_of(base.view_as(base)) == (1, TP, 1)
    assert mark_of(x[:, :2]) is None and mark_of(base[:, 4:]) is None
    assert mark_of(torch.randn(B, S, D)) is None


def test_a_loss_from_dtensor_logits_is_a_reduction_over_its_addends(fake_rank):
    """A loss computed from DTensor logits is a DTensor: loss_parallel's cross entropy is
    Replicate (the value, one addend per dp rank), a mean of column-sharded logits is
    Partial(avg) (one addend per dp x tp rank, averaged). Either way the auditor rebuilds the
    global-batch loss from the addends, as for a plain per-rank loss."""
    from torch.distributed.tensor import DTensor, Partial

    rank = 3
    fake_rank(rank)
    dp, tp = divmod(rank, 2)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    batches = []
    cap = Capturer(AgentConfig(phases=("loss",), microbatch_size=4),
                   rank_identity(mesh, dp_dim="dp"), batches.append, Counters())
    value = torch.tensor(1.5)
    cases = {
        "replicate": DTensor.from_local(value, mesh["tp"], [Replicate()], run_check=False),
        "avg": DTensor.from_local(value, mesh["tp"], [Partial("avg")], run_check=False),
        "avg_2d": DTensor.from_local(value, mesh, [Partial("avg"), Partial("avg")],
                                     run_check=False),
        "sum": DTensor.from_local(value, mesh["tp"], [Partial("sum")], run_check=False),
    }
    for site, t in cases.items():
        cap.capture(t, phase="loss", site=site)
    cap.flush()
    lays = {c.site: c.layout for b in batches for c in b.captures}
    assert not cap.counters.errors
    for site, (index, count) in {"replicate": (dp, 2), "avg": (2 * dp + tp, 4),
                                 "avg_2d": (2 * dp + tp, 4)}.items():
        lay = lays[site]
        assert (lay.reduce, lay.reduce_index, lay.reduce_count) == ("mean", index, count), site
        assert lay.reduce_weight == 4.0 and lay.logical_shape == () and lay.replica, site
    # a Partial sum averaged over dp is no weighted mean of its addends: its own layout
    assert lays["sum"].partial and not lays["sum"].reduce


def test_a_partial_avg_activation_is_an_addend_of_a_sum_over_its_count(fake_rank):
    """A DTensor activation left Partial("avg") (a mean over a sharded dim) is the mean of its
    addends: each rank's record is its local tensor over the partial ranks, as a Partial sum's
    addend, so the auditor's sum of addends rebuilds the value (not that value times tp).
    Partial("sum") keeps its local tensor; the fast path must not take either's bytes as is."""
    from torch.distributed.tensor import DTensor, Partial

    fake_rank(1)
    mesh = init_device_mesh("cpu", (1, TP), mesh_dim_names=("dp", "tp"))
    batches = []
    cap = Capturer(AgentConfig(phases=("fwd",)), rank_identity(mesh, dp_dim="dp"),
                   batches.append, Counters())
    local = torch.arange(12.0).reshape(B, 6)
    for op in ("avg", "sum"):
        cap.capture(DTensor.from_local(local, mesh["tp"], [Partial(op)], run_check=False),
                    phase="fwd", site=op, role="output")
    cap.flush()
    assert not cap.counters.errors
    rows = {c.site: (c, b) for b in batches for c in b.captures}
    for op, want in (("avg", local / TP), ("sum", local)):
        c, b = rows[op]
        assert c.layout.partial and c.layout.logical_shape == (B, 6), op
        moments = b.f64[c.row, :2].tolist()
        assert moments == pytest.approx([want.sum().item(), want.square().sum().item()]), op


def test_a_block_is_not_inferred_from_a_shape_that_only_looks_alike(fake_rank):
    """Plain TP with an FFN of 4 x D over tp=4: w1's column block is (B, S, D), the shape of
    the block's output too, but the block's last submodule (w2, all-reduced) outputs a
    replica, so the block's output is one; a block of w1's columns is not carried over."""
    from numaudit.wire.vocabulary import PHASE_IDS

    fake_rank(2)
    mesh = init_device_mesh("cpu", (1, TP), mesh_dim_names=("dp", "tp"))

    class Wide(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = torch.nn.Linear(D, TP * D)
            self.w2 = torch.nn.Linear(TP * D, D)

        def forward(self, x):
            return x + self.w2(torch.relu(self.w1(x)))

    model = torch.nn.Sequential(Wide(), Wide())
    parallelize_module(model, mesh["tp"], {f"{i}.{w}": style for i in range(2) for w, style in
                                           (("w1", ColwiseParallel()), ("w2", RowwiseParallel()))})
    batches = []
    cap = Capturer(AgentConfig(phases=("fwd",)), rank_identity(mesh, dp_dim="dp"),
                   batches.append, Counters())
    cap.hook_modules(model)
    cap.start_step(0)
    model(torch.randn(B, S, D))
    cap.flush()
    lays = {c.site: c.layout for b in batches for c in b.captures if c.phase == PHASE_IDS["fwd"]}
    assert lays["0.w1"].shape == (B, S, D) and not lays["0.w1"].replica  # a column block
    for site in ("0", "1", "0.w2"):
        assert lays[site].replica and lays[site].logical_shape == (B, S, D), site


def test_a_submodule_whose_input_a_style_gathers_outputs_the_tokens_of_its_last_child(fake_rank):
    """torchtitan's plan gathers an attention or feed-forward module's input
    (PrepareModuleInput: Shard(1) -> Replicate), so the module's hook sees no marked input;
    its last child (the Rowwise w2 with output_layouts=Shard(1)) outputs the tokens, and so
    does the module."""
    from torch.distributed.tensor.parallel import PrepareModuleInput

    from numaudit.wire.vocabulary import PHASE_IDS

    rank = 1
    fake_rank(rank)
    mesh = init_device_mesh("cpu", (1, TP), mesh_dim_names=("dp", "tp"))

    class FeedForward(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = torch.nn.Linear(D, H)
            self.w2 = torch.nn.Linear(H, D)

        def forward(self, x):
            return self.w2(torch.relu(self.w1(x)))

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(D)
            self.ff = FeedForward()

        def forward(self, x):
            return x + self.ff(self.norm(x))

    model = torch.nn.Sequential(torch.nn.Identity(), Layer())
    parallelize_module(model, mesh["tp"], {
        "1.norm": SequenceParallel(),
        "1.ff": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "1.ff.w1": ColwiseParallel(),
        "1.ff.w2": RowwiseParallel(output_layouts=Shard(1))})
    batches = []
    cap = Capturer(AgentConfig(phases=("fwd",)), rank_identity(mesh, dp_dim="dp"),
                   batches.append, Counters())
    cap.hook_modules(model)
    cap.start_step(0)
    model(torch.randn(B, S // TP, D))  # this rank's tokens, as the previous stage sends them
    cap.flush()
    lays = {c.site: c.layout for b in batches for c in b.captures if c.phase == PHASE_IDS["fwd"]}
    tokens = PieceLayout((B, S, D), (0, rank * S // TP, 0), (B, S // TP, D))
    assert lays["1.ff.w2"] == tokens and lays["1.ff"] == tokens and lays["1"] == tokens
