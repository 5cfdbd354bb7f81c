"""Agent tests never spool into the working tree."""

import pytest


@pytest.fixture(autouse=True)
def _spool_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMAUDIT_SPOOL", str(tmp_path / "spool"))
