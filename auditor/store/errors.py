"""What the store refuses, each naming the field (the daemon maps them to gRPC status codes)."""

from __future__ import annotations


class StoreError(Exception):
    """A request the store refuses; the message names the field."""


class UnknownSession(StoreError):
    pass


class UnknownRun(StoreError):
    pass


class RunNameTaken(StoreError):
    """The run name belongs to another job (DESIGN.md: a name belongs to one job, never merged)."""
