"""Compact text for sets of integers (ranks, steps, stages): [0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""

from __future__ import annotations

from collections.abc import Iterable


def format_ranges(values: Iterable[int], empty: str = "") -> str:
    """Sorted, deduplicated runs of consecutive integers; `empty` when there are none."""
    return ", ".join(integer_runs(values)) or empty


def integer_runs(values: Iterable[int]) -> list[str]:
    """Sorted, deduplicated runs of consecutive integers, each as "5" or "7-8"."""
    ordered = sorted(set(int(v) for v in values))
    runs: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return runs
