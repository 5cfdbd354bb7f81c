"""The daemon process's allocator: large blocks go back to the system when freed.

glibc's malloc serves a large allocation with its own mapping (returned to the system on free)
only above a threshold that it raises to the size of each large block freed, up to 32 MiB.
After the first batch with 4 MiB payloads, every such buffer came from the heaps of the
daemon's threads instead, and stayed there when freed: 24 batches of 40 MiB, received one or
two at a time, raised the daemon's peak RSS by 510 MiB where 360 MiB were ever live at once.
`auditor serve` fixes the threshold at `MMAP_THRESHOLD` (which also stops the adjustment), so
its memory follows what the in-flight budget admits (docs/reliability.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 1 << 20
"""Allocations from this size up get a mapping of their own (freed back to the system)."""
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold for this process; False where there is no glibc."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False
    if not ok:
        log.debug("mallopt(M_MMAP_THRESHOLD) refused")
    return ok
