"""agents/pickles.py: plain data loads as pickle.loads loads it; what a hostile pickle uses
beyond that is refused with one line, before it costs memory, a crash or a class's state."""

from __future__ import annotations

import pathlib
import pickle

import pytest

from numaudit.agents import pickles
from numaudit.agents.pickles import BoundedUnpickler, UnsafePickle, check_pickle

PLAIN = {"a": [1, 2, {"b": (1, 2.5)}], "s": {1, 2}, "f": frozenset([3]), "x": b"xx",
         1.5: None, "t": True, "big": 1 << 80, "u": "é" * 3}


def load(data: bytes, unpickler: type[BoundedUnpickler] = BoundedUnpickler):
    return unpickler(data, "p").load()


@pytest.mark.parametrize("protocol", [4, 5])
def test_plain_data_loads_as_pickle_loads_it(protocol):
    assert load(pickle.dumps(PLAIN, protocol=protocol)) == PLAIN


@pytest.mark.parametrize("protocol", [0, 2, 3])
def test_plain_data_of_older_protocols_loads_except_what_names_a_global(protocol):
    # sets (and, before protocol 3, bytes) are pickled as calls of a global there
    data = {k: v for k, v in PLAIN.items() if not isinstance(v, (set, frozenset, bytes))}
    assert load(pickle.dumps(data, protocol=protocol)) == data
    with pytest.raises(UnsafePickle, match="set"):
        load(pickle.dumps({1, 2}, protocol=protocol))


class _Paths(BoundedUnpickler):
    def find_class(self, module, name):
        return getattr(__import__(module), name)


def test_build_on_a_class_is_refused():
    def text(s: str) -> bytes:
        return b"\x8c" + bytes([len(s)]) + s.encode()

    poison = (b"\x80\x04" + text("pathlib") + text("Path") + b"\x93N}" + text("is_absolute")
              + text("builtins") + text("frozenset") + b"\x93s\x86b.")
    before = pathlib.Path.is_absolute
    with pytest.raises(UnsafePickle, match="BUILD on a class"):
        load(poison, _Paths)
    assert pathlib.Path.is_absolute is before


@pytest.mark.parametrize("checker", [False, True])
def test_a_key_nested_deep_is_never_hashed(checker):
    deep = b"\x80\x02}" + b")" + b"\x85" * 100_000 + b"K\x01s."
    with pytest.raises(UnsafePickle, match="deeper than"):
        check_pickle(deep) if checker else load(deep)
    shallow = b"\x80\x02}" + b")" + b"\x85" * 10 + b"K\x01s."
    assert pickle.loads(shallow) == load(shallow)


@pytest.mark.parametrize("body", [b"}", b"}\x94", b"\x8f", b"("])
def test_a_flood_is_refused_where_it_starts(body):
    data = b"\x80\x04(" + body * (4 << 20) + b"l."
    unpickler = BoundedUnpickler(data, "p")
    with pytest.raises(UnsafePickle, match="bytes of objects"):
        unpickler.load()
    assert unpickler.charged < pickles.MEMORY_SLACK + pickles.MEMORY_PER_BYTE * len(data) // 2


@pytest.mark.parametrize("op,words", [(b"\x82\x01", "extension"), (b"\x97", "out-of-band"),
                                      (b"Q", "persistent"), (b"(i__main__\nX\n", "protocol-0")])
def test_what_plain_data_does_not_need_is_refused(op, words):
    with pytest.raises(UnsafePickle, match=words):
        load(b"\x80\x04N" + op + b".")


def test_a_memo_entry_out_of_order_is_refused():
    with pytest.raises(UnsafePickle, match="memo index"):
        load(b"\x80\x02Nr\x00\x00\x01\x00.")  # LONG_BINPUT 65536 into an empty memo


def test_check_pickle_runs_nothing_it_names(tmp_path):
    marker = tmp_path / "ran"
    data = pickle.dumps(_Touch(marker), protocol=2)
    check_pickle(data)  # a stand-in for os.system: nothing called
    assert not marker.exists()


class _Touch:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.path}",)
