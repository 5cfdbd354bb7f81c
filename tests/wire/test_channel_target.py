"""Several auditor replicas in one address: gRPC client-side load balancing (round robin)."""

from __future__ import annotations

import pytest

from numaudit.wire.channels import channel_target

RR = [("grpc.lb_policy_name", "round_robin")]


@pytest.mark.parametrize("address, target, options", [
    ("127.0.0.1:50551", "127.0.0.1:50551", []),
    ("localhost:50551", "localhost:50551", []),
    ("10.0.0.1:1,10.0.0.2:2", "ipv4:10.0.0.1:1,10.0.0.2:2", RR),
    (" 10.0.0.1:1 , 10.0.0.2:2 ,", "ipv4:10.0.0.1:1,10.0.0.2:2", RR),
    ("[::1]:1,[::1]:2", "ipv6:[::1]:1,[::1]:2", RR),
    ("dns:///auditors.example:50551", "dns:///auditors.example:50551", RR),
])
def test_channel_target(address, target, options):
    assert channel_target(address) == (target, options)
