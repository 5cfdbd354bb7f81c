"""A real PostgreSQL server for the tests: initdb + pg_ctl into a temporary directory.

One server per test session (`PgServer.start`), a fresh database per test (`new_database`). The
server listens on 127.0.0.1 on a free port and on a unix socket inside its own directory, so
nothing else on the machine is touched. PostgreSQL refuses to run as root: when the tests run as
root, initdb and pg_ctl run as the `postgres` user (`runuser`), in a directory it owns.

NUMAUDIT_PG=skip skips the PostgreSQL tests explicitly; otherwise a server that cannot start
fails them with the reason (a missing PostgreSQL never passes silently).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

ENV_PG = "NUMAUDIT_PG"          # "skip": skip the PostgreSQL tests instead of failing them
ENV_PG_BIN = "NUMAUDIT_PG_BIN"  # directory of initdb/pg_ctl (default: found on PATH or in
                                # /usr/lib/postgresql/*/bin)


class PgUnavailable(RuntimeError):
    """PostgreSQL could not be started here; the message says why and what to install."""


def find_bindir() -> Path:
    configured = os.environ.get(ENV_PG_BIN)
    candidates = [configured] if configured else []
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(str(Path(on_path).resolve().parent))
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for c in candidates:
        if c and (Path(c) / "initdb").exists() and (Path(c) / "pg_ctl").exists():
            return Path(c)
    raise PgUnavailable("no PostgreSQL server binaries (initdb, pg_ctl) found: install them "
                        "(`apt-get install -y postgresql`, which the Makefile's test "
                        f"prerequisites do) or set {ENV_PG_BIN}; {ENV_PG}=skip skips these tests")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgServer:
    """A throwaway PostgreSQL cluster. `url(dbname)` gives a libpq URL for a database in it."""

    def __init__(self, root: Path | None = None) -> None:
        self.bindir = find_bindir()
        self.root = Path(root or tempfile.mkdtemp(prefix="numaudit-pg-"))
        self.data = self.root / "data"
        self.sock = self.root / "sock"
        self.port = 0
        self._as_user: list[str] = []
        self._user = "postgres"
        if os.geteuid() == 0:
            try:
                pw = pwd.getpwnam("postgres")
            except KeyError:
                raise PgUnavailable("running as root and there is no `postgres` user to run "
                                    "PostgreSQL as (PostgreSQL refuses root)") from None
            self._as_user = ["runuser", "-u", "postgres", "--"]
            os.chmod(self.root, 0o755)
            self.sock.mkdir(exist_ok=True)
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
            os.chown(self.sock, pw.pw_uid, pw.pw_gid)
        else:
            self._user = pwd.getpwuid(os.geteuid()).pw_name
            self.sock.mkdir(exist_ok=True)

    def _run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        cmd = self._as_user + [str(self.bindir / args[0]), *args[1:]]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise PgUnavailable(f"{' '.join(cmd)} failed ({proc.returncode}): "
                                f"{(proc.stderr or proc.stdout).strip()[-2000:]}")
        return proc

    def start(self) -> PgServer:
        if not self.data.exists():
            self._run("initdb", "-D", str(self.data), "-U", self._user, "--auth=trust",
                      "-E", "UTF8", "--locale=C", "--no-sync")
        if not self.port:
            self.port = free_port()
        opts = (f"-c listen_addresses=127.0.0.1 -p {self.port}"
                f" -c unix_socket_directories={self.sock}"
                " -c max_connections=200 -c fsync=on -c shared_buffers=128MB")
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.root / "log"),
                  "-w", "-t", "60", "start")
        return self

    def stop(self, mode: str = "fast") -> None:
        if self.data.exists():
            subprocess.run(self._as_user + [str(self.bindir / "pg_ctl"), "-D", str(self.data),
                                            "-m", mode, "-w", "stop"],
                           capture_output=True, timeout=120)

    def restart(self, down_s: float = 0.0) -> None:
        """Stop (fast: connections are cut) and start again on the same port."""
        self.stop("fast")
        time.sleep(down_s)
        self.start()

    def destroy(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{self._user}@127.0.0.1:{self.port}/{dbname}"

    def new_database(self) -> str:
        """A fresh empty database; returns its URL."""
        import psycopg

        name = "t_" + uuid.uuid4().hex[:16]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, url: str) -> None:
        import psycopg

        name = url.rsplit("/", 1)[1]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
