"""A throwaway CA, a daemon certificate and client certificates, made with the openssl CLI.

The commands are the ones docs/security.md shows (EC P-256 keys: fast to make), so the tests
prove the documented recipe works with gRPC.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

DAYS = "2"


@dataclass(frozen=True)
class PKI:
    ca: Path
    """CA certificate (trusted by clients for the daemon, by the daemon for clients)."""
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path
    """A self-signed client certificate no CA vouches for."""
    rogue_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _key(name: str, cwd: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-out", name, cwd=cwd)


def _signed(name: str, subject: str, extensions: str, cwd: Path) -> None:
    _key(f"{name}.key", cwd)
    _openssl("req", "-new", "-key", f"{name}.key", "-subj", subject, "-out", f"{name}.csr", cwd=cwd)
    (cwd / f"{name}.ext").write_text(extensions)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", DAYS, "-extfile", f"{name}.ext", "-out", f"{name}.crt",
             cwd=cwd)


def make_pki(directory: Path) -> PKI:
    """Writes the files into `directory` (skips the calling test when openssl is missing)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to make test certificates")
    d = directory
    _key("ca.key", d)
    _openssl("req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=numaudit test CA",
             "-days", DAYS, "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", "-out", "ca.crt", cwd=d)
    _signed("server", "/CN=numaudit-auditor",
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n", d)
    _signed("client", "/CN=rank-agents", "extendedKeyUsage=clientAuth\n", d)
    _key("rogue.key", d)
    _openssl("req", "-x509", "-new", "-key", "rogue.key", "-subj", "/CN=rogue", "-days", DAYS,
             "-out", "rogue.crt", cwd=d)
    return PKI(d / "ca.crt", d / "server.crt", d / "server.key", d / "client.crt",
               d / "client.key", d / "rogue.crt", d / "rogue.key")
