"""One job of the frameworks' acceptance tests (issue 37): real models of transformers and
torchtitan, tiny and randomly initialized, trained with the README's lines.

    python tests/e2e/frameworks_job.py llama:llama moe:moe tt:tt ...        # one process
    torchrun --standalone --nproc-per-node 2 tests/e2e/frameworks_job.py llama_ddp:llama_ddp ...

Each argument is CASE:RUN; the cases of one job run one after another in one process group
(tests/e2e/helpers.run_cases). The model family is the case's first word: ``llama``
(transformers' LlamaForCausalLM), ``moe`` (transformers' Qwen3MoeForCausalLM), ``tt``
(torchtitan's llama3 with its own parallelize function); then the parallelism (none, ``ddp``,
``fsdp``, ``tp``) and, for some, a planted bug or another grouping of the samples:

- ``*_shift``: rank 1 reads its rows of microbatch 1 shifted by one token (a data bug);
- ``llama_acc4`` / ``llama_acc1``: one process, a step of 8 sequences as 4 accumulated
  microbatches of 2 (the loss divided by 4) / as one microbatch of 8; ``llama_acc4_nodiv``: the
  same 4 without the division (the bug).

Hidden sizes are such that most activations and weights are above 16 KiB (no payload): a
microbatch of 2 sequences of 32 tokens of width 96 is 24 KiB.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numaudit  # noqa: E402
from examples.teardown import exit_rank  # noqa: E402
from tests.e2e.helpers import run_cases  # noqa: E402

VOCAB, DIM, HIDDEN, LAYERS, HEADS, KV_HEADS = 256, 96, 192, 2, 4, 2
MICROBATCHES, BATCH, SEQ, STEPS = 2, 8, 32, 2
"""2 microbatches of 8 sequences (the global batch of each) of 32 tokens, 2 steps."""
ACCUMULATED = 4
"""The accumulation cases: 4 microbatches of BATCH // 4 sequences against one of BATCH."""


def tokens(step: int, j: int, n: int = BATCH) -> torch.Tensor:
    """Microbatch j of step `step`: n sequences (the global batch), the same in every run."""
    g = torch.Generator().manual_seed(1000 * step + j)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g)


def next_token_loss(logits: torch.Tensor, x: torch.Tensor, reduction: str = "mean"):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten(), reduction=reduction)


def readme_loop(agent, model, optimizer, microbatches_of, loss_of, backward=None) -> None:
    """The README's snippet: `loss_of(x)` is `loss_fn(model(x))`; `backward(loss)` where the
    code backpropagates a scaled loss."""
    for step in range(STEPS):
        microbatches = microbatches_of(step)
        with agent.step(step):                 # parameter gradients captured when the block exits
            for j, x in enumerate(microbatches):
                with agent.microbatch(j):
                    loss = loss_of(x)
                    agent.capture(loss, site="loss", phase="loss")
                    (backward or torch.Tensor.backward)(loss)
        optimizer.step()
        optimizer.zero_grad()


# -- transformers ----------------------------------------------------------------------------------

def hf_model(family: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=HIDDEN,
                  num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, max_position_embeddings=SEQ,
                  attn_implementation="eager", use_cache=False)
    torch.manual_seed(0)
    if family == "moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                                  moe_intermediate_size=HIDDEN // 2))
    return LlamaForCausalLM(LlamaConfig(**common))


