"""A small DeepSeek-V3-style transformer, written to be audited.

Each block is RMSNorm -> multi-head latent attention -> RMSNorm -> mixture of experts, with
residual connections around both. The module names follow DeepSeek-V3 / torchtitan
(`layers.2.moe.experts.w1`) so that digests from this model read like digests from the real one.

Two properties matter more here than speed:

- Bitwise reproducibility. The same microbatch through the same weights gives the same bits whether
  the model runs whole or split into pipeline stages: routing uses a stable sort and gathers instead
  of scatter-adds, experts run in a fixed loop, and nothing depends on the batch other than the
  microbatch itself.
- Pipeline splitting that keeps names. `tok_embeddings`, `norm` and `output` may be None and
  `layers` is an `nn.ModuleDict` keyed by the global layer number, so a stage built by
  `prune_to_stage` still calls its weights `layers.2.attention.wq.weight`.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass
class ModelArgs:
    vocab_size: int = 512
    """Token vocabulary size (embedding rows and output columns)."""
    dim: int = 64
    """Model (residual stream) width."""
    n_layers: int = 4
    """Number of transformer blocks; a pipeline split gives each stage a contiguous range of
    them."""
    n_heads: int = 4
    """Attention heads."""
    kv_lora_rank: int = 32
    """Width of the compressed KV latent produced by `wkv_a` and expanded by `wkv_b`."""
    qk_nope_head_dim: int = 16
    """Per-head query/key width that carries no positional rotation."""
    qk_rope_head_dim: int = 8
    """Per-head query/key width that gets the rotary embedding (the key part is shared by all
    heads)."""
    v_head_dim: int = 16
    """Per-head value width."""
    n_routed_experts: int = 4
    """Routed experts per MoE layer (stacked along dim 0 of `moe.experts.w1/w2/w3`)."""
    n_activated_experts: int = 2
    """Experts each token is sent to (top-k of the router scores)."""
    n_shared_experts: int = 1
    """Shared experts every token goes through; they form one SwiGLU of this many times
    `moe_inter_dim`."""
    moe_inter_dim: int = 64
    """Hidden width of one expert's SwiGLU."""
    max_seq_len: int = 64
    """Longest sequence the rotary tables cover."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    init_std: float = 0.02
    """Standard deviation of the normal init of linear and expert weights."""

    @property
    def qk_head_dim(self) -> int:
        """Full per-head query/key width (rotated part plus unrotated part)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def scaled(self, factor: int) -> ModelArgs:
        """The same architecture `factor` times wider (dims, latent, expert widths); depth
        unchanged."""
        if factor < 1:
            raise ValueError(f"scale factor must be >= 1, got {factor}")
        return dataclasses.replace(
            self,
            dim=self.dim * factor,
            kv_lora_rank=self.kv_lora_rank * factor,
            qk_nope_head_dim=self.qk_nope_head_dim * factor,
            qk_rope_head_dim=self.qk_rope_head_dim * factor,
            v_head_dim=self.v_head_dim * factor,
            moe_inter_dim=self.moe_inter_dim * factor,
        )


def rotary_tables(args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, shape [max_seq_len, qk_rope_head_dim // 2]."""
    half = args.qk_rope_head_dim // 2
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last dim of x ([batch, seq, heads, d]) in two halves (GPT-NeoX layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3) without the query low-rank path.

    Keys and values are computed from a small latent (`wkv_a` -> `kv_norm` -> `wkv_b`); the rotary
    part of the key comes straight out of `wkv_a` and is shared by all heads.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.nope_dim = args.qk_nope_head_dim
        self.rope_dim = args.qk_rope_head_dim
        self.v_dim = args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        self.wq = nn.Linear(args.dim, args.n_heads * args.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(args.kv_lora_rank, eps=args.norm_eps)
        self.wkv_b = nn.Linear(
            args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False
        )
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        self.softmax_scale = args.qk_head_dim**-0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, self.n_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q = torch.cat((q_nope, apply_rotary(q_rope, cos, sin)), dim=-1)

        kv, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_rope = apply_rotary(k_rope.unsqueeze(2), cos, sin)
        kv = self.wkv_b(self.kv_norm(kv)).view(bsz, seqlen, self.n_heads,
                                               self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, -1, self.n_heads, -1)), dim=-1)

        # [batch, heads, seq, d] for SDPA
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            is_causal=True, scale=self.softmax_scale,
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, self.n_heads * self.v_dim))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x). Used for the shared experts."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Router(nn.Module):
    """Softmax router with top-k selection steered by a frozen `expert_bias`.

    As in DeepSeek-V3's aux-loss-free balancing, the bias only changes *which* experts are picked;
    the combine weights are the unbiased scores. DS3 starts the bias at zero and nudges it from
    expert load between steps; here `init_weights` sets small seeded values (so it really steers the
    choice) and training never touches it, so both runs keep it bitwise equal.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.n_activated_experts
        self.gate = nn.Linear(args.dim, args.n_routed_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(args.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [tokens, dim] -> (expert indices [tokens, k], combine weights [tokens, k])."""
        scores = F.softmax(self.gate(x).float(), dim=-1)
        _, indices = torch.topk(scores + self.expert_bias, self.top_k, dim=-1)
        weights = scores.gather(1, indices)
        return indices, weights.type_as(x)


