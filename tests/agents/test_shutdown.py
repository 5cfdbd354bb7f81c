"""agents/shutdown.py in a real process: the SIGTERM watcher takes Python's wakeup fd without
taking it from an asyncio loop set up before `attach` (tests/agents/signal_job.py). The exit
and SIGTERM cases themselves are in tests/faults/test_training_exit.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def test_an_asyncio_loops_signal_handler_still_runs_after_attach():
    env = dict(os.environ, PYTHONPATH=str(ROOT), NUMAUDIT_ADDR="127.0.0.1:1",
               NUMAUDIT_RUN="signals", NUMAUDIT_SPOOL_MODE="off")
    proc = subprocess.run([sys.executable, "-m", "tests.agents.signal_job"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "asyncio handler ran", (proc.stdout, proc.stderr)
