"""What both DS3 example runs capture, so the reference and the candidate always agree on it.

The scripts call `agents.attach` themselves (that call is the point of the examples); this module
holds the pieces that must be identical on both sides: the command-line options, the capture
options they turn into, and the hook that captures the token ids the model consumes.

Default captures (docs/dsv3.md, "What is audited"):

- `fwd`: the output of every module down to depth 4 — `tok_embeddings`, each block `layers.N`,
  its `attention_norm`, `attention`, `ffn_norm`, `moe`, their children (`attention.wq` ...
  `attention.wo`, `moe.router`, `moe.shared_experts`), `norm` and `output` — per microbatch.
  Depth 4 is what localizes a fault inside a block to the attention projection or the MoE part
  (router / shared experts) that introduced it. The router's output is its top-k expert indices
  (int64, index 0) and combine weights (index 1).
- `fwd` of the routed experts, site `layers.N.moe.experts`, one key per expert (index = expert):
  role `input` (the token copies routed to it) and `output`. A dp rank routes its own number of
  tokens to each expert, so these are ragged pieces (`capture_experts`): the logical tensor is
  every dp rank's rows for that expert in dp-rank order, which is what one process running the
  whole batch would hold. Not through a module hook: the hook would see all experts' rows as one
  tensor, whose ranks' pieces interleave.
- `output` (the logits) also travels as a zstd payload, so the report has exact max-abs,
  max-relative and ULP differences for it.
- `input`: the token ids as `tok_embeddings` receives them (site `tokens`).
- `loss`: each microbatch's unscaled mean cross-entropy (site `loss`).
- `grad`: every parameter gradient when the step ends, with `grad is None` recorded.
- `bwd` (with `--bwd`): the gradient arriving at each of those module outputs, the experts'
  outputs included.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

INPUT_SITE = "tokens"
"""Site of the input capture (phase `input`): the token ids fed to `tok_embeddings`."""
LOSS_SITE = "loss"
"""Site of the per-microbatch loss capture (phase `loss`)."""
CAPTURE_DEPTH = 4
"""Deepest module level captured: `layers.0.moe.shared_experts` is 4."""
EXCLUDE = ("layers.*.moe.experts",)
"""Module sites the hooks leave alone: `capture_experts` captures the experts per expert."""
PAYLOAD = ("fwd:output",)
"""`phase:site` globs whose raw bytes travel with the digests: the final logits."""
DTYPE = "float32"
"""The runs' training dtype, as recorded in the run metadata."""


def add_audit_args(p: argparse.ArgumentParser) -> None:
    """The audit options both example scripts take (NUMAUDIT_* variables still override them)."""
    g = p.add_argument_group("audit (agent options; NUMAUDIT_* variables override them)")
    g.add_argument("--bwd", action="store_true",
                   help="also capture the gradient at every captured module output (phase bwd)")
    g.add_argument("--depth", type=int, default=CAPTURE_DEPTH,
                   help=f"deepest module level captured (default {CAPTURE_DEPTH}: "
                        "layers.N.moe.shared_experts)")


def agent_options(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for `agents.attach` that both runs share."""
    phases = ("fwd", "grad", "loss", "input") + (("bwd",) if args.bwd else ())
    return dict(dtype=DTYPE, seed=args.seed, phases=phases, max_depth=args.depth,
                exclude=EXCLUDE, payload=PAYLOAD)


def capture_input_tokens(agent, model: torch.nn.Module) -> None:
    """Capture the token ids each microbatch feeds the model, on whichever rank embeds them.

    A forward pre-hook on `tok_embeddings` sees exactly what the model consumes, keyed by the
    microbatch the agent is in: the reference's `agent.microbatch(j)` block, or the pipeline
    schedule's chunk id on the first stage. Modules without `tok_embeddings` (later pipeline
    stages) capture nothing here.
    """
    embed = getattr(model, "tok_embeddings", None)
    if embed is None:
        return

    def hook(module: torch.nn.Module, inputs: tuple) -> None:
        agent.capture(inputs[0], site=INPUT_SITE, phase="input")

    embed.register_forward_pre_hook(hook)


def capture_experts(agent, model: torch.nn.Module, group) -> None:
    """Capture each routed expert's input and output rows as ragged pieces, in every MoE layer.

    The pieces' places come from one all_gather of the layer's per-expert token counts over
    `group` (the data-parallel group, whose ranks' tokens are concatenated in rank order) per
    layer and microbatch. That collective runs in the model's forward on every rank of `group`
    alike (the same layers in the same order in both example runs), so it cannot deadlock.
    Experts that got no tokens on a rank still send their empty piece.
    """
    import numaudit

    for name, layer in getattr(model, "layers", {}).items():
        site = f"layers.{name}.moe.experts"

        def on_experts(moe, expert_in, expert_out, counts, _site=site) -> None:
            rows = numaudit.ragged_rows(counts, group)
            agent.capture_segments(expert_in, counts, rows, site=_site, role="input")
            agent.capture_segments(expert_out, counts, rows, site=_site, role="output",
                                   backward=True)

        layer.moe.on_experts = on_experts


def close_agent(agent, name: str) -> None:
    """Flush the agent (collective: every rank must call it) and print the job's totals on
    rank 0."""
    import torch.distributed as dist

    s = agent.close()
    t = torch.tensor([s["captured"], s["acked"], s["dropped"], s["errors"]])
    dist.all_reduce(t)
    if dist.get_rank() == 0:
        captured, acked, dropped, errors = t.tolist()
        print(f"[{name}] audit: captured={captured} acked={acked} dropped={dropped} "
              f"errors={errors}", flush=True)
