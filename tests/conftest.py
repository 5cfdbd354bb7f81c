"""Shared fixtures: a real auditor daemon on 127.0.0.1:0 over a fresh SQLite file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import grpc
import pytest
from hypothesis import settings

# Property tests draw the same examples on every run: a statistical band checked at 4 sigma fails
# by chance once in a few thousand fresh examples, and `make test` must never fail by chance.
# NUMAUDIT_HYPOTHESIS_PROFILE=explore draws fresh ones (for looking, not for CI).
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("NUMAUDIT_HYPOTHESIS_PROFILE", "ci"))

from wire import limits
from auditor.daemon.server import BackgroundServer
from protos import numaudit_pb2_grpc


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
