"""Fused digest kernels: one pass over a piece computes the whole digest of agents/digest.py.

``cpu`` loads the C++ kernel (``digest_cpu.cpp``, built by ``build.py``: ``make kernels``) and
registers it as the torch op ``numaudit::digest_batch``. The eager torch code in agents/digest.py
stays the reference implementation; tests/agents/test_fused_digest.py holds the two together.
"""
