"""The one way to dial the auditor daemon: `open_channel`, used by the agent, the CLI and replay.

With TLS the bearer token travels as call credentials composed with the SSL credentials (gRPC
refuses call credentials on a plaintext channel, FIELD-NOTES). Without TLS it travels as
`authorization: Bearer ...` metadata added by a client interceptor, which leaves calls that
already carry an `authorization` entry alone. Limits and keepalive come from `wire.limits`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from numaudit.wire import limits
from numaudit.wire.tls import TLSConfig

# Environment of the CLI clients (`auditor runs/show/compare --address`); arguments win. The agent
# reads the same variables through agents/config.py.
ENV_TOKEN = "NUMAUDIT_TOKEN"        # bearer token (never logged)
ENV_TLS_CA = "NUMAUDIT_TLS_CA"      # PEM CA that signed the daemon's certificate
ENV_TLS_CERT = "NUMAUDIT_TLS_CERT"  # PEM client certificate (mutual TLS)
ENV_TLS_KEY = "NUMAUDIT_TLS_KEY"    # PEM key of the client certificate


def tls_from_env_files(env: Mapping[str, str] | None = None
                       ) -> tuple[str | None, str | None, str | None]:
    """(ca, cert, key) named by NUMAUDIT_TLS_CA/CERT/KEY, None for each unset."""
    env = os.environ if env is None else env
    ca, cert, key = (env.get(name) or None for name in (ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY))
    return ca, cert, key


def tls_from_env(env: Mapping[str, str] | None = None) -> TLSConfig | None:
    """TLSConfig from NUMAUDIT_TLS_CA/CERT/KEY; None (plaintext) when none is set."""
    return TLSConfig.from_files(*tls_from_env_files(env))


def token_from_env(env: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if env is None else env
    return env.get(ENV_TOKEN) or None


def channel_target(address: str) -> tuple[str, list[tuple[str, Any]]]:
    """The gRPC target of `address`, and the channel options it needs.

    "HOST:PORT" is dialed as is. Several replicas of the daemon (on one PostgreSQL store) are
    listed comma-separated as IP:PORT ("10.0.0.1:50051,10.0.0.2:50051", IPv6 as "[::1]:50051"):
    the channel resolves all of them and spreads calls round robin (gRPC's client-side load
    balancing), skipping a replica that is down. Agents do not use this for such a list: each
    dials one replica at a time and moves on at a failure
    (`agents.delivery.transport.GrpcTransport`), since round robin could send a new stream back to a
    replica that hangs. A gRPC target URI ("dns:///auditors.example:50051") also gets round robin.
    """
    parts = [p.strip() for p in address.split(",") if p.strip()]
    round_robin = [("grpc.lb_policy_name", "round_robin")]
    if len(parts) > 1:
        scheme = "ipv6" if all(p.startswith("[") for p in parts) else "ipv4"
        return f"{scheme}:{','.join(parts)}", round_robin
    if address.startswith(("dns:", "ipv4:", "ipv6:")):
        return address, round_robin
    return address, []


def open_channel(address: str, *, tls: TLSConfig | None = None, token: str | None = None,
                 options: Sequence[tuple[str, Any]] | None = None) -> grpc.Channel:
    """A synchronous channel to the daemon at `address` ("HOST:PORT", or several replicas:
    `channel_target`).

    `tls` None = plaintext (keep it on loopback). Raises TLSError when a certificate file cannot
    be read; connection failures show up on the first call, as for any gRPC channel.
    """
    address, balancing = channel_target(address)
    options = list(limits.client_options() if options is None else options) + balancing
    if tls is not None:
        creds = tls.credentials()
        if token:
            creds = grpc.composite_channel_credentials(
                creds, grpc.access_token_call_credentials(token))
        return grpc.secure_channel(address, creds, options=options)
    channel = grpc.insecure_channel(address, options=options)
    if token:
        channel = grpc.intercept_channel(channel, _BearerMetadata(token))
    return channel


class _BearerMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                      grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer TOKEN` to every call on a plaintext channel."""

    def __init__(self, token: str) -> None:
        self._entry = ("authorization", f"Bearer {token}")

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = list(details.metadata or ())
        if any(k.lower() == "authorization" for k, _ in metadata):
            return details
        return _CallDetails(details.method, details.timeout, tuple(metadata) + (self._entry,),
                            details.credentials, details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = (credentials, wait_for_ready,
                                                                   compression)
