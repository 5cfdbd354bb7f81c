"""Optimizer state keyed by parameter index, named by the other checkpoint's parameter names.

``optimizer.state_dict()`` keys its state by the parameter's position in the optimizer
(``optim.state.3.exp_avg``) and lists positions in ``param_groups[g]["params"]``;
``torch.distributed.checkpoint.state_dict.get_state_dict`` (what DCP saves and torchtitan
writes) keys the same state by the parameter's name (``optim.state.layers.1.bias.exp_avg``) and
lists names. Compared as they are, every optimizer entry of one is missing from the other.

When one side lists indices and the other names, group by group and of the same lengths, the
g-th group's i-th index of one is the g-th group's i-th name of the other: both optimizers were
built over the same parameters in the same order, which is what makes their states comparable
at all. (Were the orders different, the entries paired would hold other parameters' state and
differ: a finding, never a false pass.) The index side's entries are renamed accordingly, its
``params`` lists read as the names, and the report says so.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace

from numaudit.auditor.checkpoint.sources import Entry, Source

_PARAMS = re.compile(r"^(?P<prefix>(?:.+\.)?)param_groups\.(?P<group>\d+)\.params$")


def param_lists(source: Source) -> dict[str, dict[int, list]]:
    """``prefix -> group -> params list`` of every optimizer state dict in `source` (prefix:
    the name before ``param_groups``, e.g. ``optim.``)."""
    out: dict[str, dict[int, list]] = {}
    for entry in source.entries():
        m = _PARAMS.match(entry.name)
        if m is None or entry.load_value is None:
            continue
        value, _ = entry.load_value()
        if isinstance(value, (list, tuple)):
            out.setdefault(m["prefix"], {})[int(m["group"])] = list(value)
    return out


def index_names(indexed: dict[str, dict[int, list]], named: dict[str, dict[int, list]]
                ) -> dict[str, dict[str, str]]:
    """``prefix -> {index text: name}`` for each optimizer that `indexed` keys by index and
    `named` by name, with the same groups of the same lengths; empty when none does."""
    out = {}
    for prefix, groups in indexed.items():
        other = named.get(prefix)
        if other is None or sorted(groups) != sorted(other):
            continue
        if not all(_ints(groups[g]) and _names(other[g]) and len(groups[g]) == len(other[g])
                   for g in groups):
            continue
        table = {str(i): n for g in groups for i, n in zip(groups[g], other[g])}
        if len(table) == sum(len(v) for v in groups.values()):  # no index listed twice
            out[prefix] = table
    return out


def _ints(values: list) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def _names(values: list) -> bool:
    return all(isinstance(v, str) and v for v in values)


class NamedByIndex(Source):
    """`source` with its optimizer entries renamed from indices to names (`index_names`)."""

    def __init__(self, source: Source, tables: dict[str, dict[str, str]]) -> None:
        self.source, self.tables = source, tables
        self.format, self.path, self.files = source.format, source.path, source.files
        self._state = {prefix: re.compile(rf"^{re.escape(prefix)}state\.(\d+)\.(.+)$")
                       for prefix in tables}

    def entries(self) -> Iterator[Entry]:
        for entry in self.source.entries():
            yield self._renamed(entry)

    def _renamed(self, entry: Entry) -> Entry:
        for prefix, table in self.tables.items():
            m = self._state[prefix].match(entry.name)
            if m is not None and m[1] in table:
                return replace(entry, name=f"{prefix}state.{table[m[1]]}.{m[2]}")
            p = _PARAMS.match(entry.name)
            if p is not None and p["prefix"] == prefix and entry.load_value is not None:
                load = entry.load_value

                def named(load=load, table=table):
                    value, note = load()
                    return [table.get(str(i), i) for i in value], note
                return replace(entry, load_value=named)
        return entry

    def close(self) -> None:
        self.source.close()

    def note(self, side: str, other: str) -> str:
        """One line for the report: what was renamed, and by what."""
        count = sum(len(t) for t in self.tables.values())
        where = ", ".join(f"{p}state" for p in sorted(self.tables))
        return (f"{side}'s optimizer state ({where}) is keyed by parameter index: its {count} "
                f"indices were named by {other}'s param_groups, group by group in order "
                "(optimizer.state_dict() against get_state_dict)")


def name_optimizer_indices(sides: dict[str, Source | str], *, renamed_side_may_map: bool = True
                           ) -> list[str]:
    """Wrap, in `sides`, a file side whose optimizer state is keyed by index when the other
    file side's is keyed by name; the notes to report. ``renamed_side_may_map`` False: the
    candidate gets a name map afterwards, so it is not renamed into the reference's names."""
    files = {side: s for side, s in sides.items() if isinstance(s, Source)}
    if len(files) != len(sides) or len(sides) != 2:
        return []
    lists = {side: param_lists(src) for side, src in files.items()}
    notes = []
    for side, other in (("ref", "cand"), ("cand", "ref")):
        tables = index_names(lists[side], lists[other])
        if not tables:
            continue
        if side == "cand" and not renamed_side_may_map:
            notes.append("cand's optimizer state is keyed by parameter index and ref's by name: "
                         "not renamed, because a name map is applied to cand")
            continue
        wrapped = NamedByIndex(files[side], tables)
        sides[side] = wrapped
        notes.append(wrapped.note(side, other))
    return notes
