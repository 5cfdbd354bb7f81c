"""The asynchronous device path without a GPU: what a CUDA batch looks like to the sender.

On CUDA a device batch reaches the sender with its rows and payloads in host buffers that
asynchronous copies are still filling, and an event recorded after those copies
(agents/digest/digest.py ``digest_batch_to_host``, agents/digest/device_copy.py). The training
thread never waits on it; the sender must, before it reads anything of the batch. Here a batch made
by the agent's own capture path is handed to the sender with its buffers blanked and a CPU stand-in
for the event that fills them when waited on: what a real daemon stores is what the "copies" wrote
only if the sender waited first, on its own thread.
"""

from __future__ import annotations

import threading

import pytest
import torch
import zstandard

import numaudit
from numaudit.agents.digest.device_copy import payload_copy
from numaudit.auditor.store.reader import Reader

pytestmark = pytest.mark.timeout(120)


class _Copies:
    """Stands in for the CUDA event recorded after a batch's asynchronous copies: waiting on
    it is when the host buffers hold their values."""

    def __init__(self, fill) -> None:
        self.fill = fill
        self.threads: list[int] = []

    def synchronize(self) -> None:
        self.threads.append(threading.get_ident())
        self.fill()


def test_the_sender_reads_a_device_batch_only_after_its_event(auditor_server):
    t = torch.randn(4, 3, generator=torch.Generator().manual_seed(5))
    agent = numaudit.attach(None, address=auditor_server.address, run="dev", phases=("fwd",),
                          sketch_k=16)
    batches = []
    agent.capturer._batches._sink = batches.append  # the batch as the sender would get it
    with agent.step(0), agent.microbatch(0):
        agent.capture(t, site="m", phase="fwd")
    (batch,) = batches
    (cap,) = batch.captures
    f64, i64, payload = batch.f64.clone(), batch.i64.clone(), t.clone()
    cap.payload = torch.zeros_like(t)  # pinned host buffers, not yet written
    batch.f64.zero_()
    batch.i64.zero_()

    def copies_done() -> None:
        batch.f64.copy_(f64)
        batch.i64.copy_(i64)
        cap.payload.copy_(payload)

    batch.ready = _Copies(copies_done)
    agent._sink(batch)
    agent.close(timeout=30.0)

    assert batch.ready.threads and threading.get_ident() not in batch.ready.threads
    reader = Reader(auditor_server.db_path)
    (rec,) = list(reader.records("dev"))
    assert rec[17] == 12 and rec[23] == pytest.approx(float(f64[0, 0]))  # numel, sum
    assert rec[28] == int(i64[0, 5])  # the fingerprint the copies delivered
    header, data = reader.payload(rec[30])
    raw = (zstandard.ZstdDecompressor().decompress(data, max_output_size=header["raw_nbytes"])
           if header["codec"] == "zstd" else data)
    assert raw == t.numpy().tobytes()


def test_a_payload_off_cuda_is_a_contiguous_copy_on_its_device():
    """Other accelerators keep a device copy that the sender moves (no event to wait on);
    "meta" stands for such a device."""
    t = torch.empty(6, 4, device="meta").t()
    copy = payload_copy(t)
    assert copy.device == t.device and copy.is_contiguous() and copy.shape == t.shape
