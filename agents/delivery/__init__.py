"""Delivery: from host batches of digest rows to the wire, on the sender's own thread.

Owns the sender thread and all the agent's I/O (`sender`), records as columns straight from a
host batch (`columns`), the numbered, at-least-once delivery of one session's batches to the
next hop with resends, spool and drops (`delivery`), the transports to the auditor over gRPC or
to the node sidecar (`transport`) and the auditor's directives as the agent takes them from an
Ack (`directives`).

Hand-offs: it receives `HostBatch` es (`agents.digest.batching`) from the agent's sink, and
hands packed batches to the auditor or to the node sidecar (`agents.sidecar`, which relays them
with this package's `Delivery` and transports); accepted directives go to the op capture's inbox
that the agent gave the sender. It never imports the capture (tests/layout).
"""
