"""The agent says which numaudit it is in every Register, and `auditor show` displays it."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import numaudit
from numaudit.auditor.cli import main
from numaudit.auditor.store import Reader
from numaudit.wire.version import package_version

pytestmark = pytest.mark.timeout(60)


def test_the_agents_version_reaches_the_store_and_show(auditor_server):
    agent = numaudit.attach(None, run="ref", address=auditor_server.address)
    with agent.step(0), agent.microbatch(0):
        agent.capture(torch.ones(3), site="x", phase="input")
    agent.close()
    reader = Reader(auditor_server.db_path)
    try:
        [session] = reader.sessions("ref")
    finally:
        reader.close()
    assert session["agent_version"] == package_version() != "unknown"
    shown = CliRunner().invoke(main, ["show", "ref", "--db", str(auditor_server.db_path),
                                      "--format", "json"])
    assert shown.exit_code == 0, shown.output
    assert [r["agent_version"] for r in json.loads(shown.output)["ranks"]] == [package_version()]
    text = CliRunner().invoke(main, ["show", "ref", "--address", auditor_server.address])
    assert text.exit_code == 0, text.output
    header, row = [line for line in text.output.splitlines() if line.startswith("rank")
                   or line.startswith("0 ")][:2]
    assert "agent" in header.split() and package_version() in row.split()
