"""Phases and roles by name and number: the key vocabulary the agent writes and the auditor reads.

The numbers are the proto's (`Phase`, `Role` in protos/numaudit.proto); the names are the
lowercase ones users type (``--phases fwd,bwd``, policy rules) and reports print. One enum each,
so that neither side keeps its own table of either.
"""

from __future__ import annotations

from enum import IntEnum

from numaudit.protos import numaudit_pb2 as pb


class _Named(IntEnum):
    """A wire number with the lowercase name users type and reports print."""

    @property
    def label(self) -> str:
        """``fwd``, ``optim_grad``, ``grad_output``."""
        return self.name.lower()

    @classmethod
    def of(cls, label: str):
        """The member a label names; KeyError for an unknown one."""
        return cls[label.upper()]


class Phase(_Named):
    """When in a step a tensor was captured (a record's ``phase``)."""

    FWD = pb.PHASE_FWD
    BWD = pb.PHASE_BWD
    GRAD = pb.PHASE_GRAD
    PARAM = pb.PHASE_PARAM
    LOSS = pb.PHASE_LOSS
    INPUT = pb.PHASE_INPUT
    OPTIM_GRAD = pb.PHASE_OPTIM_GRAD
    UPDATE = pb.PHASE_UPDATE
    STATE = pb.PHASE_STATE


class Role(_Named):
    """What a captured tensor is to its site (a record's ``role``)."""

    OUTPUT = pb.ROLE_OUTPUT
    INPUT = pb.ROLE_INPUT
    GRAD_OUTPUT = pb.ROLE_GRAD_OUTPUT
    GRAD_INPUT = pb.ROLE_GRAD_INPUT
    VALUE = pb.ROLE_VALUE


PHASE_IDS: dict[str, int] = {p.label: int(p) for p in Phase}
"""Label -> wire number, plain ints (hot paths index with it)."""
PHASE_NAMES: dict[int, str] = {int(p): p.label for p in Phase}
ROLE_IDS: dict[str, int] = {r.label: int(r) for r in Role}
ROLE_NAMES: dict[int, str] = {int(r): r.label for r in Role}
