"""The daemon's token file (`auditor serve --tokens FILE`): who may write and read which runs.

    [[token]]
    name = "ref-agents"              # shown in logs and errors; never the secret
    sha256 = "<64 hex digits: printf %s TOKEN | sha256sum>"
    write = ["ref", "ref-*"]         # Register, Ingest, CloseSession on these runs
    read = ["*"]                     # ListRuns, DescribeRun, Compare, Watch on these runs
    escalate = ["ref", "cand-*"]     # watch --escalate: ask these runs' agents for op captures

    [[token]]
    name = "ops"
    token = "a-plaintext-secret-of-16-or-more-characters"
    admin = true                     # read and write every run

Each entry gives the secret once, as `sha256` (hex digest of the token, so the file holds no
secret) or as `token` (plaintext). In memory only the SHA-256 digest is kept; a presented token is
hashed and compared with every entry's digest by `hmac.compare_digest`, without stopping at a
match, so the time taken says nothing about which entry matched or how much of it. Run globs are
`fnmatch` patterns matched case-sensitively on the whole run name. docs/security.md is the
reference.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import os
import re
import stat
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

READ, WRITE, ESCALATE = "read", "write", "escalate"
_NAME = re.compile(r"[A-Za-z0-9._@:-]{1,64}")
_GLOB = re.compile(r"[A-Za-z0-9._*?\[\]!-]{1,256}")
_HEX_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 4096
_ENTRY_KEYS = {"name", "token", "sha256", READ, WRITE, ESCALATE, "admin"}


class TokenFileError(ValueError):
    """The token file cannot be used; the message names the file and the entry, never a secret."""


def token_digest(token: str) -> bytes:
    """What is stored and compared: SHA-256 of the token's UTF-8 bytes."""
    return hashlib.sha256(token.encode("utf-8")).digest()


@dataclass(frozen=True)
class Grant:
    """One token's rights, as the file gave them (the digest stands in for the secret)."""

    name: str
    """Label from the file, used in logs and error details."""
    digest: bytes
    """SHA-256 of the token."""
    read: tuple[str, ...] = ()
    """Globs of run names this token may read."""
    write: tuple[str, ...] = ()
    """Globs of run names this token may write."""
    admin: bool = False
    """Read and write every run (and whatever management RPCs come later)."""
    escalate: tuple[str, ...] = ()
    """Globs of run names whose agents this token may send directives to (`auditor watch
    --escalate`: op-level captures at a step the auditor names; docs/drill-down.md)."""

    def __repr__(self) -> str:  # keeps the digest out of logs and tracebacks
        return (f"Grant(name={self.name!r}, read={self.read!r}, write={self.write!r}, "
                f"escalate={self.escalate!r}, admin={self.admin})")

    def _globs(self, scope: str) -> tuple[str, ...]:
        return {READ: self.read, WRITE: self.write, ESCALATE: self.escalate}[scope]

    def has(self, scope: str) -> bool:
        """True when the token holds `scope` on some run."""
        return self.admin or bool(self._globs(scope))

    def may(self, scope: str, run: str) -> bool:
        """True when the token holds `scope` on `run`."""
        if self.admin:
            return True
        return any(fnmatch.fnmatchcase(run, g) for g in self._globs(scope))


