"""The GPU benchmark's workload: a dense, Llama-shaped bf16 decoder of about 1B parameters.

Written here rather than taken from a library so that the workload cannot change under the
benchmark: token embeddings, ``layers`` blocks of RMSNorm -> attention (rotary positions,
``F.scaled_dot_product_attention``, causal) and RMSNorm -> SwiGLU MLP with residuals, a final
norm and an untied output projection. The default shape is the one FIELD-NOTES measured with
transformers' ``LlamaForCausalLM`` on an H200 (hidden 2048, 16 layers, 16 heads, MLP 5632,
vocabulary 32000: 953M parameters here; 886M there), and a step is 4 microbatches of 2 x 2048
tokens (16k tokens), then an SGD update.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DecoderArgs:
    vocab: int = 32000
    dim: int = 2048
    layers: int = 16
    heads: int = 16
    hidden: int = 5632
    seq: int = 2048
    microbatch: int = 2
    microbatches: int = 4

    @property
    def tokens_per_step(self) -> int:
        return self.seq * self.microbatch * self.microbatches


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = x.float()
        norm = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps)
        return norm.type_as(x) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.heads = args.heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        shape = (b, s, self.heads, d // self.heads)
        q = self.wq(x).view(shape).transpose(1, 2)
        k = self.wk(x).view(shape).transpose(1, 2)
        v = self.wv(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v,
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, d))


class FeedForward(nn.Module):
    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden, bias=False)
        self.w2 = nn.Linear(args.hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.layers))
        self.norm = RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab, bias=False)
        head = args.dim // args.heads
        inv = 1.0 / (10000.0 ** (torch.arange(0, head, 2, dtype=torch.float32) / head))
        angles = torch.outer(torch.arange(args.seq, dtype=torch.float32), inv)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        dtype = self.output.weight.dtype
        cos, sin = self.cos[:s].to(dtype), self.sin[:s].to(dtype)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def build(args: DecoderArgs, device: str = "cuda", seed: int = 0) -> Decoder:
    """A bf16 model on ``device`` with weights drawn from ``seed`` (the same for every call)."""
    with torch.device(device):
        model = Decoder(args)
    model.to(torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                continue
            deep = name.endswith(("wo.weight", "w2.weight"))  # scaled down, as GPT-2 does
            p.normal_(0.0, 0.02 / (math.sqrt(2 * args.layers) if deep else 1.0), generator=g)
    return model


def parameters(args: DecoderArgs) -> int:
    """The model's parameter count (built on the meta device)."""
    with torch.device("meta"):
        return sum(p.numel() for p in Decoder(args).parameters())


def batches(args: DecoderArgs, device: str = "cuda",
            seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One step's microbatches of random tokens and their next-token targets."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(args.microbatches):
        t = torch.randint(0, args.vocab, (args.microbatch, args.seq + 1), generator=g)
        out.append((t[:, :-1].to(device), t[:, 1:].to(device)))
    return out


def train_step(model: Decoder, optimizer: torch.optim.Optimizer, agent, step: int,
               microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One step as the README shows it (the agent's step and microbatch blocks, the loss
    captured), then the optimizer. ``agent`` None: the same step without one."""
    ctx = agent.step(step) if agent is not None else contextlib.nullcontext()
    with ctx:
        for j, (tokens, targets) in enumerate(microbatches):
            mb = agent.microbatch(j) if agent is not None else contextlib.nullcontext()
            with mb:
                logits = model(tokens)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
                if agent is not None:
                    agent.capture(loss, site="loss", phase="loss")
                (loss / len(microbatches)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
