"""What the store's SQL code needs of a connection, as types: a `sqlite3.Connection` and a
`postgres.QmarkConnection` (SQLite-style SQL on psycopg) both are a `SqlConnection`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol


class Rows(Protocol):
    """A cursor after `execute`: DB-API rows (a row is a tuple; `fetchone` None past the end)."""

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...

    def __next__(self) -> Any: ...


class SqlConnection(Protocol):
    def execute(self, sql: str, params: Any = ..., /) -> Rows: ...

    def close(self) -> None: ...


def one(rows: Any) -> tuple:
    """The row of a query that always returns one (an aggregate, a lookup of a row known to be
    there): `rows.fetchone()`, which is None only past the end."""
    row = rows.fetchone()
    assert row is not None, "the query returned no row"
    return row
