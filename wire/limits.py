"""gRPC limits and settings that the agent and the auditor daemon must agree on.

One module, imported by both sides (it must stay free of torch and of anything heavy), so that
message sizes, keepalive pings and schema versions cannot drift apart. docs/protocol.md explains
each figure; change them here only.

Keepalive (FIELD-NOTES: a client that pings more often than the server permits is sent GOAWAY
`too_many_pings`): the agent pings every `CLIENT_KEEPALIVE_TIME_MS`; the server accepts pings as
often as every `SERVER_MIN_PING_INTERVAL_MS`, which is shorter, and accepts them on idle
connections too. The assertion at the bottom keeps it that way.
"""

from __future__ import annotations

# -- Addresses ---------------------------------------------------------------------------------

DEFAULT_PORT = 50551
"""Port `auditor serve` listens on and the agent dials when no address is given."""
DEFAULT_LISTEN = f"127.0.0.1:{DEFAULT_PORT}"
"""Without TLS the daemon binds loopback unless told otherwise."""

# -- Schema ------------------------------------------------------------------------------------

SUPPORTED_SCHEMA_VERSIONS: tuple[int, ...] = (1,)
"""`schema_version` values the daemon accepts (numaudit.v1 SchemaVersion numbers)."""
CURRENT_SCHEMA_VERSION = 1
"""What an agent of this build sends."""

# -- Message sizes -----------------------------------------------------------------------------

MAX_MESSAGE_BYTES = 64 << 20
"""Largest serialized message either side sends or accepts (gRPC's default is only 4 MiB).
A larger one is refused by gRPC itself with RESOURCE_EXHAUSTED."""
PAYLOAD_CHUNK_BYTES = 4 << 20
"""The agent splits a compressed payload stream into chunks of at most this many bytes."""
MAX_BATCH_RECORDS = 4096
"""Records in one RecordBatch."""
MAX_BATCH_PAYLOAD_BYTES = 48 << 20
"""Sum of payload.data lengths in one RecordBatch (keeps room under MAX_MESSAGE_BYTES)."""
MAX_PAYLOAD_RAW_BYTES = 1 << 30
"""Largest decompressed payload of one record; larger pieces travel without payload."""
MAX_BATCH_RAW_BYTES = 1 << 30
"""Bytes the daemon decompresses to verify one batch's payloads (CPU and time bound)."""
MAX_ZSTD_WINDOW_BYTES = 1 << 27
"""Largest zstd window accepted (zstd's own default decoder limit; levels <= 19 stay under it).
A frame's window is what the decoder must allocate, so it is checked before decompressing."""
DECOMPRESS_READ_BYTES = 1 << 20
"""Decompression reads this much at a time, so memory never follows an untrusted size."""

# -- Field bounds ------------------------------------------------------------------------------

MAX_WORLD_SIZE = 1 << 20
MAX_RUN_NAME_CHARS = 128
MAX_SESSION_ID_CHARS = 64
MAX_SITE_CHARS = 512
MAX_TENSOR_DIMS = 64
MAX_SKETCH_BUCKETS = 65536
MAX_SAMPLE_UNITS = 4096
"""Units of one record's sample digests (the agent sends at most 16)."""
MAX_SAMPLE_VALUES = 1 << 20
"""Values of one record's sample digests: units x (5 + sketch_k)."""
MAX_LABELS = 64
MAX_LABEL_CHARS = 1024
MAX_TEXT_CHARS = 256
"""torch_version, dtype, host, mesh dim names, drop reasons."""
MAX_STAGES = 4096
MAX_DROP_REASONS = 64

# Directives (Ack.directives, `auditor watch --escalate`): the daemon sends nothing beyond these,
# and an agent drops a directive that breaks them.
MAX_DIRECTIVE_GLOBS = 16
"""Module-site globs (`Directive.ops`), and payload globs, of one directive."""
MAX_DIRECTIVE_GLOB_CHARS = 512
MAX_DIRECTIVE_REASON_CHARS = 1024
MAX_DIRECTIVES_PER_RUN = 8
"""Directives the daemon keeps for one run (newest kept); each reaches every session of it."""
DIRECTIVE_TTL_S = 600.0
"""A directive not delivered within this long is dropped (its step is long past)."""

