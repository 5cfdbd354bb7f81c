"""Store locations: a SQLite file path, or a ``postgresql://`` URL. Imports nothing of numaudit, so
every module of the store (and the CLI) can ask which backend a location names."""

from __future__ import annotations

import re
from pathlib import Path

URL_PREFIXES = ("postgresql://", "postgres://")


def is_postgres_url(location: object) -> bool:
    return isinstance(location, str) and location.startswith(URL_PREFIXES)


def store_location(location: str | Path) -> str | Path:
    """A URL stays a string (Path() would fold its '//'); anything else is a Path."""
    if isinstance(location, Path):
        return location
    return location if is_postgres_url(location) else Path(location)


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    return re.sub(r"(://[^:/@]*):[^@]*@", r"\1:***@", url)


def describe(location: str | Path) -> str:
    """The location for logs and messages (a URL without its password)."""
    return redact(str(location)) if is_postgres_url(location) else str(location)
