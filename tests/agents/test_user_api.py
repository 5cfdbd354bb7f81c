"""`import numaudit` is all a training script needs: every name the README and docs/agent.md use
resolves from the package itself to the object its module defines."""

from __future__ import annotations

import importlib

import pytest

import numaudit
from numaudit import agents


@pytest.mark.parametrize("name", sorted(agents.USER_API))
def test_each_user_name_resolves_from_numaudit_to_its_definition(name):
    defined = getattr(importlib.import_module(f"numaudit.agents.{agents.USER_API[name]}"), name)
    assert getattr(numaudit, name) is defined
    assert getattr(agents, name) is defined


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="no attribute 'atach'"):
        numaudit.atach  # noqa: B018  (the attribute access is the test)
