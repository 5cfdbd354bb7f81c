"""The numaudit package version, as both sides of the wire report it.

The agent sends it in every `RegisterRequest.agent_version`; `auditor --version` prints it with
the wire schema versions. Read once from the installed distribution's metadata; a tree used
without installing it (PYTHONPATH=...) falls back to pyproject.toml, and to "unknown".
"""

from __future__ import annotations

import functools
import re
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "numaudit"
_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


@functools.cache
def package_version() -> str:
    """The version of the numaudit distribution ("0.1.0"), or "unknown" when none is found."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        pass
    try:
        text = _PYPROJECT.read_text()
    except OSError:
        return "unknown"
    match = re.search(r'^\[project\][^\[]*?^version\s*=\s*"([^"]+)"', text, re.M | re.S)
    return match.group(1) if match else "unknown"
