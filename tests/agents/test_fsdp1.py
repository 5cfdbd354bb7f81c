"""FSDP1 flat parameters as original parameters (agents/capture/fsdp1.py), on FlatParameters whose
metadata is laid out here as FSDP1 lays it out (padding entries between parameters included),
one rank at a time, without a process group. The real FSDP1 runs are the parallelism matrix's
(tests/e2e/test_parallelisms.py: both use_orig_params forms, no_sync, HYBRID_SHARD, clipping)."""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch

from numaudit.agents.capture import fsdp1
from numaudit.agents.layout import flat_layout


class Info(NamedTuple):  # torch's _ShardParamInfo, field for field
    in_shard: bool
    offset_in_shard: int | None
    numel_in_shard: int | None
    intra_param_start_idx: int | None
    intra_param_end_idx: int | None


SHAPES = {"w": (4, 3), "b": (3,)}
PAD = 5
"""Alignment padding FSDP1 puts after `w` (an entry of its own, flagged in _is_padding_mask)."""


def flat_module(rank: int, world: int, values: torch.Tensor | None = None):
    """A module holding `rank`'s shard of a FlatParameter of w (4, 3), PAD padding, b (3,)."""
    numels = [12, PAD, 3]
    padding = [False, True, False]
    total = sum(numels)
    shard = math.ceil(total / world)
    full = values if values is not None else torch.arange(total, dtype=torch.float32)
    padded = torch.cat([full, torch.zeros(shard * world - total)])
    lo, hi = rank * shard, (rank + 1) * shard
    infos, start = [], 0
    for n, pad in zip(numels, padding):
        a, b = max(start, lo), min(start + n, hi)
        if not pad:
            infos.append(Info(True, a - lo, b - a, a - start, b - start - 1) if a < b else
                         Info(False, None, None, None, None))
        start += n
    flat = torch.nn.Parameter(padded[lo:hi].clone())
    flat._is_flat_param = True
    flat._fqns = ("w", "b")
    flat._numels_with_padding = tuple(numels)
    flat._is_padding_mask = padding
    flat._shard_param_infos = tuple(infos)
    flat._sharded_size = torch.Size([shard])
    flat._unpadded_unsharded_size = torch.Size([total])
    flat._params = None
    module = torch.nn.Module()
    inner = torch.nn.Module()
    inner.register_parameter("_flat_param", flat)
    module.layer = inner
    return module, flat, full


def views_of(module):
    (views,) = fsdp1.expand(module, dp_size=2, copies=False).values()
    return {v.site: v for v in views}


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_holds_its_range_of_each_parameter_padding_skipped(rank):
    module, flat, full = flat_module(rank, 2)
    views = views_of(module)
    assert sorted(views) == ["layer.b", "layer.w"]
    w, b = full[:12], full[12 + PAD:]
    # 20 elements, 10 a rank: rank 0 holds w[0:10]; rank 1 w[10:12], the padding, and b whole
    want = {0: {"layer.w": (0, 10), "layer.b": (0, 0)},
            1: {"layer.w": (10, 2), "layer.b": (0, 3)}}[rank]
    for site, whole in (("layer.w", w), ("layer.b", b)):
        start, count = want[site]
        t, layout = views[site].tensor(grads=False)
        assert layout == flat_layout(whole.numel(), start, count)
        assert torch.equal(t, whole[start:start + count])


def test_gradients_follow_the_shard_and_no_sync_gives_each_ranks_whole_gradient():
    module, flat, full = flat_module(1, 2)
    views = views_of(module)
    assert views["layer.w"].tensor(grads=True) == (None, views["layer.w"].layout)
    flat.grad = torch.arange(10.0)  # reduce-scattered: rank 1's shard
    t, layout = views["layer.b"].tensor(grads=True)
    assert torch.equal(t, torch.arange(7.0, 10.0)) and not layout.replica
    shard = flat.data  # under no_sync(): the unsharded, unreduced gradient (FSDP1 assigns it
    flat.data = torch.zeros(20)  # past the size check the same way)
    flat.grad = torch.arange(20.0)
    flat.data = shard
    t, layout = views["layer.b"].tensor(grads=True)
    assert torch.equal(t, torch.arange(17.0, 20.0))  # after w and the padding
    assert layout == flat_layout(3, 0, 3, replica=True)


def test_an_unsharded_value_is_refused_and_left_out_not_recorded_none():
    module, flat, full = flat_module(0, 2)
    views = views_of(module)
    flat.data = torch.arange(20.0)  # unsharded, as inside a forward
    with pytest.raises(ValueError, match="not its shard's 10"):
        views["layer.w"].tensor(grads=False)
    failures = []
    items = list(fsdp1.sweep([("layer._flat_param", -1, flat), ("other", -1, torch.ones(2))],
                             fsdp1.expand(module, 2, False), False,
                             lambda what, exc: failures.append(what)))
    assert [site for site, *_ in items] == ["other"]
    assert len(failures) == 2 and "layer.w" in failures[0]


def test_original_parameters_map_to_their_own_view_and_replicas_follow_the_group():
    module, flat, full = flat_module(1, 2)
    params = [torch.nn.Parameter(full[10:12].clone()), torch.nn.Parameter(full[17:20].clone())]
    flat._params = params
    views = fsdp1.expand(module, dp_size=2, copies=False)
    assert set(views) == {id(p) for p in params}
    (b,) = views[id(params[1])]
    assert b.site == "layer.b" and b.tensor(grads=False)[1] == flat_layout(3, 0, 3)
    # ranks beside the data-parallel ones hold the same ranges: replicas
    (b,) = fsdp1.expand(module, dp_size=2, copies=True)[id(params[1])]
    assert b.layout.replica


def test_flat_parameters_it_cannot_read_are_captured_as_they_are_and_counted():
    """FSDP1 internals other than these (a FlatParameter without the metadata read here): the
    sweep goes on, that parameter is captured under its own name, and the failure is counted."""
    from numaudit.agents.capture.capture import Capturer, Counters
    from numaudit.agents.config import AgentConfig
    from numaudit.agents.identity import rank_identity

    module, flat, _ = flat_module(0, 2)
    del flat._fqns
    module.head = torch.nn.Linear(2, 2)
    batches = []
    cap = Capturer(AgentConfig(phases=("param",)), rank_identity(None, dp_rank=0, dp_size=2),
                   batches.append, Counters())
    cap.start_step(0)
    cap.capture_parameters(module, grads=False)
    cap.capture_parameters(module, grads=False)  # the failure is not worked out again
    sites = [c.site for b in batches for c in b.captures]
    assert sites == ["layer._flat_param", "head.weight", "head.bias"] * 2
    assert cap.counters.errors == 1
