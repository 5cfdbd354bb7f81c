"""The DS3-style example model and data: single process, no torchrun."""

from __future__ import annotations

import pytest
import torch

from examples.dsv3.data import batches, local_batch
from examples.dsv3.model import (
    ModelArgs,
    Transformer,
    loss_fn,
    prune_to_stage,
    stage_layer_ids,
)

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_STAGES = 4
SEQ = 16


def _model(seed: int = 0, args: ModelArgs | None = None) -> Transformer:
    model = Transformer(args or ModelArgs())
    model.init_weights(seed)
    return model


def _tokens(seed: int = 0, batch: int = 2, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    mb = next(batches(seed, 0, 1, batch, seq, ModelArgs().vocab_size))[0]
    return mb


def test_forward_backward_gives_logits_and_every_grad():
    model = _model()
    tokens, targets = _tokens()
    logits = model(tokens)
    assert logits.shape == (2, SEQ, model.args.vocab_size)
    loss = loss_fn(logits, targets)
    assert torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_expert_bias_is_a_buffer_and_experts_are_stacked():
    model = _model()
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    assert "layers.0.moe.router.expert_bias" in buffers
    assert not any("expert_bias" in n for n in params)
    args = model.args
    experts, hidden = args.n_routed_experts, args.moe_inter_dim
    assert params["layers.2.moe.experts.w1"].shape == (experts, hidden, args.dim)
    assert params["layers.2.moe.experts.w2"].shape == (experts, args.dim, hidden)
    assert "layers.2.moe.shared_experts.w3.weight" in params
    assert "layers.2.moe.router.gate.weight" in params


def test_init_is_deterministic_from_the_seed():
    a, b, c = _model(seed=3), _model(seed=3), _model(seed=4)
    state_a, state_b, state_c = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    wq = "layers.0.attention.wq.weight"
    assert not torch.equal(state_a[wq], state_c[wq])


def test_stage_init_matches_full_model_init():
    full = dict(_model(seed=5).named_parameters())
    stage = Transformer(ModelArgs())
    prune_to_stage(stage, 2, NUM_STAGES)
    stage.init_weights(5)
    for name, param in stage.named_parameters():
        assert torch.equal(param, full[name]), name


def test_stage_split_keeps_fqns_and_partitions_the_model():
    full_names = {n for n, _ in _model().named_parameters()}
    seen: list[str] = []
    for s in range(NUM_STAGES):
        stage = prune_to_stage(_model(), s, NUM_STAGES)
        names = [n for n, _ in stage.named_parameters()]
        assert set(names) <= full_names
        assert all(n.startswith(f"layers.{s}.") or not n.startswith("layers.") for n in names)
        assert (stage.tok_embeddings is not None) == (s == 0)
        assert (stage.output is not None) == (s == NUM_STAGES - 1)
        seen += names
    assert sorted(seen) == sorted(full_names)  # every parameter in exactly one stage
    stage_2 = prune_to_stage(_model(), 2, NUM_STAGES)
    assert "layers.2.moe.experts.w1" in {n for n, _ in stage_2.named_parameters()}


def test_stages_in_sequence_are_bitwise_the_full_model():
    tokens, targets = _tokens(seed=1)
    full = _model(seed=7)
    full_logits = full(tokens)
    loss_fn(full_logits, targets).backward()

    stages = [prune_to_stage(_model(seed=7), s, NUM_STAGES) for s in range(NUM_STAGES)]
    h = tokens
    for stage in stages:
        h = stage(h)
    assert torch.equal(h, full_logits)
    loss_fn(h, targets).backward()
    full_grads = {n: p.grad for n, p in full.named_parameters()}
    for stage in stages:
        for name, param in stage.named_parameters():
            assert torch.equal(param.grad, full_grads[name]), name


@pytest.mark.parametrize(("n_layers", "n_stages", "expected"), [
    (4, 4, [[0], [1], [2], [3]]),
    (6, 4, [[0, 1], [2, 3], [4], [5]]),
    (8, 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
])
def test_stage_layer_ids(n_layers, n_stages, expected):
    assert [stage_layer_ids(n_layers, s, n_stages) for s in range(n_stages)] == expected


def test_stage_layer_ids_rejects_more_stages_than_layers():
    with pytest.raises(ValueError):
        stage_layer_ids(2, 0, 4)


def test_scaled_args_widen_the_model():
    args = ModelArgs().scaled(2)
    assert args.dim == 128 and args.n_layers == ModelArgs().n_layers
    model = _model(args=args)
    tokens, _ = _tokens()
    assert model(tokens).shape == (2, SEQ, args.vocab_size)


def test_data_is_deterministic_per_dp_rank():
    def step0(dp_rank, seed=0):
        return next(batches(seed, dp_rank, 4, 2, SEQ, 512))

    a, b, other_rank, other_seed = step0(1), step0(1), step0(2), step0(1, seed=1)
    assert len(a) == 4 and a[0][0].shape == (2, SEQ)
    assert all(torch.equal(x, y) and torch.equal(t, u) for (x, t), (y, u) in zip(a, b))
    assert not torch.equal(a[0][0], other_rank[0][0])
    assert not torch.equal(a[0][0], other_seed[0][0])
    it = batches(0, 1, 4, 2, SEQ, 512)
    first, second = next(it), next(it)
    assert not torch.equal(first[0][0], second[0][0])  # steps differ
    assert all(t.min() >= 0 and t.max() < 512 for mb in a for t in mb)


def test_targets_are_next_tokens_and_local_batch_splits_back():
    mbs = next(batches(0, 0, 4, 2, SEQ, 512))
    tokens, targets = local_batch(mbs)
    assert torch.equal(tokens[:, 1:], targets[:, :-1])
    # What a pipeline schedule does with the local batch: equal chunks along dim 0.
    chunks = zip(torch.tensor_split(tokens, 4), torch.tensor_split(targets, 4))
    for j, (chunk_x, chunk_y) in enumerate(chunks):
        assert torch.equal(chunk_x, mbs[j][0]) and torch.equal(chunk_y, mbs[j][1])