class Tokens:
    """The grants of one token file; `identify` finds the grant of a presented token."""

    def __init__(self, grants: Iterable[Grant], source: str = "") -> None:
        self.grants = tuple(grants)
        self.source = source

    def __len__(self) -> int:
        return len(self.grants)

    def identify(self, token: str) -> Grant | None:
        """The grant whose digest matches `token`, compared in constant time; None if none does."""
        digest = token_digest(token)
        found = None
        for grant in self.grants:  # no early exit: every entry is compared
            if hmac.compare_digest(digest, grant.digest):
                found = grant
        return found

    @classmethod
    def load(cls, path: str | Path) -> Tokens:
        """Parse a token file; TokenFileError naming the file and entry for anything wrong."""
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise TokenFileError(f"tokens: cannot read {path}: {exc.strerror or exc}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise TokenFileError(f"tokens: {path}: not valid TOML: {exc}") from None
        return cls.parse(data, str(path))

    @classmethod
    def parse(cls, data: dict[str, Any], source: str = "<tokens>") -> Tokens:
        extra = set(data) - {"token"}
        if extra:
            raise TokenFileError(f"tokens: {source}: unknown top-level key(s) {sorted(extra)}; "
                                 "entries are [[token]] tables")
        entries = data.get("token", [])
        if not isinstance(entries, list) or not entries:
            raise TokenFileError(f"tokens: {source}: no [[token]] entries")
        grants: list[Grant] = []
        seen: dict[bytes, str] = {}
        names: set[str] = set()
        for i, entry in enumerate(entries):
            grant = _parse_entry(entry, f"tokens: {source}: token[{i}]")
            where = f"tokens: {source}: token[{i}] ({grant.name})"
            if grant.name in names:
                raise TokenFileError(f"{where}: name: used by an earlier entry")
            if grant.digest in seen:
                raise TokenFileError(f"{where}: the same token as entry {seen[grant.digest]!r}")
            names.add(grant.name)
            seen[grant.digest] = grant.name
            grants.append(grant)
        return cls(grants, source)


def holds_plaintext(path: str | Path) -> bool:
    """True when some entry gives its secret as `token` (then the file must not be readable by
    other users)."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return any(isinstance(e, dict) and "token" in e for e in data.get("token", []))


def readable_by_others(path: str | Path) -> bool:
    return bool(os.stat(path).st_mode & (stat.S_IRGRP | stat.S_IROTH))


def _parse_entry(entry: Any, where: str) -> Grant:
    if not isinstance(entry, dict):
        raise TokenFileError(f"{where}: must be a table")
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise TokenFileError(f"{where}: name: required, 1-64 of [A-Za-z0-9._@:-]")
    where = f"{where} ({name})"
    unknown = set(entry) - _ENTRY_KEYS
    if unknown:
        raise TokenFileError(f"{where}: unknown key(s) {sorted(unknown)}; known: "
                             f"{', '.join(sorted(_ENTRY_KEYS))}")
    if ("token" in entry) == ("sha256" in entry):
        raise TokenFileError(f"{where}: give exactly one of token (plaintext) or sha256 "
                             "(hex digest)")
    if "token" in entry:
        secret = entry["token"]
        # The message never repeats the value: it may be a real secret with a typo.
        if not isinstance(secret, str) or not MIN_TOKEN_CHARS <= len(secret) <= MAX_TOKEN_CHARS:
            raise TokenFileError(f"{where}: token: must be a string of {MIN_TOKEN_CHARS} to "
                                 f"{MAX_TOKEN_CHARS} characters")
        if not all("!" <= c <= "~" for c in secret):
            raise TokenFileError(f"{where}: token: only printable ASCII without spaces (it travels "
                                 "in an HTTP header)")
        digest = token_digest(secret)
    else:
        hexdigest = entry["sha256"]
        if not isinstance(hexdigest, str) or not _HEX_SHA256.fullmatch(hexdigest):
            raise TokenFileError(f"{where}: sha256: must be 64 hex digits (sha256sum of the token)")
        digest = bytes.fromhex(hexdigest)
    scopes = {}
    for scope in (READ, WRITE, ESCALATE):
        globs = entry.get(scope, [])
        if isinstance(globs, str):
            globs = [globs]
        if not isinstance(globs, list) or not all(isinstance(g, str) and _GLOB.fullmatch(g)
                                                  for g in globs):
            raise TokenFileError(f"{where}: {scope}: must be a list of run-name globs "
                                 "(run-name characters and * ? [ ] !)")
        scopes[scope] = tuple(globs)
    admin = entry.get("admin", False)
    if not isinstance(admin, bool):
        raise TokenFileError(f"{where}: admin: must be true or false")
    if not (admin or scopes[READ] or scopes[WRITE] or scopes[ESCALATE]):
        raise TokenFileError(f"{where}: grants nothing: give read, write, escalate or "
                             "admin = true")
    return Grant(name, digest, scopes[READ], scopes[WRITE], admin, scopes[ESCALATE])
