"""Sets of dotted names said compactly, for a group of findings that spans many modules.

``compact_sites(["layers.0.w1.weight", "layers.0.w1.bias", "layers.1.w1.weight",
"layers.1.w1.bias", "out.weight"])`` reads ``"layers.0-1.w1.{weight,bias}, out.weight"``: the
names form a tree of their dotted parts, siblings whose subtrees say the same are merged (numbers
into ranges, other names into braces), and a name that is also a prefix of others is listed on
its own (``layers.0-3, layers.0-3.{norm,w1}``). Expanding the braces and ranges gives back the
set exactly; the order is the names' first appearance (execution order, for a report).
"""

from __future__ import annotations

from collections.abc import Iterable

from numaudit.auditor.compare.read.ranges import integer_runs


class _Node:
    __slots__ = ("children", "end")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.end = False


def compact_sites(names: Iterable[str]) -> str:
    """The names as one compact text (see the module's docstring); "" for none."""
    root = _Node()
    for name in dict.fromkeys(names):
        node = root
        for part in name.split("."):
            node = node.children.setdefault(part, _Node())
        node.end = True
    return ", ".join(_items(root))


def _items(node: _Node) -> list[str]:
    """The node's subtree as compact suffixes ("" for the node itself)."""
    out = [""] if node.end else []
    merged: dict[frozenset, tuple[list[str], list[str]]] = {}
    for name, child in node.children.items():
        items = _items(child)
        merged.setdefault(frozenset(items), (items, []))[1].append(name)
    for items, names in merged.values():
        label = _label(names)
        out.extend(label + ("." + it if it else "") for it in items)
    return out


def _label(names: list[str]) -> str:
    """Sibling names as one label: "3", "0-3", "{norm,w1,w2}", "{0-1,3,head}"."""
    if len(names) == 1:
        return names[0]
    numbers = sorted(int(n) for n in names if n.isdigit() and str(int(n)) == n)
    words = [n for n in names if not (n.isdigit() and str(int(n)) == n)]
    parts = integer_runs(numbers) + words
    if len(parts) == 1:
        return parts[0]
    return "{" + ",".join(parts) + "}"


def shorten(text: str, limit: int) -> str:
    """`text` cut at a comma-separated item so it fits `limit` characters, saying how many
    items were left out ("…, +12 more")."""
    if limit <= 0 or len(text) <= limit:
        return text
    items = text.split(", ")
    kept: list[str] = []
    size = 0
    for k, item in enumerate(items):
        tail = f", +{len(items) - k} more"
        if size + len(item) + 2 + len(tail) > limit and kept:
            return ", ".join(kept) + tail
        kept.append(item)
        size += len(item) + 2
    return text
