"""Real checkpoints for tests/e2e/test_checkpoint.py (issue 31): one model, saved as it is sharded.

    torchrun --standalone --nproc-per-node 2 tests/e2e/ckpt_job.py OUT

One small model (an 8192 x 64 embedding, 2 MiB, the largest tensor; four square 64 x 64
Linear + tanh blocks; a 64 -> 16 head), seeded alike everywhere, trained one Adam step on the
same batch of 4 sequences, three ways, each saved with torch.distributed.checkpoint (DCP) as
``{"model": msd, "optim": osd}`` from ``get_state_dict(model, optimizer)`` with
``flatten_optimizer_state_dict=True`` (as torchtitan saves, so pipeline stages do not collide on
``param_groups``):

- ``ref/``: rank 0 alone, the unsharded model (``dcp.save(no_dist=True)``); ``ref_model/`` is
  its model half only (no optimizer), the natural reference for a weights-only file.
- ``fsdp2/``: ``fully_shard`` per block and at the root, over both ranks.
- ``pp/``: two pipeline stages (ScheduleGPipe, 2 microbatches), rank r holding stage r's
  modules built from the full model with the other stage's parts deleted (torchtitan's way), so
  both ranks save their own FQNs, the full model's names, into one directory.

The three are bitwise equal: every run computes each half batch's mean loss on its own
(FSDP2's rank r its half; the pipeline's microbatch r; the reference one half after the other,
gradients accumulating) and the gradient is half their sum (FSDP2 pre-divides by 2 before its
reduce-scatter sums, the pipeline divides the accumulated sum by its 2 microbatches, the
reference the same); halving is exact, a sum of two is commutative, and Adam is elementwise.

Planted, beside them:

- ``ulp/``: the FSDP2 model with ``layers.2.proj.weight[0, 0]`` moved up by one ulp.
- ``noopt/``: the FSDP2 model saved with its optimizer's per-parameter state dropped (every
  ``optim.state.*`` entry gone; ``optim.param_groups.*`` kept): what a fresh optimizer's
  ``state_dict()`` holds.
- ``hf.safetensors`` + ``hf_map.toml``: the reference's weights under Hugging-Face names, the
  head stored transposed (``[in, out]``, as GPT-2's Conv1D does) and declared so in the map.
- ``hf_bad.safetensors``: the same file from a buggy conversion that transposed the square
  ``layers.1.proj.weight`` (``model.layers.1.mlp.dense.weight``), which the map does not declare.

Live captures, when ``NUMAUDIT_ADDR`` names an auditor (the agent reads it, as a user's would):
right before ``fsdp2/`` and ``pp/`` are saved, each rank's agent captures the state dict being
saved (``agent.capture_state_dict(sd, step=LIVE_STEP)``) into run ``fsdp2-live`` (DTensor
shards, the dp mesh of FSDP2) and ``pp-live`` (each rank its own stage's entries, ``stage=``
its stage), and is closed at once; a close that did not get every capture acked ends the job.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.teardown import exit_rank  # noqa: E402
from numaudit.auditor.checkpoint.safetensors import write_safetensors  # noqa: E402

VOCAB, DIM, CLASSES, LAYERS = 8192, 64, 16, 4
LARGEST_TENSOR_BYTES = VOCAB * DIM * 4
"""The embedding (and its two Adam moments): 2 MiB."""
BATCH, SEQ, LR = 4, 8, 1e-2
"""4 sequences of 8 tokens; each rank (FSDP2), microbatch (pipeline) or half (reference) 2."""
STAGE_LAYERS = ((0, 1), (2, 3))
"""The blocks of pipeline stage 0 (with the embedding) and stage 1 (with the head)."""
ULP_SITE = "model.layers.2.proj.weight"
"""The weight whose element [0, 0] the ulp/ save moves by one ulp (held by FSDP2 rank 0)."""
TRANSPOSED_SITE = "model.layers.1.proj.weight"
"""The square weight hf_bad.safetensors holds transposed."""
LIVE_STEP = 1
"""The step the live captures are keyed by (`auditor checkpoint run:... --step LIVE_STEP`)."""
LIVE_RUNS = {"fsdp2": "fsdp2-live", "pp": "pp-live"}
"""The save each live capture sits beside -> its run name."""
HF_MAP = """\
# Hugging-Face names (CAND) -> this model's DCP names (REF).
[[map]]
cand = "model.embed_tokens.weight"
ref = "model.tok.weight"

[[map]]
cand = "model.layers.*.mlp.dense.weight"
ref = "model.layers.*.proj.weight"

[[map]]
cand = "model.layers.*.mlp.dense.bias"
ref = "model.layers.*.proj.bias"

[[map]]
cand = "lm_head.weight"
ref = "model.out.weight"
transpose = true   # stored [in, out], as GPT-2's Conv1D stores it

[[map]]
cand = "lm_head.bias"
ref = "model.out.bias"
"""


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x))


class Model(torch.nn.Module):
    """Embedding, LAYERS blocks, head; a pipeline stage keeps its own parts (others None)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.out = torch.nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) if self.tok is not None else x
        for layer in self.layers.values():
            h = layer(h)
        return self.out(h) if self.out is not None else h


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, CLASSES, (BATCH, SEQ), generator=g))


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean over this half batch's tokens."""
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LR, foreach=False)


