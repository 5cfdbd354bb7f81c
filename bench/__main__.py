"""Run every benchmark: ``python -m bench [--quick]`` (``make bench``).

Each entry of ``BENCHES`` is a ``main(argv) -> int`` that accepts ``--quick``; add new benchmarks
to the list.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from bench import checkpoint, compare, digest, gpu, ingest, ops, overhead

BENCHES: list[Callable[[Sequence[str]], int]] = [digest.main, overhead.main, ops.main,
                                                  compare.main, ingest.main, checkpoint.main,
                                                  gpu.main]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    status = 0
    for bench_main in BENCHES:
        status = max(status, bench_main(argv))
    return status


if __name__ == "__main__":
    sys.exit(main())
