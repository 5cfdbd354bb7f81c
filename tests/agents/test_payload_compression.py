"""Payload compression: every payload decompresses to its bytes; level 1 is kept only where it
shrinks a payload by 10 % or more, and tried again after PayloadCompressor.RETRY."""

from __future__ import annotations

import numpy as np
import zstandard

from agents.batching import Capture
from agents.columns import PayloadCompressor


def _cap(site: str) -> Capture:
    return Capture(step=0, microbatch=0, phase=1, site=site, role=1, index=0, call=0, stage=-1,
                   layout=None, dtype="float32")


def _round_trip(data: bytes) -> bytes:
    return zstandard.ZstdDecompressor().decompress(data)


def test_incompressible_large_payloads_switch_to_the_fast_level_and_retry():
    z = PayloadCompressor()
    noise = memoryview(np.random.default_rng(0).standard_normal(1 << 16).astype("<f4")).cast("B")
    zeros = memoryview(bytes(noise.nbytes))
    logits, relu = _cap("output"), _cap("relu")
    first = z(logits, noise)
    assert _round_trip(first) == noise and len(first) > 0.9 * noise.nbytes
    fast = [z(logits, noise) for _ in range(PayloadCompressor.RETRY)]
    assert all(_round_trip(d) == noise for d in fast)
    assert z._fast_left[(1, "output", 1)] == 0  # the retry is next: level 1 again
    assert len(z(relu, zeros)) < 100  # another site, compressible: level 1 throughout
    assert len(z(relu, zeros)) < 100 and (1, "relu", 1) not in z._fast_left


def test_small_payloads_follow_the_same_rule():
    z = PayloadCompressor()
    small = memoryview(np.random.default_rng(1).standard_normal(1024).astype("<f4")).cast("B")
    ramp = memoryview(np.arange(1024, dtype="<i4")).cast("B")
    for _ in range(3):
        assert _round_trip(z(_cap("x"), small)) == small
        assert _round_trip(z(_cap("ids"), ramp)) == ramp
    assert (1, "x", 1) in z._fast_left and (1, "ids", 1) not in z._fast_left
