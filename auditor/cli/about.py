"""What `auditor --version` prints, and the environment variables every help page names.

The variables are not listed by hand: `environment_help` reads the module-level ``ENV_*``
constants where they are defined (the agent's `agents.config`, the clients' `wire.channels`, the
CLI's `auditor.cli.main`) together with the comment on each constant's line, so a variable added
there shows up in `auditor --help` without anyone editing this file.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import click

from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire import limits
from numaudit.wire.version import package_version

_CONSTANT = re.compile(r'^(ENV_\w+)\s*=\s*"(NUMAUDIT_\w+)"\s*#\s*(.+?)\s*$', re.M)


def version_text() -> str:
    """One line: the package version and the wire schema versions this build speaks."""
    package = pb.DESCRIPTOR.package  # "numaudit.v1"
    supported = ", ".join(str(v) for v in limits.SUPPORTED_SCHEMA_VERSIONS)
    return (f"auditor (numaudit) {package_version()}; wire schema {package} "
            f"(schema_version {limits.CURRENT_SCHEMA_VERSION}, accepts {supported})")


def print_version(ctx: click.Context, _param: Any, value: bool) -> None:
    """Eager callback of `auditor --version`."""
    if value and not ctx.resilient_parsing:
        click.echo(version_text())
        ctx.exit(0)


def environment_variables(module: ModuleType) -> list[tuple[str, str]]:
    """(variable, what it sets) for each ``ENV_X = "NUMAUDIT_..."  # comment`` of `module`."""
    source = Path(module.__file__ or "").read_text()
    return [(getattr(module, const), comment) for const, value, comment in _CONSTANT.findall(source)
            if getattr(module, const, None) == value]


def _section(title: str, variables: list[tuple[str, str]]) -> str:
    width = max(len(name) for name, _ in variables)
    # "\b" keeps click from rewrapping the paragraph into one line
    return "\b\n" + title + "\n" + "\n".join(f"  {name.ljust(width)}  {what}"
                                             for name, what in variables)


def client_variables() -> list[tuple[str, str]]:
    """The variables the auditor commands read (arguments win over them)."""
    from numaudit.wire import channels

    # by its full name: `auditor.cli.main` as an attribute of the package is the click group
    cli_main = importlib.import_module("numaudit.auditor.cli.main")
    seen: dict[str, str] = {}
    for module in (cli_main, channels):
        for name, what in environment_variables(module):
            seen.setdefault(name, what)
    return sorted(seen.items())


def agent_variables() -> list[tuple[str, str]]:
    """The variables the agent in a training rank reads (they override `attach` arguments)."""
    from numaudit.agents import config  # stdlib only: loads neither torch nor the rest of the agent

    return environment_variables(config)


def environment_help(*, agent: bool) -> str:
    """The epilog: the auditor's variables, and with `agent` the agent's as well."""
    parts = [_section("Environment (auditor commands; options win over these):",
                      client_variables())]
    if agent:
        parts.append(_section("Environment of the agent in training ranks (these override "
                              "agents.attach arguments; docs/agent.md):", agent_variables()))
    return "\n\n".join(parts)


def attach_environment_help(group: click.Group) -> None:
    """Give `group` (every variable) and each of its commands (the auditor's) an epilog."""
    group.epilog = environment_help(agent=True)
    for command in group.commands.values():
        command.epilog = environment_help(agent=False)
