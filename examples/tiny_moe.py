"""A small mixture-of-experts model, audited with its experts: one process, DDP or expert parallel.

    python examples/tiny_moe.py --name single                      # the whole batch, one process
    torchrun --nproc-per-node 2 examples/tiny_moe.py --name ddp    # each rank half the batch
    torchrun --nproc-per-node 2 examples/tiny_moe.py --name ep --ep  # experts sharded over ranks

Each rank routes its own tokens, so every expert sees a different number of rows on every rank
(often none): the experts' activations are ragged pieces (agents/ragged.py). With `--ep` each rank
owns half of the experts and tokens travel to their expert's owner by all-to-all; the owner's rows
for an expert arrive in source-rank order, which is the order of the logical tensor, so its one
piece holds every part. `--backward` also runs backward: the all-to-alls are autograd-aware
(torch.distributed._functional_collectives.all_to_all_single_autograd), the loss is a mean
over the global batch on every rank (loss_normalization="global_mean": each rank's share of one
mean), the gradients of parameters held by several ranks are summed over them, and the experts'
gradients (phase bwd, the same ragged pieces as their activations) and every parameter's
gradient (phase grad) are captured.
`--skip-renorm-layer N` plants a routing bug: layer N's top-k weights are not renormalized.
`--sum-expert-grads` plants a reduction bug of expert parallelism: the experts' gradients are
summed over the ranks as if every rank held the same experts (rank r's expert e gets the
gradient of the other rank's expert at the same position added).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # repo root: `agents`

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import numaudit
from examples.teardown import exit_rank

DIM, HIDDEN, EXPERTS, TOP_K, LAYERS = 16, 32, 8, 2, 4
BATCH, SEQ = 4, 3
"""Global batch: BATCH sequences of SEQ tokens, split over the data-parallel ranks."""


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.renormalize = True

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, indices = torch.topk(F.softmax(self.gate(x), dim=-1), TOP_K, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return indices, weights


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class MoELayer(nn.Module):
    """Top-k routing over `EXPERTS` experts, of which this rank holds `owned` (all without EP)."""

    def __init__(self, owned: range) -> None:
        super().__init__()
        self.router = Router()
        self.backward = False
        """Exchange tokens with autograd-aware all-to-alls (gradients flow back to the sources)."""
        self.owned = owned
        self.experts = nn.ModuleDict({str(e): Expert() for e in owned})
        self.norm = nn.LayerNorm(DIM)
        self.audit = None
        """(layer, kind, tensor, counts) -> None: the audit path, set by `audit_experts`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = self.norm(x).reshape(-1, DIM)
        indices, weights = self.router(flat)
        order = torch.argsort(indices.flatten(), stable=True)
        counts = torch.bincount(indices.flatten(), minlength=EXPERTS).tolist()
        routed_in = flat[order // TOP_K]
        if len(self.owned) == EXPERTS:
            routed_out = self._local(routed_in, counts)
        else:
            routed_out = self._expert_parallel(routed_in, counts)
        routed = routed_out[torch.argsort(order)].view(-1, TOP_K, DIM)
        return x + (routed * weights.unsqueeze(-1)).sum(dim=1).view(shape)

    def _local(self, routed_in: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if self.audit is not None:
            self.audit(self, routed_in, counts, None)
        outs = [self.experts[str(e)](chunk) for e, chunk in enumerate(routed_in.split(counts))]
        routed_out = torch.cat(outs)
        if self.audit is not None:
            self.audit(self, routed_out, counts, None, role="output")
        return routed_out

    def _expert_parallel(self, routed_in: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Send each expert's rows to its owner, run the owned experts, send the results back."""
        ep, n_own = dist.get_world_size(), len(self.owned)
        send_counts = torch.tensor(counts, dtype=torch.int64)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)  # [source, owned expert]
        by_source = recv_counts.view(ep, n_own).tolist()
        send_rows = [sum(counts[d * n_own:(d + 1) * n_own]) for d in range(ep)]
        recv_rows = [sum(r) for r in by_source]
        received = self._all_to_all(routed_in.contiguous(), recv_rows, send_rows)
        # regroup by expert: expert e's rows are every source's rows for e, in source order
        chunks = received.split([c for r in by_source for c in r])
        per_expert = [torch.cat([chunks[s * n_own + j] for s in range(ep)]) for j in range(n_own)]
        outs = []
        for j, e in enumerate(self.owned):
            total = sum(by_source[s][j] for s in range(ep))
            whole = numaudit.RaggedRows(offset=0, total=total, part=0, parts=ep, span=ep)
            if self.audit is not None:
                self.audit(self, per_expert[j], None, (e, whole))
            outs.append(self.experts[str(e)](per_expert[j]))
            if self.audit is not None:
                self.audit(self, outs[-1], None, (e, whole), role="output")
        # back to per-source order, then home
        out_chunks = [o.split([by_source[s][j] for s in range(ep)]) for j, o in enumerate(outs)]
        back = torch.cat([out_chunks[j][s] for s in range(ep) for j in range(n_own)])
        return self._all_to_all(back, send_rows, recv_rows)

    def _all_to_all(self, rows: torch.Tensor, recv_rows: list[int], send_rows: list[int]
                    ) -> torch.Tensor:
        """`send_rows[d]` rows to rank d, `recv_rows[s]` from rank s, in rank order."""
        if self.backward:  # the functional collective: its backward sends gradients home
            from torch.distributed._functional_collectives import (
                all_to_all_single_autograd,
                wait_tensor,
            )

            return wait_tensor(all_to_all_single_autograd(rows, recv_rows, send_rows,
                                                          dist.group.WORLD))
        out = rows.new_empty(sum(recv_rows), DIM)
        dist.all_to_all_single(out, rows, recv_rows, send_rows)
        return out


class TinyMoE(nn.Module):
    def __init__(self, owned: range) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList(MoELayer(owned) for _ in range(LAYERS))
        self.out = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def init_weights(model: TinyMoE, seed: int) -> None:
    """Each parameter from its own generator keyed by its name: sharded experts get the same."""
    import zlib

    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(name.encode()))
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def audit_experts(agent, model: TinyMoE, group=None, backward: bool = False) -> None:
    """Capture every expert's input and output rows as ragged pieces (site layers.N.experts);
    with `backward`, also the gradients reaching them (phase bwd, the same pieces)."""
    for i, layer in enumerate(model.layers):
        site = f"layers.{i}.experts"

        def audit(moe, t, counts, owner, role="input", _site=site):
            if owner is None:  # every expert local: this rank's rows of each, placed by counts
                rows = numaudit.ragged_rows(counts, group) if role == "input" else moe._rows
                moe._rows = rows
                agent.capture_segments(t, counts, rows, site=_site, role=role,
                                       backward=backward)
            else:  # an expert-parallel owner: all sources' rows of expert e
                e, whole = owner
                agent.capture(t, site=_site, role=role, index=e, rows=whole,
                              backward=backward)

        layer.audit = audit


def sum_shared_gradients(model: TinyMoE, owned_by_one: bool) -> None:
    """Sum the gradients of parameters every rank holds (each rank has its tokens' share).

    An expert-parallel expert lives on one rank and its gradient already covers every source's
    tokens (the all-to-all's backward brought them home): it is left alone."""
    for name, p in model.named_parameters():
        if p.grad is not None and not (owned_by_one and ".experts." in name):
            dist.all_reduce(p.grad)


def main(argv: list[str] | None = None) -> None:
    """One run. Under torchrun it joins the job's process group, or creates (and at the end
    destroys) one if there is none yet: a job that already has one can run several in turn."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", default=os.environ.get("NUMAUDIT_RUN", "moe"))
    p.add_argument("--ep", action="store_true", help="shard the experts over the ranks")
    p.add_argument("--skip-renorm-layer", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backward", action="store_true", help="run and audit backward too")
    p.add_argument("--sum-expert-grads", action="store_true",
                   help="planted bug: all-reduce the sharded experts' gradients too")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    distributed = "WORLD_SIZE" in os.environ
    own_group = distributed and not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    n_own = EXPERTS // world if args.ep else EXPERTS
    model = TinyMoE(range(rank * n_own, (rank + 1) * n_own) if args.ep else range(EXPERTS))
    init_weights(model, args.seed)
    if args.skip_renorm_layer is not None:
        model.layers[args.skip_renorm_layer].router.renormalize = False
    for layer in model.layers:
        layer.backward = args.backward
    phases = ("fwd", "input") + (("bwd", "grad") if args.backward else ())
    agent = numaudit.attach(model, run=args.name, dp_rank=rank, dp_size=world, phases=phases,
                          exclude=("layers.*.experts*",), dtype="float32",
                          loss_normalization="global_mean")
    audit_experts(agent, model, backward=args.backward)
    g = torch.Generator().manual_seed(args.seed)
    batch = torch.randn(BATCH, SEQ, DIM, generator=g)
    local = batch.tensor_split(world)[rank]
    with agent.step(0), agent.microbatch(0), torch.set_grad_enabled(args.backward):
        agent.capture(local, site="x", phase="input")
        out = model(local)
        if args.backward:
            # this rank's share of the mean over the global batch: the shares add up to it
            (out.square().sum() / (BATCH * SEQ * out.shape[-1])).backward()
            if distributed:
                sum_shared_gradients(model, owned_by_one=args.ep and not args.sum_expert_grads)
    s = agent.close()
    print(f"[{args.name}] rank {rank}: captured={s['captured']} acked={s['acked']} "
          f"dropped={s['dropped']} errors={s['errors']}", flush=True)
    if own_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_rank()  # skips a gloo teardown abort (examples/teardown.py)