class GroupedExperts(nn.Module):
    """Routed experts as stacked weights: w1, w3 [experts, hidden, dim]; w2 [experts, dim,
    hidden]."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        e, d, h = args.n_routed_experts, args.dim, args.moe_inter_dim
        self.w1 = nn.Parameter(torch.empty(e, h, d))
        self.w2 = nn.Parameter(torch.empty(e, d, h))
        self.w3 = nn.Parameter(torch.empty(e, h, d))

    def forward(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x_sorted: token copies grouped by expert (counts[e] rows for expert e, in order)."""
        outs = []
        for e, chunk in enumerate(x_sorted.split(counts, dim=0)):
            hidden = F.silu(chunk @ self.w1[e].t()) * (chunk @ self.w3[e].t())
            outs.append(hidden @ self.w2[e].t())
        return torch.cat(outs, dim=0)


class MoE(nn.Module):
    """Routed experts (top-k of `n_routed_experts`) plus always-on shared experts."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.n_activated_experts
        self.n_experts = args.n_routed_experts
        self.router = Router(args)
        self.experts = GroupedExperts(args)
        self.shared_experts = FeedForward(args.dim, args.n_shared_experts * args.moe_inter_dim)
        self.on_experts: Callable[[MoE, torch.Tensor, torch.Tensor, list[int]], None] | None = None
        """Called with (self, expert inputs, expert outputs, rows per expert) after the experts
        ran: the audit path (examples/dsv3/auditing.py `capture_experts`). None: nothing."""
        self.drop_expert: int | None = None
        """Fault injection only: the tokens routed to this expert are dropped (their slot
        adds 0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        indices, weights = self.router(flat)
        # Group the (token, slot) pairs by expert. A stable sort keeps token order inside an expert,
        # and gathers (not scatter-adds) move rows, so the result does not depend on thread timing.
        order = torch.argsort(indices.flatten(), stable=True)
        counts = torch.bincount(indices.flatten(), minlength=self.n_experts).tolist()
        kept = None
        if self.drop_expert is not None:
            kept = indices.flatten()[order] != self.drop_expert
            counts[self.drop_expert] = 0
        expert_in = flat[(order if kept is None else order[kept]) // self.top_k]
        routed_sorted = self.experts(expert_in, counts)
        if self.on_experts is not None:
            self.on_experts(self, expert_in, routed_sorted, counts)
        if kept is not None:
            full = routed_sorted.new_zeros(len(order), shape[-1])
            full[kept] = routed_sorted
            routed_sorted = full
        routed = routed_sorted[torch.argsort(order)].view(-1, self.top_k, shape[-1])
        combined = (routed * weights.unsqueeze(-1)).sum(dim=1)
        return (combined + self.shared_experts(flat)).view(shape)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.moe = MoE(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.moe(self.ffn_norm(h))


class Transformer(nn.Module):
    """The whole model, or one pipeline stage of it after `prune_to_stage`.

    forward takes token ids when `tok_embeddings` is present and hidden states otherwise; it returns
    logits when `output` is present and hidden states otherwise.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rotary_tables(args)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens_or_hidden: torch.Tensor) -> torch.Tensor:
        h = tokens_or_hidden
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        seqlen = h.shape[1]
        cos, sin = self.rope_cos[:seqlen], self.rope_sin[:seqlen]
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init: each parameter draws from its own generator seeded by (seed, FQN).

        Because the stream depends only on the name, a full model and a pruned stage give every
        surviving parameter the same values, whatever else exists. Call it before FSDP sharding.
        """
        out_std = self.args.init_std / math.sqrt(2 * self.args.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            gen = torch.Generator().manual_seed(_name_seed(seed, name))
            if name == "tok_embeddings.weight":
                std = 1.0
            elif name.endswith(("wo.weight", "w2.weight", "experts.w2")):
                std = out_std  # projections back into the residual stream
            else:
                std = self.args.init_std
            param.copy_(torch.randn(param.shape, generator=gen) * std)
        for name, buf in self.named_buffers():
            if name.endswith("expert_bias"):
                gen = torch.Generator().manual_seed(_name_seed(seed, name))
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.01)


def _name_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def stage_layer_ids(n_layers: int, stage_index: int, num_stages: int) -> list[int]:
    """The contiguous layers a stage owns: an even split, earlier stages taking any remainder."""
    if not 0 <= stage_index < num_stages <= n_layers:
        raise ValueError(f"cannot give stage {stage_index} of {num_stages} a share of "
                         f"{n_layers} layers")
    base, extra = divmod(n_layers, num_stages)
    start = stage_index * base + min(stage_index, extra)
    return list(range(start, start + base + (1 if stage_index < extra else 0)))


def prune_to_stage(model: Transformer, stage_index: int, num_stages: int) -> Transformer:
    """Turn a full model into pipeline stage `stage_index` in place, keeping the full model's FQNs.

    The first stage keeps `tok_embeddings`, the last keeps `norm` and `output`; every stage keeps
    only its own layers, still under their global number. Returns the same object.
    """
    keep = {str(i) for i in stage_layer_ids(len(model.layers), stage_index, num_stages)}
    for key in [k for k in model.layers if k not in keep]:
        del model.layers[key]
    if stage_index != 0:
        model.tok_embeddings = None
    if stage_index != num_stages - 1:
        model.norm = None
        model.output = None
    return model


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy, mean over all tokens of one microbatch."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
