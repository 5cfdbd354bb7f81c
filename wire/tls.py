"""TLS settings for both ends of the agent-daemon connection: PEM files named by the user.

The daemon serves TLS with `ServerTLS` (and requires client certificates when it is given a
client CA: mutual TLS); every client (agent, CLI, spool replay) dials with a `TLSConfig` through
`wire.channels.open_channel`. Files are read when credentials are built, and an unreadable
file raises `TLSError` naming the option and the path, never a gRPC internal error.
docs/security.md shows how to make the files with openssl.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


class TLSError(ValueError):
    """A certificate or key file that cannot be used; the message names the option and file."""


def read_pem(path: str | Path, what: str) -> bytes:
    """The bytes of a PEM file; TLSError naming `what` (e.g. "tls-ca") when it cannot be read."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TLSError(f"{what}: cannot read {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise TLSError(f"{what}: {path} is not a PEM file")
    return data


def check_key_pair(cert: str | Path, key: str | Path, what: str) -> None:
    """TLSError when `key` is not the private key of `cert` (or either is unusable), found by
    Python's ssl before gRPC sees the files: gRPC's C core would print its own error lines to
    stderr first."""
    import ssl

    read_pem(cert, f"{what}-cert")
    read_pem(key, f"{what}-key")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(str(cert), str(key))
    except ssl.SSLError as exc:
        why = "does not match the certificate" if "MISMATCH" in str(exc).upper() \
            else f"cannot be used with it ({exc.reason or exc})"
        raise TLSError(f"{what}-key: {key} {why} {cert}") from None
    except OSError as exc:
        raise TLSError(f"{what}-cert/{what}-key: cannot load {cert} and {key}: "
                       f"{exc.strerror or exc}") from None


@dataclass(frozen=True)
class TLSConfig:
    """How a client dials the daemon over TLS."""

    ca: str | None = None
    """PEM file of the CA(s) that signed the daemon's certificate; None = the system's roots."""
    cert: str | None = None
    """PEM client certificate, for a daemon that requires mutual TLS (with `key`)."""
    key: str | None = None
    """PEM private key of `cert`."""

    @classmethod
    def from_files(cls, ca: str | Path | None = None, cert: str | Path | None = None,
                   key: str | Path | None = None) -> TLSConfig | None:
        """None when no file is named (plaintext); TLSError when cert and key are not a pair."""
        if not (ca or cert or key):
            return None
        if bool(cert) != bool(key):
            raise TLSError("tls-cert/tls-key: a client certificate needs its key, and a key its "
                           "certificate")
        return cls(str(ca) if ca else None, str(cert) if cert else None,
                   str(key) if key else None)

    def credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials from the files (read now)."""
        if self.cert and self.key:
            check_key_pair(self.cert, self.key, "tls")
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.ca, "tls-ca") if self.ca else None,
            private_key=read_pem(self.key, "tls-key") if self.key else None,
            certificate_chain=read_pem(self.cert, "tls-cert") if self.cert else None,
        )


@dataclass(frozen=True)
class ServerTLS:
    """How the daemon serves TLS (`auditor serve --tls-cert --tls-key [--tls-client-ca]`)."""

    cert: str
    """PEM certificate chain of the daemon; its subjectAltName names the host clients dial."""
    key: str
    """PEM private key of `cert`."""
    client_ca: str | None = None
    """PEM CA(s) whose client certificates are accepted; set = mutual TLS, certificates required."""

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def credentials(self) -> grpc.ServerCredentials:
        """gRPC server credentials from the files (read now)."""
        check_key_pair(self.cert, self.key, "tls")
        return grpc.ssl_server_credentials(
            [(read_pem(self.key, "tls-key"), read_pem(self.cert, "tls-cert"))],
            root_certificates=read_pem(self.client_ca, "tls-client-ca") if self.client_ca else None,
            require_client_auth=self.mutual,
        )
