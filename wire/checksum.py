"""The batch checksum both ends compute: what `RecordBatch.records_crc32` holds.

The agent fills it when it builds a batch; the daemon checks it before anything else, so a batch
corrupted on a link without TLS is answered ABORTED and resent instead of stored.
"""

from __future__ import annotations

import zlib


def records_checksum(records) -> int:
    """CRC-32 of each record's deterministic bytes, chained in batch order."""
    crc = 0
    for r in records:
        crc = zlib.crc32(r.SerializeToString(deterministic=True), crc)
    return crc
