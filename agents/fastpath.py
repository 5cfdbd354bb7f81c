"""Which implementation digests a capture: the fused kernel when it can, the eager reference
otherwise.

The fused CPU kernel (agents/kernels/cpu.py) computes the same digest as agents/digest.py in one
pass and takes a whole list of pieces per call, so the captures of one hook (all outputs of a
module) or of one parameter sweep cost one kernel call. Pieces the kernel cannot read (non-CPU
devices, float8 types) and every piece when the kernel is unavailable or switched off
(``NUMAUDIT_DIGEST=eager``) go to the eager path, one piece at a time.
"""

from __future__ import annotations

import logging

import torch

from agents.digest import digest_piece
from agents.layout import PieceLayout

log = logging.getLogger(__name__)

DIGEST_MODES = ("auto", "eager")
"""``auto``: the fused kernel where it applies; ``eager``: always the torch reference."""

Rows = tuple[torch.Tensor, torch.Tensor]


class Digester:
    """Digests lists of pieces; holds the implementation choice made once at attach time."""

    def __init__(self, mode: str = "auto") -> None:
        if mode not in DIGEST_MODES:
            raise ValueError(f"digest: {mode!r} is not one of {', '.join(DIGEST_MODES)}")
        self._cpu = None
        if mode == "auto":
            from agents.kernels import cpu

            if cpu.load() is not None:  # else cpu.load() has logged the one warning
                self._cpu = cpu

    @property
    def fused(self) -> bool:
        """The fused CPU kernel is in use."""
        return self._cpu is not None

    def digest(self, pieces: list[tuple[torch.Tensor, PieceLayout]], sketch_k: int) -> list[Rows]:
        """``(f64 row, i64 row)`` per piece, in order; pieces are detached local tensors (complex
        ones already viewed as real, with the real view's layout).

        Raises like digest_piece on a bad layout; the caller decides what a failure costs.
        """
        out: list[Rows | None] = [None] * len(pieces)
        cpu = self._cpu
        fused_at: list[int] = []
        tensors: list[torch.Tensor] = []
        bases: list[int] = []
        gstrides: list[int] = []
        for i, (t, layout) in enumerate(pieces):
            if cpu is not None and cpu.supports(t) and not t.is_complex():
                base, gs = cpu.index_map(tuple(t.shape), layout)
                fused_at.append(i)
                tensors.append(t)
                bases.append(base)
                gstrides.extend(gs)
            else:
                out[i] = digest_piece(t, layout, sketch_k=sketch_k)
        if fused_at:
            f64, i64 = cpu.digest_rows(tensors, bases, gstrides, sketch_k)
            for j, i in enumerate(fused_at):
                out[i] = (f64[j], i64[j])
        return out  # type: ignore[return-value]
