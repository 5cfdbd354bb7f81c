"""One record's layout as the merge needs it (`Piece`), and the reductions a piece can be an
addend of: a record's place in its logical tensor, as the catalog reads it from the store.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum


class Reduce(IntEnum):
    """How a piece's logical tensor is made of the pieces of one key (proto Layout.reduce)."""

    NONE = 0
    """A tile or a replica of the logical tensor."""
    MEAN = 1
    """One addend of a mean over the batch (a dp rank's share of a loss)."""
    SUM = 2
    """One addend of a sum over the batch."""


REDUCE_NONE, REDUCE_MEAN, REDUCE_SUM = Reduce.NONE, Reduce.MEAN, Reduce.SUM
REDUCE_NAMES: dict[int, str] = {Reduce.MEAN: "mean", Reduce.SUM: "sum"}


@dataclass(frozen=True)
class Piece:
    """One record's layout as the merge needs it."""

    dtype: str
    logical_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    replica: bool = False
    partial: bool = False
    complex_as_real: bool = False
    is_none: bool = False
    reduce: int = REDUCE_NONE
    """REDUCE_MEAN / REDUCE_SUM: the piece is one addend of a reduction over the batch."""
    reduce_index: int = 0
    """The addend (dp rank) this piece holds."""
    reduce_count: int = 1
    """Addends that make the whole (dp size)."""
    reduce_weight: float = 1.0
    """Weight of the addend in a mean (its batch elements)."""
    ragged: tuple[int, int, int] | None = None
    """(first, span, parts): the ragged parts this piece holds (proto Layout.ragged_*)."""
    flat: bool = False
    """`logical_shape` is the tensor's flattening (one dim) and the piece a row-major range of it
    (proto Layout.flat): it tiles as a 1-D box; another run may hold the tensor in its own shape."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_full(self) -> bool:
        return (not self.is_none and self.shape == self.logical_shape
                and not any(self.offsets))

    @property
    def box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.offsets, self.shape
