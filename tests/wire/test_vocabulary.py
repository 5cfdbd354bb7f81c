"""The phase and role enums both sides import are the proto's, whole: a phase added to the proto
and not here would be a key the auditor cannot name."""

from __future__ import annotations

import pytest

from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire.vocabulary import PHASE_IDS, PHASE_NAMES, ROLE_IDS, ROLE_NAMES, Phase, Role


@pytest.mark.parametrize("enum, proto, prefix", [(Phase, pb.Phase, "PHASE_"),
                                                 (Role, pb.Role, "ROLE_")])
def test_every_proto_value_has_a_member_of_the_same_number(enum, proto, prefix):
    wire = {name.removeprefix(prefix): number for name, number in proto.items()
            if not name.endswith("UNSPECIFIED")}
    assert {m.name: int(m) for m in enum} == wire


def test_labels_round_trip_and_the_tables_agree():
    for table_ids, table_names, enum in ((PHASE_IDS, PHASE_NAMES, Phase),
                                         (ROLE_IDS, ROLE_NAMES, Role)):
        for m in enum:
            assert enum.of(m.label) is m
            assert table_ids[m.label] == m and table_names[int(m)] == m.label
            assert type(table_ids[m.label]) is int  # plain ints for the agent's hot path
    assert Phase.OPTIM_GRAD.label == "optim_grad" and Role.GRAD_INPUT.label == "grad_input"
    with pytest.raises(KeyError):
        Phase.of("forward")
