"""Payload compression: every payload reads back as its bytes; zstd level 1 is kept only where
it shrinks a payload by 10 % or more, codec raw (no compression) otherwise, and level 1 is tried
again after PayloadCompressor.RETRY payloads."""

from __future__ import annotations

import numpy as np
import zstandard

from numaudit.agents.delivery.columns import PayloadCompressor
from numaudit.agents.digest.batching import Capture


def _cap(site: str) -> Capture:
    return Capture(step=0, microbatch=0, phase=1, site=site, role=1, index=0, call=0, stage=-1,
                   layout=None, dtype="float32")


def _read(got: tuple[str, bytes]) -> bytes:
    codec, data = got
    assert codec in ("zstd", "raw")
    return zstandard.ZstdDecompressor().decompress(data) if codec == "zstd" else data


def test_incompressible_payloads_travel_raw_and_level_1_is_retried():
    z = PayloadCompressor()
    noise = memoryview(np.random.default_rng(0).standard_normal(1 << 14).astype("<f4")).cast("B")
    zeros = memoryview(bytes(noise.nbytes))
    logits, relu = _cap("output"), _cap("relu")
    first = z(logits, noise)
    assert first[0] == "zstd" and _read(first) == noise and len(first[1]) > 0.9 * noise.nbytes
    raw = [z(logits, noise) for _ in range(PayloadCompressor.RETRY)]
    assert all(codec == "raw" and data == noise for codec, data in raw)
    assert z(logits, noise)[0] == "zstd"  # the retry: level 1 again
    shrunk = z(relu, zeros)  # another site, compressible: level 1 throughout
    assert shrunk[0] == "zstd" and len(shrunk[1]) < 100 and _read(shrunk) == zeros
    assert z(relu, zeros)[0] == "zstd"


def test_raw_payloads_are_the_callers_bytes_which_no_later_capture_overwrites():
    """A raw payload is a view of the agent's host copy, not a copy: the batch encoder copies it
    once, into the sealed batch (wire/sealed.py). That is only sound while no later capture
    writes over the copy: payload buffers never overlap and a full arena is replaced, never
    written again."""
    from numaudit.agents.config import AgentConfig
    from numaudit.agents.digest.batching import ARENA_BYTES, Batcher
    from numaudit.agents.digest.fastpath import Digester

    z = PayloadCompressor()
    buf = bytearray(np.random.default_rng(2).standard_normal(4096).astype("<f4").tobytes())
    view = memoryview(buf)
    z(_cap("x"), view)  # level 1 does not pay: raw next
    codec, data = z(_cap("x"), view)
    assert codec == "raw" and data is view

    b = Batcher(Digester("eager"), AgentConfig(), lambda batch: None, None, None)
    handed = []
    for n in [3000, 5000, 16384, 1, 64] * 40:  # several arenas' worth
        mem, at = b.payload_buffer(n)
        mem[:] = bytes([len(handed) % 251]) * n
        handed.append((mem, at, n, len(handed) % 251))
    spans = sorted((at, at + n) for _, at, n, _ in handed)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # no overlap
    assert sum(n for *_, n, _ in handed) > 3 * ARENA_BYTES
    assert all(bytes(mem) == bytes([v]) * n for mem, _, n, v in handed)  # none written again


def test_a_large_payloads_retry_compresses_a_probe_and_the_whole_only_when_it_pays():
    """Float noise over 2 * PROBE bytes: its retry compresses PROBE bytes and travels raw; the
    same (phase, site, role) turned compressible is compressed whole at its next retry."""
    z = PayloadCompressor()
    compressed = []
    real = z._good.compress
    z._good = type("Counting", (), {"compress": lambda self, b: compressed.append(
        memoryview(b).nbytes) or real(b)})()
    noise = memoryview(np.random.default_rng(3).standard_normal(1 << 18).astype("<f4")).cast("B")
    zeros = memoryview(bytes(noise.nbytes))
    logits = _cap("output")
    assert z(logits, noise)[0] == "zstd" and compressed == [noise.nbytes]  # first: the whole
    for _ in range(PayloadCompressor.RETRY):
        assert z(logits, noise) == ("raw", noise)
    assert compressed == [noise.nbytes]
    assert z(logits, noise) == ("raw", noise)  # the retry: a probe said no
    assert compressed == [noise.nbytes, PayloadCompressor.PROBE]
    for _ in range(PayloadCompressor.RETRY):
        z(logits, zeros)  # raw, without compressing
    codec, data = z(logits, zeros)  # the next retry: the probe shrinks, so the whole
    assert codec == "zstd" and _read((codec, data)) == zeros
    assert compressed == [noise.nbytes, PayloadCompressor.PROBE, PayloadCompressor.PROBE,
                          zeros.nbytes]


def test_small_payloads_follow_the_same_rule():
    z = PayloadCompressor()
    small = memoryview(np.random.default_rng(1).standard_normal(1024).astype("<f4")).cast("B")
    ramp = memoryview(np.arange(1024, dtype="<i4")).cast("B")
    got_x = [z(_cap("x"), small) for _ in range(3)]
    got_ids = [z(_cap("ids"), ramp) for _ in range(3)]
    assert all(_read(g) == small for g in got_x) and all(_read(g) == ramp for g in got_ids)
    assert [c for c, _ in got_x] == ["zstd", "raw", "raw"]
    assert [c for c, _ in got_ids] == ["zstd", "zstd", "zstd"]


def test_payloads_under_4_kib_travel_raw_even_when_they_compress():
    z = PayloadCompressor()
    ids = memoryview(np.arange(PayloadCompressor.SMALL // 8 - 1, dtype="<i8")).cast("B")
    assert z(_cap("ids"), ids) == ("raw", ids.tobytes())
    whole = memoryview(np.arange(PayloadCompressor.SMALL // 8, dtype="<i8")).cast("B")
    codec, data = z(_cap("ids"), whole)
    assert codec == "zstd" and len(data) < whole.nbytes // 2 and _read((codec, data)) == whole
