"""The one error of the checkpoint reader."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be read; the message (one line) names the file and what is
    wrong. The CLI prints it and exits 2."""
