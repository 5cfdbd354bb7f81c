"""Run names and session ids: one check for both sides of the wire, and safe file names from them.

The daemon refuses a Register whose run name or session id breaks these rules; the agent and the
node sidecar check the same rules before they build any path from a name, so a name can never
lead a spool file out of its directory. `spool_file_name` derives a file name from the names
through an encoding that only ever yields one path component.
"""

from __future__ import annotations

import hashlib
import re

from numaudit.wire import limits

RUN_NAME = re.compile(rf"[A-Za-z0-9._-]{{1,{limits.MAX_RUN_NAME_CHARS}}}")
"""What a run name may be: letters, digits, `.`, `_`, `-`; 1 to MAX_RUN_NAME_CHARS."""
_PLAIN_COMPONENT = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")


class BadName(ValueError):
    """A bad run name or session id. `str(e)` is `field: why` (the daemon's INVALID_ARGUMENT)."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field = field
        self.why = why


def _short(value: str, n: int = 40) -> str:
    return repr(value if len(value) <= n else value[:n] + "...")


def check_run_name(name: str, field: str = "run") -> None:
    """Raise BadName unless `name` is a run name ([A-Za-z0-9._-], 1 to 128 characters)."""
    if not isinstance(name, str) or not RUN_NAME.fullmatch(name):
        raise BadName(field, f"{_short(str(name))} is not a run name ([A-Za-z0-9._-], 1 to "
                             f"{limits.MAX_RUN_NAME_CHARS} characters)")


def check_session_id(session_id: str, field: str = "session_id") -> None:
    """Raise BadName unless `session_id` is 1 to 64 printable characters."""
    if not session_id:
        raise BadName(field, "missing")
    if len(session_id) > limits.MAX_SESSION_ID_CHARS or not session_id.isprintable():
        raise BadName(field, f"must be printable and at most {limits.MAX_SESSION_ID_CHARS} "
                             "characters")


def path_component(value: str) -> str:
    """`value` itself when it is a plain file name (no separator, no leading dot), else a digest.

    A digest loses the value, which is fine: a spool file names its session in its first frame.
    The "h-" prefix cannot collide with a plain value of the same shape because plain values
    are used only when they pass the check, and digests are 40 hex digits.
    """
    if _PLAIN_COMPONENT.fullmatch(value) and len(value) <= limits.MAX_RUN_NAME_CHARS:
        return value
    return "h-" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def spool_file_name(run: str, rank: int, session_id: str, tag: str = "", suffix: str = "") -> str:
    """One path component for a session's spool file; raises BadName for a bad run or session.

    The run name is checked (its alphabet has no separator; a leading dot is encoded like any
    other unusual value), the session id is checked and encoded (ids may hold any printable
    character), the rank is an int and `tag`/`suffix` come from code, never from the wire.
    """
    check_run_name(run)
    check_session_id(session_id)
    if not re.fullmatch(r"[A-Za-z0-9._-]*", tag + suffix):
        raise BadName("tag", f"{_short(tag + suffix)} is not a file name suffix")
    name = f"{path_component(run)}-rank{int(rank)}-{path_component(session_id)}{tag}{suffix}"
    if "/" in name or "\x00" in name or name in (".", ".."):  # cannot happen; belt and braces
        raise BadName("session_id", "does not make a file name")
    return name
