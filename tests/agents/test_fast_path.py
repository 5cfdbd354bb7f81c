"""The capture fast path (cached plans, descriptors straight to the fused kernel) records exactly
what the general path records: same keys, layouts, dtypes, payload bytes; fingerprints and counts
bitwise, moments and sketches within float64 rounding (the eager digest is the reference)."""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from numaudit.agents.capture.capture import Capturer, Counters
from numaudit.agents.capture.hooks import add_grad_hook
from numaudit.agents.config import AgentConfig
from numaudit.agents.delivery.columns import payload_bytes
from numaudit.agents.identity import RankIdentity
from numaudit.agents.kernels import cpu

K = 64


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.ReLU(inplace=True),
                                        torch.nn.Linear(48, 16))
        self.pair = torch.nn.LSTM(16, 8, batch_first=True)  # a tuple of outputs
        self.out = torch.nn.Linear(8, 32).to(torch.bfloat16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.body(self.emb(tokens))
        y, _ = self.pair(h)
        return self.out(y.to(torch.bfloat16)).float()


def _records(digest: str) -> dict[tuple, tuple]:
    """Key -> (layout, dtype, flags, payload, i64 row, f64 row) of two steps, two microbatches."""
    torch.manual_seed(0)
    model = _Net()
    batches = []
    cfg = AgentConfig(digest=digest, sketch_k=K, phases=("fwd", "bwd", "grad", "param", "loss"),
                      payload=("fwd:out",), device_batch=8)
    cap = Capturer(cfg, RankIdentity(), batches.append, Counters())
    cap.hook_modules(model)
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        cap.start_step(step)
        for mb in range(2):
            cap.microbatch = mb
            tokens = torch.randint(0, 32, (3, 5), generator=g)
            loss = model(tokens).square().mean()
            cap.capture(loss, phase="loss", site="loss")
            loss.backward()
            cap.flush()
        cap.capture_parameters(model, grads=True)
        cap.capture_parameters(model, grads=False)
        model.zero_grad(set_to_none=True)
    fast_plans = sum(p is not None for p in cap._plans.fused.values())
    assert (fast_plans > 10) if digest == "auto" else fast_plans == 0, fast_plans
    out = {}
    for b in batches:
        for c in b.captures:
            key = (c.step, c.microbatch, c.phase, c.site, c.role, c.index, c.call, c.stage)
            assert key not in out, key
            rows = (None, None) if c.is_none else (b.i64[c.row].clone(), b.f64[c.row].clone())
            payload = None if c.payload is None else bytes(payload_bytes(c.payload))
            out[key] = (c.layout, c.dtype, (c.is_none, c.moments, c.complex_as_real), payload,
                        *rows)
    return out


def test_fast_path_records_what_the_eager_path_records():
    assert cpu.load() is not None, cpu.load_error()
    fast, ref = _records("auto"), _records("eager")
    assert fast.keys() == ref.keys() and len(fast) > 60
    phases = {k[2] for k in fast}
    assert len(phases) == 5, phases  # fwd, bwd, grad, param, loss all compared
    for key, (layout, dtype, flags, payload, i64, f64) in fast.items():
        r_layout, r_dtype, r_flags, r_payload, r_i64, r_f64 = ref[key]
        assert (layout, dtype, flags) == (r_layout, r_dtype, r_flags), key
        assert payload == r_payload, key
        if i64 is None:
            assert r_i64 is None, key
            continue
        assert torch.equal(i64, r_i64), key  # counts and fingerprint, bitwise
        assert torch.equal(f64[2:5], r_f64[2:5]), key  # min, max, abs-max
        assert torch.allclose(f64, r_f64, rtol=1e-9, atol=1e-9), key


def test_add_grad_hook_sees_what_register_hook_sees():
    """Same gradients, same order beside a user's hook, and the old value's gradient after an
    in-place change, as Tensor.register_hook."""
    def run(register):
        x = torch.arange(6.0, requires_grad=True)
        y = x * 2
        seen = []
        y.register_hook(lambda g: seen.append(("user", g.clone())))
        register(y, lambda g: seen.append(("agent", g.clone())))
        y.mul_(3)  # in place after the hooks: they get the gradient of the value they saw
        y.sum().backward()
        return seen, x.grad

    ours, grad = run(add_grad_hook)
    ref, ref_grad = run(lambda t, h: t.register_hook(h))
    assert [n for n, _ in ours] == [n for n, _ in ref] == ["user", "agent"]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(ours, ref))
    assert torch.equal(ours[1][1], torch.full((6,), 3.0)) and torch.equal(grad, ref_grad)


