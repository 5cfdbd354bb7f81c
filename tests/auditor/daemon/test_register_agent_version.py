"""RegisterRequest.agent_version is validated like the other strings of Register, and a bad one
is refused over the wire with INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import grpc
import pytest

from numaudit.auditor.daemon.validate import ValidationError, validate_register
from numaudit.wire import limits
from tests.auditor.builders import register_request

pytestmark = pytest.mark.timeout(60)


def test_agent_version_is_checked_like_other_strings():
    validate_register(register_request(agent_version="0.1.0"))
    validate_register(register_request(agent_version=""))  # an agent of an earlier build
    for bad, why in (("x" * (limits.MAX_TEXT_CHARS + 1), "exceed the limit"),
                     ("0.1\n", "non-printable")):
        with pytest.raises(ValidationError) as err:
            validate_register(register_request(agent_version=bad))
        assert str(err.value).startswith("agent_version: ") and why in str(err.value)


def test_a_bad_agent_version_is_invalid_argument(auditor_stub):
    with pytest.raises(grpc.RpcError) as err:
        auditor_stub.Register(register_request(agent_version="v" * 300), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("agent_version: ")
