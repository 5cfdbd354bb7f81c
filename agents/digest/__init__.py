"""Digests: on-device digests of captured pieces, gathered into host row batches.

Owns the digest scheme's torch side (`hashing`), the eager reference digest and the one
asynchronous device-to-host copy per batch (`digest`), the choice of implementation per capture
(`fastpath`: the fused kernel of `agents.kernels` when it can, the eager reference otherwise),
per-sample digests of batch-holding captures (`sample_digest`), the host row buffers the fused
kernel writes in place (`rows`), payload copies the training thread never waits for
(`device_copy`) and the queue of one hook's captures digested in one call (`batching`: the
`Batcher`, the `HostBatch` and the agent's `Counters`).

Hand-offs: it receives tensors and their `agents.layout.PieceLayout` from the capture
(`agents.capture`), on the training thread; it hands each flushed `HostBatch` to the sink the
capturer was given (the agent's, which submits it to the sender, `agents.delivery`). It imports
neither capture nor delivery (tests/layout); `agents.kernels` is its fused implementation.
"""