class _Scale(torch.nn.Module):
    """y = tanh(x * w) on DTensors of one sharding: no communication, so a fake world runs it."""

    def __init__(self, w) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(w)

    def forward(self, x):
        return torch.tanh(x * self.w)


def _dtensor_records(digest: str, rank: int) -> tuple[dict, Capturer]:
    """Records of DTensor captures on rank ``rank`` of a fake 2 x 2 mesh: a module's DTensor
    output and its gradient, parameters and their DTensor gradients, and direct captures of
    the same global shape under other placements (uneven, replicated, partial, an empty
    shard)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2))
    g = torch.Generator().manual_seed(10 + rank)

    def local(*shape, dtype=torch.float32):
        return torch.randn(shape, generator=g).to(dtype)

    place = [Shard(0), Shard(1)]
    model = torch.nn.Sequential(_Scale(DTensor.from_local(local(3, 5), mesh, place,
                                                           run_check=False)))
    x = DTensor.from_local(local(3, 5), mesh, place, run_check=False)
    direct = [
        DTensor.from_local(local(3, 5), mesh, [Shard(1), Shard(0)], run_check=False),
        DTensor.from_local(local(3, 10), mesh, [Shard(0), Replicate()], run_check=False),
        DTensor.from_local(local(6, 10, dtype=torch.bfloat16), mesh, [Replicate(), Partial()],
                           run_check=False),
        # uneven: global (5, 7) over Shard(0), Shard(1): torch computes each rank's box
        DTensor.from_local(local(3 if rank < 2 else 2, 4 if rank % 2 == 0 else 3), mesh,
                           place, run_check=False, shape=(5, 7),
                           stride=(7, 1)),
        DTensor.from_local(local(0, 5), mesh, [Shard(0), Replicate()], run_check=False,
                           shape=(1, 5), stride=(5, 1)) if rank >= 2 else None,
    ]
    batches = []
    cfg = AgentConfig(digest=digest, sketch_k=K, phases=("fwd", "bwd", "grad", "param"),
                      device_batch=8)
    cap = Capturer(cfg, RankIdentity(), batches.append, Counters())
    cap.hook_modules(model, stage=0)
    for step in range(2):
        cap.start_step(step)
        x.requires_grad_(True)
        model(x).to_local().square().sum().backward()
        for i, d in enumerate(direct):
            if d is not None:
                cap.capture(d, phase="fwd", site=f"direct{i}")
        cap.capture_parameters(model, grads=True)
        cap.capture_parameters(model, grads=False)
        model.zero_grad(set_to_none=True)
        cap.flush()
    out = {}
    for b in batches:
        for c in b.captures:
            key = (c.step, c.microbatch, c.phase, c.site, c.role, c.index, c.call, c.stage)
            out[key] = (c.layout, c.dtype, b.i64[c.row].clone(), b.f64[c.row].clone())
    return out, cap


def test_dtensor_captures_take_the_fast_path_and_record_what_the_general_path_does(fake_rank):
    """FSDP2 parameters and gradients and tensor-parallel activations are DTensors: the fast
    path digests their local shards under the DTensor's layout (cached per mesh, placements
    and global shape) and must record exactly what the general path records, on every rank."""
    assert cpu.load() is not None, cpu.load_error()
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    for rank in range(4):
        fake_rank(rank)
        # DTensor caches sharding propagation by specs that compare equal across ranks: a
        # rank change within one process would get the previous rank's mesh back
        _clear_sharding_prop_cache()
        fast, cap = _dtensor_records("auto", rank)
        ref, _ = _dtensor_records("eager", rank)
        assert fast.keys() == ref.keys()
        # fwd, bwd, grad, param; per step the module's output and its gradient, the direct
        # captures (the empty shard on ranks 2 and 3) and the parameter's gradient and value
        assert {k[2] for k in fast} == {1, 2, 3, 4}, sorted(fast)
        assert len(fast) == 2 * (1 + 1 + 4 + (rank >= 2) + 1 + 1), sorted(fast)
        # keyed by the layout too
        dtensor_plans = [p for key, p in cap._plans.fused.items() if len(key) == 8]
        assert dtensor_plans and all(p is not None for p in dtensor_plans)
        for key, (layout, dtype, i64, f64) in fast.items():
            r_layout, r_dtype, r_i64, r_f64 = ref[key]
            assert (layout, dtype) == (r_layout, r_dtype), key
            assert torch.equal(i64, r_i64), key
            assert torch.equal(f64[2:5], r_f64[2:5]), key
            assert torch.allclose(f64, r_f64, rtol=1e-9, atol=1e-9), key
        # the same mesh and global shape under other placements got its own layout
        a, b = divmod(rank, 2)  # the mesh coordinate
        lays = {(k[2], k[3]): v[0] for k, v in fast.items() if k[0] == 1}
        assert lays[(1, "0")].offsets == lays[(3, "0.w")].offsets == (3 * a, 5 * b)
        assert lays[(1, "direct0")].offsets == (3 * b, 5 * a)


def _segment_records(digest: str) -> dict[tuple, tuple]:
    """Records of expert segments (agents.Agent.capture_segments) over two steps: float32 rows
    with their gradients, a strided bfloat16 tensor, 1-D token ids, empty segments, a payload
    glob that asks for a large segment's bytes, and routing that changes between calls."""
    from numaudit.agents.ragged import rows_from_counts

    g = torch.Generator().manual_seed(5)
    cfg = AgentConfig(digest=digest, sketch_k=K, phases=("fwd", "bwd"), device_batch=16,
                      payload=("fwd:experts.big",), payload_max_bytes=512)
    batches = []
    cap = Capturer(cfg, RankIdentity(), batches.append, Counters())
    # (every part's counts, this rank's part): the last has rows of another part before its own
    routings = [([[4, 0, 7, 1]], 0), ([[0, 5, 5, 2]], 0), ([[3, 3, 3, 3], [1, 0, 6, 2]], 1)]
    for step in range(2):
        cap.start_step(step)
        for mb, (counts, part) in enumerate(routings):
            cap.microbatch = mb
            mine = counts[part]
            rows = rows_from_counts(counts, part)
            w = torch.randn(sum(mine), 6, generator=g, requires_grad=True)
            out = torch.tanh(w * 3)
            cap.capture_segments(out, mine, rows, phase="fwd", site="experts", role="output",
                                 backward=True)
            wide = torch.randn(12, sum(mine), generator=g).to(torch.bfloat16).t()  # strided
            cap.capture_segments(wide, mine, rows, phase="fwd", site="experts.t", role="input")
            ids = torch.randint(0, 1000, (sum(mine),), generator=g)
            cap.capture_segments(ids, mine, rows, phase="fwd", site="experts.ids", role="input")
            big = torch.randn(sum(mine), 40, generator=g)
            cap.capture_segments(big, mine, rows, phase="fwd", site="experts.big", role="input")
            out.square().sum().backward()
        cap.flush()
    out = {}
    for b in batches:
        for c in b.captures:
            key = (c.step, c.microbatch, c.phase, c.site, c.role, c.index, c.call, c.stage)
            assert key not in out, key
            payload = None if c.payload is None else bytes(payload_bytes(c.payload))
            out[key] = (c.layout, c.dtype, payload, b.i64[c.row].clone(), b.f64[c.row].clone())
    return out, cap