# Key ranges: the comparison engine packs a key into two int64s (auditor/compare/read/columns.py:
# step << 24 | (microbatch + 1) << 4 | phase, and site << 32 | role << 28 | index << 14 | call),
# so the daemon refuses (INVALID_ARGUMENT) any record it could store but never compare.
MAX_KEY_STEP = (1 << 39) - 1
"""Largest `Key.step`."""
MAX_KEY_MICROBATCH = (1 << 20) - 2
"""Largest `Key.microbatch` (microbatch + 1 takes 20 bits)."""
MAX_KEY_INDEX = (1 << 14) - 1
"""Largest `Key.index`."""
MAX_KEY_CALL = (1 << 14) - 1
"""Largest `Key.call`."""
MAX_RECORD_STAGE = (1 << 31) - 2
"""Largest `Record.stage` (stage + 1 takes 31 bits)."""
MAX_CAPTURE_ORDER = 1 << 53
"""Largest `Record.capture_order`: the comparison orders keys by it as a float64, exact up to
here (an agent numbering a million captures a second takes 285 years to reach it)."""

# -- Status details both sides read ------------------------------------------------------------

BUSY_PREFIX = "busy: "
"""Starts the details of a RESOURCE_EXHAUSTED that means "the daemon is at a capacity cap, try
again later" (streams, watches, compares, bytes in flight), as opposed to "this batch is too
large", which is final for that batch. Senders back off and resend; they never drop for it."""

ENDED_PREFIX = "ended: "
"""Starts the details of an UNAVAILABLE that means "the daemon ended this Ingest stream" (idle,
or its receive slot or its place under the stream cap was wanted by another stream): the daemon
is up and answered. Senders keep what is unacked and open a new stream at once; it is not an
outage (no backoff, no "cannot reach" warning)."""

# -- Keepalive and timing ------------------------------------------------------------------------

CLIENT_KEEPALIVE_TIME_MS = 30_000
"""The agent pings an idle connection this often to notice a dead auditor."""
CLIENT_KEEPALIVE_TIMEOUT_MS = 10_000
"""...and gives the connection up when a ping is not answered within this."""
SERVER_KEEPALIVE_TIME_MS = 60_000
"""The daemon pings idle agents this often to reap dead connections."""
SERVER_KEEPALIVE_TIMEOUT_MS = 20_000
SERVER_MIN_PING_INTERVAL_MS = 10_000
"""The daemon tolerates client pings this often (must be <= CLIENT_KEEPALIVE_TIME_MS)."""
CLIENT_RECONNECT_BACKOFF_MIN_MS = 50
CLIENT_RECONNECT_BACKOFF_MAX_MS = 250
"""A channel to a dead auditor tries again at most every 250 ms (4 attempts/s per rank)."""
SHUTDOWN_GRACE_S = 5.0
"""On SIGTERM the daemon stops accepting, lets in-flight calls finish this long, then flushes."""
VALIDATION_THREADS = 2
"""Threads that validate batches (and decompress payloads) off the event loop."""

assert SERVER_MIN_PING_INTERVAL_MS <= CLIENT_KEEPALIVE_TIME_MS, "clients would get too_many_pings"
assert MAX_BATCH_PAYLOAD_BYTES < MAX_MESSAGE_BYTES
assert PAYLOAD_CHUNK_BYTES <= MAX_BATCH_PAYLOAD_BYTES


def _common_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]


def server_options() -> list[tuple[str, int]]:
    """Channel arguments for the daemon's grpc.aio.server."""
    return _common_options() + [
        ("grpc.keepalive_time_ms", SERVER_KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", SERVER_KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", SERVER_MIN_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", 0),  # 0 = never GOAWAY for pings
        ("grpc.so_reuseport", 0),  # port 0 must mean a port of our own
        # A stream whose handler has not asked for a message is held to the 64 KiB stream window
        # (BDP probing would grow it): what the daemon receives is bounded by its receive slots
        # (auditor/daemon/receive_slots.py). A read still opens the window to the whole message.
        ("grpc.http2.bdp_probe", 0),
    ]


def client_options() -> list[tuple[str, int]]:
    """Channel arguments for agents (and CLI clients) dialing the daemon."""
    return _common_options() + [
        ("grpc.keepalive_time_ms", CLIENT_KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", CLIENT_KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # 0 = no limit while a stream is idle
        # gRPC's own reconnect backoff (1 s, x1.6, up to 120 s) would decide when a restarted
        # auditor is reached again; keep it short so a restart is resumed within about a second.
        ("grpc.initial_reconnect_backoff_ms", CLIENT_RECONNECT_BACKOFF_MIN_MS),
        ("grpc.min_reconnect_backoff_ms", CLIENT_RECONNECT_BACKOFF_MIN_MS),
        ("grpc.max_reconnect_backoff_ms", CLIENT_RECONNECT_BACKOFF_MAX_MS),
    ]
