"""Build the CPU digest kernel: ``python -m numaudit.agents.kernels.build`` (``make kernels``).

Compiles digest_cpu.cpp once per x86-64 ISA level plus the dispatcher into
``agents/kernels/build/libnumaudit_digest.so`` (ignored by git), with a stamp of the sources it
was built from beside it. ``pip install`` builds the same into the package (setup.py). Plain
C++ with no torch headers, so it needs only g++ and takes seconds; it runs from the Makefile,
never inside training. The library is rebuilt only when it was built from other sources.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = (HERE / "digest_cpu.cpp", HERE / "dispatch.cpp")
LIBRARY = HERE / "build" / "libnumaudit_digest.so"
CXX_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-fopenmp-simd", "-fno-math-errno")
ISA_LEVELS = (("v4", "x86-64-v4"), ("v3", "x86-64-v3"), ("base", "x86-64"))
"""(entry suffix, -march) per build of digest_cpu.cpp; dispatch.cpp picks one at run time."""


def sources_digest() -> str:
    """SHA-256 over the kernel's sources and flags: what a library was built from."""
    h = hashlib.sha256(" ".join(CXX_FLAGS + tuple(m for _, m in ISA_LEVELS)).encode())
    for src in SOURCES:
        h.update(src.read_bytes())
    return h.hexdigest()


def stamp_of(library: Path) -> Path:
    """The file beside a library naming the sources it was built from (`sources_digest`)."""
    return library.with_suffix(".sources")


def stale(library: Path = LIBRARY) -> bool:
    """True when the library is missing or was built from other sources than these.

    By content, not by time: an installed wheel's files all carry the install's time, so the
    library can look older than its sources though it was built from them."""
    stamp = stamp_of(library)
    if not library.exists() or not stamp.exists():
        return True
    return stamp.read_text().strip() != sources_digest()


def build(library: Path = LIBRARY, cxx: str | None = None, force: bool = False) -> Path:
    """Compile the library if stale; raise RuntimeError with the compiler's output on failure."""
    if not force and not stale(library):
        return library
    cxx = cxx or os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler: {cxx!r} not found (set CXX)")
    if platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"unsupported machine {platform.machine()!r}: the kernel is x86-64 only")
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        objects = []
        for suffix, march in ISA_LEVELS:
            obj = Path(tmp) / f"digest_{suffix}.o"
            _run([cxx, *CXX_FLAGS, f"-march={march}", f"-DNA_ISA={suffix}", "-c",
                  str(SOURCES[0]), "-o", str(obj)])
            objects.append(str(obj))
        dispatch = Path(tmp) / "dispatch.o"
        _run([cxx, "-O2", "-std=c++17", "-fPIC", "-c", str(SOURCES[1]), "-o", str(dispatch)])
        staged = Path(tmp) / library.name
        _run([cxx, "-shared", "-o", str(staged), *objects, str(dispatch)])
        stamp = Path(tmp) / "stamp"
        stamp.write_text(sources_digest() + "\n")
        os.replace(staged, library)  # atomic: a loading process never sees half a library
        os.replace(stamp, stamp_of(library))
    return library


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m numaudit.agents.kernels.build",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    args = parser.parse_args(argv)
    try:
        path = build(force=args.force)
    except RuntimeError as exc:
        print(f"numaudit.agents.kernels.build: {exc}", file=sys.stderr)
        return 1
    print(f"numaudit.agents.kernels.build: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