def test_expert_segments_take_the_fast_path_and_record_what_the_general_path_does():
    """A MoE layer's segments are digested through a plan per site, inner shape and strides
    (one descriptor each, no layout or index map worked out per segment), and must record
    what the general path records: keys, ragged layouts, payload bytes, digests."""
    assert cpu.load() is not None, cpu.load_error()
    fast, cap = _segment_records("auto")
    ref, _ = _segment_records("eager")
    assert fast.keys() == ref.keys()
    # per step: 3 microbatches x 4 segments x (output, its gradient, strided, ids, big)
    assert len(fast) == 2 * 3 * 4 * 5
    assert [p for p in cap._plans.split.values() if p is not None]
    for key, (layout, dtype, payload, i64, f64) in fast.items():
        r_layout, r_dtype, r_payload, r_i64, r_f64 = ref[key]
        assert (layout, dtype) == (r_layout, r_dtype), key
        assert payload == r_payload, key
        assert torch.equal(i64, r_i64), key
        assert torch.equal(f64[2:5], r_f64[2:5]), key
        assert torch.allclose(f64, r_f64, rtol=1e-9, atol=1e-9), key
    sizes: dict[str, int] = {}
    for k, v in fast.items():
        if v[2] is not None:
            sizes[k[3]] = max(sizes.get(k[3], 0), len(v[2]))
    assert sizes["experts.big"] == 7 * 40 * 4 and "experts.t" in sizes  # the glob; small ones
    assert {v[0].offsets[0] for k, v in fast.items() if k[1] == 2} == {3}  # after part 0's


