"""Deterministic synthetic token data, identical for a given dp rank in every run.

Samples are generated from (seed, step, dp rank) only, never from the world size, the pipeline
degree or the process rank, so the reference and the candidate feed every dp rank the same
microbatches in the same order. Each sequence follows a simple rule (add a per-sample stride modulo
the vocabulary) with some random tokens mixed in, so a model can learn something and the loss moves.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

Microbatch = tuple[torch.Tensor, torch.Tensor]
"""(tokens [microbatch_size, seq_len], targets [microbatch_size, seq_len]), int64."""

NOISE_FRACTION = 0.1
"""Share of tokens replaced by uniformly random ones."""


def step_samples(seed: int, step: int, dp_rank: int, n_samples: int, seq_len: int,
                 vocab: int) -> torch.Tensor:
    """n_samples sequences of seq_len + 1 tokens for one (step, dp rank); int64
    [n_samples, seq_len + 1]."""
    gen = torch.Generator().manual_seed(((seed * 1_000_003 + step) * 65_537 + dp_rank) % (2**63))
    start = torch.randint(0, vocab, (n_samples, 1), generator=gen)
    stride = torch.randint(1, 8, (n_samples, 1), generator=gen)
    tokens = (start + stride * torch.arange(seq_len + 1)) % vocab
    noise = torch.randint(0, vocab, tokens.shape, generator=gen)
    mask = torch.rand(tokens.shape, generator=gen) < NOISE_FRACTION
    return torch.where(mask, noise, tokens)


def batches(
    seed: int, dp_rank: int, n_microbatches: int, microbatch_size: int, seq_len: int, vocab: int
) -> Iterator[list[Microbatch]]:
    """Endless iterator over steps; each step is the list of this dp rank's microbatches, in order.

    Microbatch j holds samples j * microbatch_size ... (j + 1) * microbatch_size - 1 of the step, so
    `local_batch` (their concatenation) split into n_microbatches equal chunks gives them back.
    Targets are the next tokens.
    """
    step = 0
    while True:
        samples = step_samples(seed, step, dp_rank, n_microbatches * microbatch_size, seq_len,
                               vocab)
        tokens, targets = samples[:, :-1], samples[:, 1:]
        yield [
            (tokens[j * microbatch_size:(j + 1) * microbatch_size].contiguous(),
             targets[j * microbatch_size:(j + 1) * microbatch_size].contiguous())
            for j in range(n_microbatches)
        ]
        step += 1


def local_batch(microbatches: list[Microbatch]) -> Microbatch:
    """The whole local batch (microbatches concatenated in order), as a pipeline schedule takes
    it."""
    return (torch.cat([t for t, _ in microbatches]), torch.cat([y for _, y in microbatches]))
