"""Headless Chromium for the HTML report's browser tests: load a page, dump its DOM after the
page's script ran, take a screenshot. Nothing is configured system-wide; each call is a fresh
browser with a throwaway profile.

NUMAUDIT_BROWSER=skip skips the browser tests explicitly; otherwise a Chromium that cannot be
found or started fails them with the reason (a missing browser never passes silently). The
Makefile's `chromium` target (a prerequisite of `make test`) installs the Debian package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

ENV_BROWSER = "NUMAUDIT_BROWSER"    # "skip": skip the browser tests instead of failing them
ENV_CHROMIUM = "NUMAUDIT_CHROMIUM"  # the browser's executable (default: chromium on PATH)
NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
TIMEOUT_S = 60.0
"""Deadline of one browser run (a cold start on a busy 2-core machine takes seconds)."""


class BrowserUnavailable(RuntimeError):
    """Chromium could not be found or started here; the message says why and what to install."""


def find_chromium() -> str:
    configured = os.environ.get(ENV_CHROMIUM)
    names = [configured] if configured else list(NAMES)
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    raise BrowserUnavailable(
        "no Chromium found (tried " + ", ".join(names) + "): install it (`apt-get install -y "
        f"chromium`, which `make test` does) or set {ENV_CHROMIUM}; {ENV_BROWSER}=skip skips "
        "these tests")


def _run(args: list[str], url: str) -> tuple[str, float]:
    exe = find_chromium()
    with tempfile.TemporaryDirectory(prefix="numaudit-chromium-") as profile:
        cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
               "--disable-extensions", "--disable-dev-shm-usage", "--hide-scrollbars",
               f"--user-data-dir={profile}", *args, url]
        started = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise BrowserUnavailable(f"{exe} did not finish within {TIMEOUT_S:g}s") from None
        took = time.perf_counter() - started
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-5:]
        raise BrowserUnavailable(f"{exe} failed ({proc.returncode}): " + " | ".join(tail))
    return proc.stdout, took


def page_url(path: Path, fragment: str = "") -> str:
    return path.resolve().as_uri() + (f"#{fragment}" if fragment else "")


def dump_dom(path: Path, fragment: str = "", *, budget_ms: int = 5000) -> tuple[str, float]:
    """The page's DOM after its script ran, and the browser's wall time in seconds."""
    return _run(["--dump-dom", f"--virtual-time-budget={budget_ms}"], page_url(path, fragment))


def screenshot(path: Path, png: Path, fragment: str = "", *, size: str = "1280,1600") -> None:
    _run([f"--screenshot={png}", f"--window-size={size}", "--virtual-time-budget=5000"],
         page_url(path, fragment))
    if not png.exists() or png.stat().st_size == 0:
        raise BrowserUnavailable(f"chromium wrote no screenshot to {png}")