def test_the_dtensor_layout_cache_keeps_no_mesh_alive(fake_rank):
    """A mesh holds its process groups; the agent outlives the model (it closes at exit), so a
    cached layout must not keep the mesh alive into the interpreter's teardown."""
    import gc
    import weakref

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    fake_rank(1)
    cap = Capturer(AgentConfig(sketch_k=K), RankIdentity(), lambda batch: None, Counters())
    mesh = DeviceMesh("cpu", torch.arange(4))
    dt = DTensor.from_local(torch.randn(3, 5), mesh, [Shard(0)], run_check=False)
    cap.capture(dt, phase="fwd", site="x")
    assert cap._layouts.dtensor and cap.counters.captured == 1 and not cap.counters.errors
    gone = weakref.ref(mesh)
    del dt, mesh
    gc.collect()
    assert gone() is None
    # a new mesh, maybe at the old one's address, gets its own layout
    mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2))
    dt = DTensor.from_local(torch.randn(3, 5), mesh, [Replicate(), Shard(0)], run_check=False)
    cap.capture(dt, phase="fwd", site="x")
    lay = cap._dtensor_layout(dt, "fwd")
    assert lay.logical_shape == (6, 5) and lay.replica and not cap.counters.errors


def test_captures_under_other_indices_share_one_plan_but_where_a_module_says_its_batch_dim():
    """A plan is per site, role, shape, strides and dtype, whatever the output index (a capture
    loop over indices worked a plan out per index, 4.5 -> 16.9 us a capture); an LSTM's outputs
    get their own, since its hidden states hold the batch on dim 1."""
    cap = Capturer(AgentConfig(phases=("fwd",)), RankIdentity(dp_rank=0, dp_size=2),
                   lambda batch: None, Counters())
    cap.start_step(0)
    t = torch.randn(2, 2, 8)
    for i in range(50):
        cap.capture(t, phase="fwd", site="x", index=i)
    assert len(cap._plans.fused) == 1
    lstm = torch.nn.LSTM(8, 8, num_layers=2)
    cap.hook_modules(torch.nn.ModuleDict({"lstm": lstm}))
    with torch.no_grad():
        lstm(torch.randn(2, 2, 8))  # seq-first: output (2, 2, 8), h_n and c_n (2, 2, 8)
    layouts = {key[3]: plan.layout for key, plan in cap._plans.fused.items()
               if key[1] == "lstm" and plan is not None}
    assert layouts[1].logical_shape == (2, 4, 8)  # the batch on dim 1: seq-first, and h_n/c_n
    assert len(layouts) == 1 and len(cap._plans.fused) == 2
