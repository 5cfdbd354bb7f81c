"""Shared fixtures: a real auditor daemon on 127.0.0.1:0 over a fresh SQLite file."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest
import torch
from hypothesis import settings

from numaudit.auditor.daemon.server import BackgroundServer
from numaudit.protos import numaudit_pb2_grpc
from numaudit.wire import limits

if TYPE_CHECKING:
    from tests.pgserver import PgServer

# Property tests draw the same examples on every run: a statistical band checked at 4 sigma fails
# by chance once in a few thousand fresh examples, and `make test` must never fail by chance.
# NUMAUDIT_HYPOTHESIS_PROFILE=explore draws fresh ones (for looking, not for CI).
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("NUMAUDIT_HYPOTHESIS_PROFILE", "ci"))

if not torch.cuda.is_available():
    # The Triton digest's tests run under Triton's CPU interpreter here. Triton reads this when it
    # is first imported, and torch.compile's inductor imports it in earlier tests. (Neither torch
    # nor the daemon imported above imports Triton; this runs before any test module is imported.)
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="module")
def _environment_ends_with_its_module() -> Iterator[None]:
    """What a test module changes in os.environ is undone after it: later modules start torchrun
    jobs and daemons that inherit the environment. (test_layout's GLOO_SOCKET_IFNAME, left in
    it, made ranks of the DS3 reference job abort at exit in the e2e tests one time in six.)
    Changes made at import, as conftest's TRITON_INTERPRET above, stay for the whole session."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread for the test: float reductions are bit-stable only at a fixed thread
    count (FIELD-NOTES; torchrun jobs use 1), and small tensors gain nothing from a second
    thread that, on a busy machine, every op would wait to be scheduled."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def auditor_server(tmp_path: Path) -> Iterator[BackgroundServer]:
    """A running daemon (grpc.aio in a background thread); `.address`, `.db_path`."""
    with BackgroundServer("127.0.0.1:0", tmp_path / "audit.db", grace=1.0) as server:
        yield server


@pytest.fixture
def auditor_stub(auditor_server: BackgroundServer) -> Iterator[numaudit_pb2_grpc.AuditorStub]:
    """An Auditor stub on a channel to `auditor_server` (pass timeout= on every call)."""
    with grpc.insecure_channel(auditor_server.address, options=limits.client_options()) as channel:
        yield numaudit_pb2_grpc.AuditorStub(channel)


# -- A real PostgreSQL server (tests/pgserver.py) --------------------------------------------------

@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """One PostgreSQL 15 cluster for the whole test session, in a temporary directory.

    Fails (never skips) when PostgreSQL cannot start, unless NUMAUDIT_PG=skip says to skip."""
    from tests.pgserver import ENV_PG, PgServer, PgUnavailable

    if os.environ.get(ENV_PG, "").lower() == "skip":
        pytest.skip(f"{ENV_PG}=skip: PostgreSQL tests skipped on request")
    try:
        server = PgServer().start()
    except (PgUnavailable, OSError, Exception) as exc:
        pytest.fail(f"PostgreSQL tests need a PostgreSQL server and none could start: {exc} "
                    f"(set {ENV_PG}=skip to skip them explicitly)", pytrace=False)
    try:
        yield server
    finally:
        server.destroy()


@pytest.fixture
def pg_url(pg_server) -> Iterator[str]:
    """The URL of a fresh, empty database on `pg_server` (dropped after the test)."""
    url = pg_server.new_database()
    yield url
    pg_server.drop_database(url)


@pytest.fixture(params=["sqlite", "postgres"])
def store_location(request, tmp_path: Path) -> str | Path:
    """A store location on each backend: a SQLite file path, then a PostgreSQL URL."""
    if request.param == "sqlite":
        return tmp_path / "audit.db"
    return request.getfixturevalue("pg_url")
