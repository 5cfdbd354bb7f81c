"""Host copies of accelerator tensors that the training thread starts and never waits for.

A capture's payload is taken when its hook runs (the tensor may be changed in place after the
hook returns). On CUDA the copy goes straight into pinned host memory, asynchronously, on the
current stream: the capture's rows are on the device too, so it travels in a device batch whose
event (agents/digest/digest.py ``digest_batch_to_host``, recorded on the same stream when the batch
is flushed, after this copy) the sender thread waits on before it reads anything of the batch.
A device-to-host copy into pageable memory would instead wait for everything queued on the
device, on whichever thread made it: FIELD-NOTES measured 349 us per payload on an H200 (1,936
of them a step). Pinned buffers come from torch's caching host allocator, which reuses one only
once the copies recorded on it have run.

Other accelerators keep a device copy (their ``non_blocking`` copies have no event here to
wait on); the sender moves it.
"""

from __future__ import annotations

import torch


def payload_copy(t: torch.Tensor) -> torch.Tensor:
    """A C-contiguous copy of accelerator tensor ``t``, in pinned host memory on CUDA (filled
    asynchronously: read it only after an event recorded after this call on the current stream
    has completed), else on ``t``'s device."""
    if t.device.type != "cuda":
        return t.clone(memory_format=torch.contiguous_format)
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
