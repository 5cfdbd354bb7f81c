"""The auditor's directives as the agent takes them (`auditor watch --escalate`).

A directive arrives on an Ack of the Ingest stream the agent already holds (docs/protocol.md,
"Directives") and is read on the ack reader thread; the op capture applies it at the start of
the step it names (agents/capture/ops.py). Here it is checked against the same bounds the daemon
keeps (wire/limits.py), so a bad one is dropped rather than acted on.
"""

from __future__ import annotations

from dataclasses import dataclass

from numaudit.wire import limits


@dataclass(frozen=True)
class Directive:
    id: int
    step: int
    ops: tuple[str, ...]
    payload: tuple[str, ...]
    reason: str = ""


def _globs(values) -> tuple[str, ...] | None:
    out = tuple(values)
    if len(out) > limits.MAX_DIRECTIVE_GLOBS or not all(
            g and len(g) <= limits.MAX_DIRECTIVE_GLOB_CHARS and g.isprintable() for g in out):
        return None
    return out


def accepted(d) -> Directive | None:
    """The directive of a `numaudit_pb2.Directive`, or None when it breaks the bounds."""
    ops, payload = _globs(d.ops), _globs(d.payload)
    if ops is None or payload is None or not ops or d.step < 0 or not d.id:
        return None
    return Directive(int(d.id), int(d.step), ops, payload,
                     d.reason[:limits.MAX_DIRECTIVE_REASON_CHARS])
