"""The auditor daemon: the gRPC service agents stream to and clients query.

Owns the grpc.aio server and its status mapping (`server`), validation of everything received
(`validate`; a record's layout: `validate_layout`; a batch's records as columns, vectorized:
`validate_columns`; what it raises: `errors`), tokens and the auth interceptor (`tokens`,
`auth`), the Compare/Watch RPCs
(`compare_service`) and spool replay through an in-process daemon (`replay`). It may import the
store, the comparison, the renderers and the wire contract; nothing below it imports the daemon.
"""
