"""What the daemon's validation raises for bad input (auditor/daemon/validate.py and its parts):
a `ValidationError` per status code, and how a value is quoted in one."""

from __future__ import annotations


class ValidationError(ValueError):
    """Bad input. `str(e)` is `field: why`; `kind` selects the status code."""

    kind = "invalid"

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field = field
        self.why = why


class UnsupportedVersion(ValidationError):
    """A schema version this build does not speak (FAILED_PRECONDITION)."""

    kind = "version"


class CorruptPayload(ValidationError):
    """Payload bytes that contradict their own header (DATA_LOSS)."""

    kind = "corrupt"


class CorruptedInTransit(ValidationError):
    """A batch whose checksum does not match its records (ABORTED: the sender resends)."""

    kind = "transit"


class TooLarge(ValidationError):
    """Over a limit of `wire.limits` (RESOURCE_EXHAUSTED)."""

    kind = "too_large"


def short(value: str, n: int = 40) -> str:
    """`value` quoted for an error message, cut at `n` characters."""
    return repr(value if len(value) <= n else value[:n] + "...")
