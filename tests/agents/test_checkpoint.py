"""Gradients at module outputs under activation checkpointing, both modes of torch.utils.checkpoint.

The captures go to a list (no daemon: capture is pure tensor code); a run without checkpointing
is the reference, and each checkpointed run must yield the same bwd keys with bitwise-equal
fingerprints (CPU recomputation is deterministic).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from numaudit.agents.capture.capture import Capturer, Counters
from numaudit.agents.capture.module_hooks import NOT_CAPTURED_AMBIGUOUS
from numaudit.agents.config import AgentConfig
from numaudit.agents.identity import RankIdentity

pytestmark = pytest.mark.timeout(60)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Net(torch.nn.Module):
    def __init__(self, mode: str | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(Block() for _ in range(3))
        self.mode = mode

    def forward(self, x):
        for layer in self.layers:
            if self.mode is None:
                x = layer(x)
            else:
                x = checkpoint(layer, x, use_reentrant=self.mode == "reentrant")
        return x


def _bwd_captures(mode: str | None, microbatches: int = 2):
    caps, counters = [], Counters()

    def sink(batch):
        for c in batch.captures:
            fp = int(batch.i64[c.row][5]) if c.row >= 0 else None
            caps.append((c.step, c.microbatch, c.phase, c.site, c.index, c.call, fp))

    ident = RankIdentity(rank=0, world_size=1, local_rank=0, dp_rank=0, dp_size=1)
    capturer = Capturer(AgentConfig(phases=("fwd", "bwd")), ident, sink, counters)
    model = Net(mode)
    capturer.hook_modules(model)
    torch.manual_seed(1)
    capturer.start_step(0)
    for mb in range(microbatches):
        capturer.microbatch = mb
        x = torch.randn(4, 8, requires_grad=True)
        model(x).square().sum().backward()
        capturer.flush()
    return sorted(c for c in caps if c[2] == 2), counters  # PHASE_BWD


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_checkpointed_modules_keep_their_gradient_captures(mode):
    reference, _ = _bwd_captures(None)
    got, counters = _bwd_captures(mode)
    assert len(reference) == 2 * 3 * 3  # 2 microbatches x 3 blocks x (block, up, down)
    assert got == reference
    assert not counters.not_captured


def test_a_site_replayed_ambiguously_is_counted_not_guessed():
    """One module called in two reentrant segments: which replay is which call is unknown."""
    shared = torch.nn.Linear(4, 4)

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = shared

        def forward(self, x):
            x = checkpoint(self.shared, x, use_reentrant=True)
            return checkpoint(self.shared, x, use_reentrant=True)

    counters = Counters()
    ident = RankIdentity(rank=0, world_size=1, local_rank=0, dp_rank=0, dp_size=1)
    caps = []
    capturer = Capturer(AgentConfig(phases=("bwd",)), ident,
                        lambda b: caps.extend(b.captures), counters)
    model = Twice()
    capturer.hook_modules(model)
    capturer.start_step(0)
    model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    capturer.flush()
    assert not [c for c in caps if c.site == "shared"]
    assert counters.not_captured_snapshot() == {NOT_CAPTURED_AMBIGUOUS: 2}
