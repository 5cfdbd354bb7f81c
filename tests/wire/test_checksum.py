"""wire.checksum.crc32 (ISA-L where installed) is zlib's CRC-32: every checksum on the wire and in
spools is that function, so an agent and an auditor of different builds, with or without isal,
must compute the same values."""

from __future__ import annotations

import zlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from numaudit.wire import checksum


@settings(max_examples=200, derandomize=True)
@given(st.binary(max_size=3000), st.integers(0, 2**32 - 1), st.integers(0, 3000))
def test_crc32_is_zlibs_for_any_bytes_start_value_and_split(data, start, cut):
    assert checksum.crc32(data) == zlib.crc32(data)
    assert checksum.crc32(data, start) == zlib.crc32(data, start)
    head, tail = data[:cut], data[cut:]
    assert checksum.crc32(tail, checksum.crc32(head)) == zlib.crc32(data)  # chained


def test_crc32_takes_every_buffer_the_callers_pass():
    data = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    want = zlib.crc32(data)
    assert checksum.crc32(memoryview(data)) == want  # received_records_checksum slices a view
    assert checksum.crc32(bytearray(data)) == want
    assert checksum.crc32(memoryview(data)[17:4099]) == zlib.crc32(data[17:4099])
    assert checksum.crc32(b"") == 0


def test_the_fast_crc_is_the_one_in_use():
    """isal is a dependency (pyproject.toml): the zlib fallback is for platforms without its
    wheel, not what this install runs."""
    assert checksum.crc32.__module__.startswith("isal")
