"""Which backend a store location names, and its writer: `StoreWriter` for a SQLite path,
`PgWriter` for a ``postgresql://`` URL (`auditor.store.location`). Readers construct
`auditor.store.Reader(location)`, which picks its backend the same way. psycopg is imported only
for a PostgreSQL location, so the embedded default needs no database driver.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from numaudit.auditor.store.location import describe, is_postgres_url, store_location  # noqa: F401


def open_writer(location: str | Path, *, synchronous: str = "FULL") -> Any:
    """The writer of a store. Both kinds offer `submit(work) -> Future`, resolved after the
    transaction holding the work committed, and `close()`; a SQLite `StoreWriter` is one thread
    committing groups of work, a `PgWriter` a few connections with a transaction per item."""
    if is_postgres_url(location):
        from numaudit.auditor.store.postgres_writer import PgWriter

        return PgWriter(str(location), synchronous=synchronous)
    from numaudit.auditor.store.writer import StoreWriter

    return StoreWriter(location, synchronous=synchronous)