def state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, optimizer,
                              options=StateDictOptions(flatten_optimizer_state_dict=True))
    return {"model": msd, "optim": osd}


def train_reference() -> tuple[Model, torch.optim.Optimizer]:
    model, (x, target) = Model(), batch()
    optimizer = adam(model.parameters())
    half = BATCH // 2
    for h in range(2):
        loss_fn(model(x[h * half:(h + 1) * half]), target[h * half:(h + 1) * half]).backward()
    for p in model.parameters():
        p.grad.div_(2)
    optimizer.step()
    return model, optimizer


def train_fsdp2() -> tuple[Model, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    model, (x, target) = Model(), batch()
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = adam(model.parameters())
    rank, half = dist.get_rank(), BATCH // 2
    loss_fn(model(x[rank * half:(rank + 1) * half]), target[rank * half:(rank + 1) * half]
            ).backward()
    optimizer.step()
    return model, optimizer


def train_pipeline() -> tuple[Model, torch.optim.Optimizer]:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    rank, (x, target) = dist.get_rank(), batch()
    stage = Model()
    for i in range(LAYERS):
        if i not in STAGE_LAYERS[rank]:
            del stage.layers[str(i)]
    if rank != 0:
        stage.tok = None
    if rank != len(STAGE_LAYERS) - 1:
        stage.out = None
    pipe = PipelineStage(stage, rank, len(STAGE_LAYERS), torch.device("cpu"))
    # Each microbatch's mean loss; scale_grads divides the accumulated sum by the 2 microbatches.
    schedule = ScheduleGPipe(pipe, 2, loss_fn=loss_fn, scale_grads=True)
    optimizer = adam(stage.parameters())
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=target)
    optimizer.step()
    return stage, optimizer


def hf_tensors(msd: dict[str, torch.Tensor], transposed: str | None = None
               ) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging-Face names (HF_MAP read backwards); `transposed` (a
    DCP name) is transposed too, as a buggy conversion would."""
    out = {"model.embed_tokens.weight": msd["tok.weight"]}
    for i in range(LAYERS):
        for kind in ("weight", "bias"):
            out[f"model.layers.{i}.mlp.dense.{kind}"] = msd[f"layers.{i}.proj.{kind}"]
    out["lm_head.weight"] = msd["out.weight"].t()
    out["lm_head.bias"] = msd["out.bias"]
    if transposed is not None:
        i = transposed.split(".")[2]
        out[f"model.layers.{i}.mlp.dense.weight"] = msd[f"layers.{i}.proj.weight"].t()
    return out


def capture_live(save: str, sd: dict, stage: int = -1, **attach) -> None:
    """When an auditor is named (NUMAUDIT_ADDR), capture `sd` as the run saving `save` would:
    one agent, one `capture_state_dict`, closed; anything not acked ends the job."""
    if not os.environ.get("NUMAUDIT_ADDR"):
        return
    import numaudit

    agent = numaudit.attach(None, run=LIVE_RUNS[save], spool_mode="off", **attach)
    agent.capture_state_dict(sd, step=LIVE_STEP, stage=stage)
    summary = agent.close()
    if not summary["captured"] or summary["acked"] != summary["captured"] or summary["dropped"]:
        raise SystemExit(f"rank {dist.get_rank()}: {LIVE_RUNS[save]} not all acked: {summary}")


def main(out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    if rank == 0:  # the reference: one process, no process group in the save
        model, optimizer = train_reference()
        sd = state_dict(model, optimizer)
        dcp.save(sd, checkpoint_id=out / "ref", no_dist=True)
        dcp.save({"model": sd["model"]}, checkpoint_id=out / "ref_model", no_dist=True)
        msd = {k: v.detach() for k, v in sd["model"].items()}
        write_safetensors(out / "hf.safetensors", hf_tensors(msd))
        write_safetensors(out / "hf_bad.safetensors", hf_tensors(msd, TRANSPOSED_SITE))
        (out / "hf_map.toml").write_text(HF_MAP)
    dist.barrier()

    model, optimizer = train_fsdp2()
    sd = state_dict(model, optimizer)
    capture_live("fsdp2", sd, mesh=model.tok.weight.device_mesh, dp_dim="dp")
    dcp.save(sd, checkpoint_id=out / "fsdp2")
    dropped = {"model": sd["model"],
               "optim": {k: v for k, v in sd["optim"].items() if not k.startswith("state.")}}
    dcp.save(dropped, checkpoint_id=out / "noopt")
    weight = model.get_parameter(ULP_SITE.removeprefix("model.")).to_local()
    if rank == 0:  # Shard(0): rank 0 holds row 0
        with torch.no_grad():
            weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(float("inf")))
    dcp.save(state_dict(model, optimizer), checkpoint_id=out / "ulp")
    del model, optimizer, sd, dropped

    stage, optimizer = train_pipeline()
    sd = state_dict(stage, optimizer)
    # no data parallelism: both ranks are dp rank 0 of 1, holding disjoint entries
    capture_live("pp", sd, stage=rank, dp_rank=0, dp_size=1)
    dcp.save(sd, checkpoint_id=out / "pp")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: torchrun --nproc-per-node 2 {sys.argv[0]} OUT")
    main(Path(sys.argv[1]))
    exit_rank(0)
