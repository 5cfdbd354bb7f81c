"""The wire contract beside the proto: what the agent and the auditor must agree on.

Owns the records' in-memory and wire forms (`packed`: columns; `record_form`: a message a record;
`batches`; `content_hash`), the gRPC limits and channel settings (`limits`), the batch checksum
(`checksum`), the spool file framing that the sidecar writes and `auditor ingest` reads (`spool`),
the digest's hash scheme that the agent computes and the auditor moves fingerprints with
(`hashing`), TLS settings (`tls`), the client channel helper (`channels`) and the package version
both sides report (`version`). It imports only `protos` and light libraries (grpc, protobuf, numpy),
never `agents` or `auditor`, so a training rank loads no daemon code.
"""