def run_hf(case: str, run: str) -> None:
    family, _, parallel = case.partition("_")
    model = hf_model(family)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    mesh = None
    if parallel.startswith(("ddp", "fsdp")):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        if parallel.startswith("ddp"):
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(model)
        else:
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = numaudit.attach(model, run=run, mesh=mesh)   # the README's line
    share = BATCH // world

    def microbatches(step: int) -> list[torch.Tensor]:
        if parallel.startswith("acc"):  # the step's BATCH sequences, in 4 microbatches or 1
            n = BATCH // ACCUMULATED if parallel.startswith("acc4") else BATCH
            return list(tokens(step, 0).split(n))
        out = [tokens(step, j)[rank * share:(rank + 1) * share] for j in range(MICROBATCHES)]
        if parallel.endswith("_shift") and rank == 1:  # planted: rank 1 reads its rows shifted
            out[1] = out[1].roll(1, dims=1)
        return out

    backward = None
    if parallel == "acc4":  # the loss divided by the accumulation count, as it should be
        backward = lambda loss: (loss / ACCUMULATED).backward()  # noqa: E731
    readme_loop(agent, model, optimizer, microbatches,
                lambda x: next_token_loss(model(x).logits, x), backward)
    agent.close()


# -- torchtitan ------------------------------------------------------------------------------------

def tt_model():
    """torchtitan's llama3, tiny: its own blocks and config, with SDPA attention (FlexAttention
    has no backward on CPU) and unfused q/k/v."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    layers = _build_llama3_layers(n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS,
                                  hidden_dim=HIDDEN, attn_backend="flex", fuse_qkv=False,
                                  rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=SEQ,
                                                          theta=10000.0))
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB, layers=layers, norm=RMSNorm.Config(normalized_shape=DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB))
    return config


def run_tt(case: str, run: str) -> None:
    """torchtitan's normalization: each rank's loss is its summed token losses over the global
    token count, gradients summed over the dp ranks (plain SUM: gloo has no PREMUL_SUM);
    under TP the logits stay sharded on the vocabulary and the loss is taken in
    loss_parallel()."""
    import contextlib

    config = tt_model()
    parallel = case.partition("_")[2]
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    parallel_dims = None
    if parallel:
        import torchtitan.distributed.parallel_dims as pd_module
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.distributed import ParallelDims
        from torchtitan.models.llama3 import parallelize_llama
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        pd_module.device_type = "cpu"  # torchtitan takes "cuda" where no accelerator is found
        tp = world if parallel == "tp" else 1
        parallelism = ParallelismConfig(tensor_parallel_degree=tp, spmd_backend="partial_dtensor")
        set_llama3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel)
        parallel_dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=tp, pp=1, ep=1,
                                     world_size=world, spmd_backend="partial_dtensor")
        parallel_dims.build_mesh()
    torch.manual_seed(0)
    model = config.build()
    model.init_states(buffer_device=torch.device("cpu"))
    if parallel_dims is not None:
        from torch.distributed.fsdp import FSDPModule

        parallelize_llama(model, parallel_dims=parallel_dims,
                          training=TrainingConfig(mixed_precision_param="float32"),
                          parallelism=parallelism, compile_config=CompileConfig(),
                          ac_config=None, dump_folder="/tmp")
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = numaudit.attach(model, run=run, mesh=parallel_dims)
    dp = world if parallel == "fsdp" else 1
    share = BATCH // dp
    reader = rank if dp > 1 else 0
    loss_context = contextlib.nullcontext
    if parallel == "tp":
        from torch.distributed.tensor.parallel import loss_parallel as loss_context

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        with loss_context():
            return next_token_loss(model(x), x, "sum") / (BATCH * (SEQ - 1))

    def backward(loss: torch.Tensor) -> None:
        with loss_context():
            loss.backward()

    for step in range(STEPS):
        microbatches = [tokens(step, j)[reader * share:(reader + 1) * share]
                        for j in range(MICROBATCHES)]
        with agent.step(step):
            for j, x in enumerate(microbatches):
                with agent.microbatch(j):
                    loss = loss_of(x)
                    agent.capture(loss, site="loss", phase="loss", reduce="sum")
                    backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    agent.close()


def run_one(case: str, run: str) -> None:
    if case.startswith("tt"):
        run_tt(case, run)
    else:
        run_hf(case, run)


if __name__ == "__main__":
    logging_level = os.environ.get("FRAMEWORKS_JOB_LOG")
    if logging_level:
        import logging

        logging.basicConfig(level=logging_level)
    run_cases(run_one)
    exit_rank()
