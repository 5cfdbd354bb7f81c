"""Which backend a store location names: a SQLite file path, or a ``postgresql://`` URL.

Everything that opens a store for writing goes through `open_writer`; readers construct
`auditor.store.Reader(location)`, which picks its backend the same way. psycopg is imported only
for a PostgreSQL location, so the embedded default needs no database driver.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

URL_PREFIXES = ("postgresql://", "postgres://")


def is_postgres_url(location: object) -> bool:
    return isinstance(location, str) and location.startswith(URL_PREFIXES)


def store_location(location: str | Path) -> str | Path:
    """A URL stays a string (Path() would fold its '//'); anything else is a Path."""
    if isinstance(location, Path):
        return location
    return location if is_postgres_url(location) else Path(location)


def describe(location: str | Path) -> str:
    """The location for logs and messages (a URL without its password)."""
    if is_postgres_url(location):
        from auditor.store.postgres import redact

        return redact(str(location))
    return str(location)


def open_writer(location: str | Path, *, synchronous: str = "FULL") -> Any:
    """The writer of a store: `StoreWriter` (one thread, group commit) for a SQLite path,
    `PgWriter` (a few connections, a transaction per item) for a PostgreSQL URL. Both offer
    `submit(work) -> Future` resolved after the commit, and `close()`."""
    if is_postgres_url(location):
        from auditor.store.postgres import PgWriter

        return PgWriter(str(location), synchronous=synchronous)
    from auditor.store.writer import StoreWriter

    return StoreWriter(location, synchronous=synchronous)
