"""Host buffers of one batch of digest rows, written in place by the fused kernel.

A capture's digest is two rows (agents/digest/digest.py): float64 ``[5 + k]`` and int64 ``[6]``. The
fused CPU kernel writes them straight into the rows of the batch the sender will read, so a
capture costs no tensor allocation, slicing or stacking: two ``torch.empty`` per batch of
``device_batch`` captures instead of two per capture plus a ``torch.stack`` (each torch call is
microseconds; the whole capture's budget is tens of them). Rows digested eagerly on the CPU are
copied in; rows on an accelerator do not come here (agents/capture/capture.py batches those apart).
"""

from __future__ import annotations

import torch

from numaudit.agents.digest.digest import N_MOMENTS

I64_COLUMNS = 6


class RowBatch:
    """``capacity`` rows, of which the first ``n`` are reserved; filled by the caller."""

    __slots__ = ("f64", "i64", "n", "capacity", "f64_ptr", "i64_ptr", "f64_row_bytes")

    def __init__(self, capacity: int, sketch_k: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: {capacity} < 1")
        self.f64 = torch.empty((capacity, N_MOMENTS + sketch_k), dtype=torch.float64)
        self.i64 = torch.empty((capacity, I64_COLUMNS), dtype=torch.int64)
        self.n = 0
        self.capacity = capacity
        self.f64_ptr = self.f64.data_ptr()
        self.i64_ptr = self.i64.data_ptr()
        self.f64_row_bytes = 8 * (N_MOMENTS + sketch_k)

    def room(self) -> int:
        """Rows not reserved yet."""
        return self.capacity - self.n

    def reserve(self, m: int) -> int:
        """Reserve the next ``m`` rows; returns the first. Raises ValueError past capacity."""
        if m > self.room():
            raise ValueError(f"m: {m} rows requested, {self.room()} left")
        first = self.n
        self.n += m
        return first

    def pointers(self, row: int) -> tuple[int, int]:
        """Addresses of row ``row`` in the f64 and i64 buffers (for the kernel)."""
        return self.f64_ptr + row * self.f64_row_bytes, self.i64_ptr + row * 8 * I64_COLUMNS

    def put(self, row: int, f64: torch.Tensor, i64: torch.Tensor) -> None:
        """Copy one row computed elsewhere (the eager digest) into row ``row``."""
        self.f64[row].copy_(f64)
        self.i64[row].copy_(i64)

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The reserved rows, ``(f64 [n, 5 + k], i64 [n, 6])`` (views of the buffers)."""
        return self.f64[: self.n], self.i64[: self.n]
