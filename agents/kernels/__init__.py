"""Fused digest kernels: one pass over a piece computes the whole digest of agents/digest/digest.py.

Owns the digest's fused implementations: ``cpu`` loads the C++ kernel (``digest_cpu.cpp``, built
by ``build.py``: ``make kernels``) and registers it as the torch op ``numaudit::digest_batch``;
``accel`` and the ``triton_*`` modules are the optional Triton kernel for accelerator pieces. The
eager torch code in agents/digest/digest.py stays the reference implementation;
tests/agents/test_fused_digest.py holds the two together. They receive pieces and their layouts
from `agents.digest.fastpath` (and descriptors packed by the capture) and write digest rows; they
import neither capture nor delivery (tests/layout).
"""
