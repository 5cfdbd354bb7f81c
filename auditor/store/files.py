"""Which files are numaudit stores: the application id, and the checks made before opening one.

A numaudit store carries `PRAGMA application_id = APPLICATION_ID`. Every path given as a store
is checked before SQLite opens it (`check_store_file`), so a command given random bytes, a text
file, a FIFO, /dev/null or another application's SQLite file says so in one line and leaves the
file untouched.
"""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path

from numaudit.auditor.store.errors import StoreError

APPLICATION_ID = 0x6E756D61  # "numa"
"""`PRAGMA application_id` of every numaudit store. A SQLite file with another id, or with none
and no numaudit schema, belongs to another application and is refused untouched."""
_SQLITE_MAGIC = b"SQLite format 3\x00"


class NotAStore(StoreError):
    """A path that is not a numaudit store (and, for writing, not a place to create one); the
    message is one line naming the path."""


def check_store_file(path: str | Path, *, create: bool) -> None:
    """NotAStore unless `path` is a numaudit store, or (`create`) a new file in an existing
    directory. Reads at most the header and two pragmas: never changes the file, never opens
    anything but a regular file (a FIFO or a device would block or lie)."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        if not create:
            raise NotAStore(f"db: no store at {path}") from None
        if not p.parent.is_dir():
            raise NotAStore(f"db: directory {p.parent} does not exist") from None
        return
    except OSError as exc:
        raise NotAStore(f"db: cannot use {path} ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise NotAStore(f"db: {path} is not a regular file")
    if st.st_size == 0:
        if create:
            return
        raise NotAStore(f"db: {path} is empty, not a numaudit store")
    try:
        with open(p, "rb") as f:
            magic = f.read(len(_SQLITE_MAGIC))
    except OSError as exc:
        raise NotAStore(f"db: cannot read {path} ({exc.strerror or exc})") from None
    if magic != _SQLITE_MAGIC:
        raise NotAStore(f"db: {path} is not a SQLite file, so not a numaudit store")
    try:
        conn = sqlite3.connect(f"file:{p.resolve()}?mode=ro", uri=True, timeout=30)
        try:
            app_id = conn.execute("PRAGMA application_id").fetchone()[0]
            has_meta = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND"
                                    " name = 'meta'").fetchone() is not None
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise NotAStore(f"db: {path} cannot be read as SQLite ({exc})") from None
    if app_id == APPLICATION_ID or (app_id == 0 and has_meta):  # 0: a store from before ids
        return
    owner = f"application_id {app_id:#x}" if app_id else "no numaudit schema"
    raise NotAStore(f"db: {path} is another application's SQLite file ({owner}); "
                    "refusing to touch it")


STORE_MODE = 0o600
"""Mode of a store file numaudit creates: the records and runs in it are readable by whoever can
read the file, whatever the daemon's tokens say (its -wal and -shm files take the same mode:
SQLite creates them with the database file's permissions)."""


def create_private(path: str | Path) -> None:
    """Create `path` empty with mode 0600 (whatever the umask) when it does not exist yet, so
    that SQLite then fills it; an existing file is left as it is."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, STORE_MODE)
    except FileExistsError:
        return
    try:
        os.fchmod(fd, STORE_MODE)  # the umask may have taken bits away, never added
    finally:
        os.close(fd)


def readable_by_others(path: str | Path) -> bool:
    """Whether the store file at `path` can be read by users other than its owner."""
    try:
        return bool(os.stat(path).st_mode & (stat.S_IRGRP | stat.S_IROTH))
    except OSError:
        return False
