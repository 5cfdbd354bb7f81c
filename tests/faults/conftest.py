"""Fault tests: bounded in time, loopback only, and blind to the developer's NUMAUDIT_* settings."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _no_numaudit_env(monkeypatch):
    """NUMAUDIT_* variables override agent arguments: a developer's shell must not redirect us."""
    for name in list(os.environ):
        if name.startswith("NUMAUDIT_") and name != "NUMAUDIT_FIGURES":
            monkeypatch.delenv(name)
