"""What pyproject.toml cannot say: the package map and the fused CPU digest kernel.

- One import root. The repository keeps `agents/`, `auditor/`, `wire/` and `protos/` at its top
  (docs/architecture: where the design puts them); installed, they are `numaudit.agents`,
  `numaudit.auditor`, `numaudit.wire` and `numaudit.protos`, so nothing with a generic name lands
  in site-packages.
- The kernel. `build_py` compiles `agents/kernels/digest_cpu.cpp` (one object per x86-64 ISA
  level plus the dispatcher, `agents/kernels/build.py`) into the package it builds, so
  `pip install .`, an sdist and a wheel all carry `libnumaudit_digest.so`. Without a compiler
  (or off x86-64) the install still succeeds and the agent warns once and digests eagerly.
  Editable installs skip it: a checkout builds the kernel in place (`make kernels`).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent
SUBPACKAGES = ("agents", "auditor", "wire", "protos")


def _package_map() -> tuple[list[str], dict[str, str]]:
    packages, where = ["numaudit"], {"numaudit": "numaudit"}
    for sub in SUBPACKAGES:
        for pkg in [sub, *(f"{sub}.{p}" for p in find_packages(sub))]:
            packages.append(f"numaudit.{pkg}")
            where[f"numaudit.{pkg}"] = pkg.replace(".", "/")
    return packages, where


def _kernel_builder():
    """agents/kernels/build.py loaded by path: it needs nothing but the standard library."""
    spec = importlib.util.spec_from_file_location("_numaudit_kernel_build",
                                                  HERE / "agents" / "kernels" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildWithKernel(build_py):
    """build_py, then the fused CPU digest kernel into the built package."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        kernel = _kernel_builder()
        target = Path(self.build_lib) / "numaudit" / "agents" / "kernels" / "build" / \
            kernel.LIBRARY.name
        try:
            kernel.build(target, force=True)
        except RuntimeError as exc:  # no compiler, another machine: install anyway
            print(f"numaudit: the fused CPU digest kernel was not built ({exc}); the agent "
                  "will warn once and use the eager digest", file=sys.stderr)
            return
        print(f"numaudit: built {target}")


class PlatformDistribution(Distribution):
    """A wheel with a compiled library is platform-specific, though it has no Python extension."""

    def has_ext_modules(self) -> bool:
        return True


packages, package_dir = _package_map()
setup(packages=packages, package_dir=package_dir, cmdclass={"build_py": BuildWithKernel},
      distclass=PlatformDistribution)
