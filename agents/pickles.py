"""Unpickling bytes nobody vouches for: bounded memory, no deep hashing, no state on classes.

Refusing or allow-listing globals (`find_class`) is not enough to read a hostile pickle safely.
Python's unpickler also trusts its input in three other ways, each seen in an attack on the
checkpoint reader:

- BUILD sets state on whatever object is on the stack, a class included: a DCP ``.metadata``
  made only of allow-listed names ran ``setattr(pathlib.Path, "is_absolute", frozenset)``,
  after which every absolute path passed as relative;
- a dict key or a set element is hashed, and hashing a tuple recurses in C without a check: a
  key nested 200,000 tuples deep (1 byte a level) kills the interpreter (SIGSEGV);
- one opcode byte can allocate ~200 bytes (EMPTY_SET, MEMOIZE, MARK): 21 MB of empty dicts
  took 1.9 GB.

`BoundedUnpickler` is pickle's own pure-Python unpickler with those opcodes replaced: what each
opcode makes is charged against a budget of `MEMORY_PER_BYTE` bytes per byte read so far (plus
`MEMORY_SLACK`), so a flood is refused where it starts; a key or element is hashed only when it
nests at most `MAX_HASH_DEPTH` levels; BUILD, NEWOBJ and persistent ids go through hooks that
refuse by default; REDUCE calls only what `find_class` returned; the extension registry,
out-of-band buffers and protocol-0 instantiation are refused. Every refusal is an
`UnsafePickle` (an `UnpicklingError`) with a one-line message. It is pure Python: a real 9 MB
DCP ``.metadata`` takes 4.4 s (1.7 s with ``pickle.load``, whose time also goes mostly into
building DCP's objects).

`check_pickle` runs the same rules over a pickle that another loader will then load
(``torch.load(weights_only=True)``, itself a pure-Python unpickler that hashes keys as they
come): its globals are stand-ins, nothing it names is imported or called.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar

MEMORY_PER_BYTE = 32
"""Bytes of objects a pickle may make per byte of pickle, beyond the bytes of its strings (a
real DCP ``.metadata`` is charged 20-22 and raises the RSS by 14-17: its torch.Size and
dataclass objects are larger than their encodings)."""
MEMORY_SLACK = 16 << 20
"""Bytes of objects any pickle may make, whatever its size."""
MAX_HASH_DEPTH = 32
"""Deepest a dict key or set element may nest (tuples in tuples) before it is hashed."""

_REFUSED_OPS = {
    "EXT1": "the extension registry", "EXT2": "the extension registry",
    "EXT4": "the extension registry", "INST": "a protocol-0 instance",
    "OBJ": "a protocol-0 instance", "NEXT_BUFFER": "an out-of-band buffer",
    "READONLY_BUFFER": "an out-of-band buffer",
}
_COST = {
    # what one opcode makes, in bytes (object, stack slot), charged by `BoundedUnpickler.load`;
    # strings and bytes are charged their header here, their characters (at most 4 bytes a
    # byte of pickle) by the budget's own proportion; ops that add many items charge per item
    "MARK": 64, "EMPTY_DICT": 72, "EMPTY_LIST": 64, "EMPTY_SET": 224, "EMPTY_TUPLE": 8,
    "NONE": 8, "NEWTRUE": 8, "NEWFALSE": 8, "BININT1": 8, "BININT2": 36, "BININT": 36,
    "INT": 36, "LONG": 48, "LONG1": 48, "LONG4": 48, "BINFLOAT": 32, "FLOAT": 32,
    "SHORT_BINUNICODE": 64, "BINUNICODE": 64, "BINUNICODE8": 64, "UNICODE": 64,
    "SHORT_BINSTRING": 64, "BINSTRING": 64, "STRING": 64, "SHORT_BINBYTES": 48,
    "BINBYTES": 48, "BINBYTES8": 48, "BYTEARRAY8": 64, "TUPLE1": 56, "TUPLE2": 64,
    "TUPLE3": 72, "TUPLE": 56, "LIST": 8, "DICT": 72, "GET": 8, "BINGET": 8,
    "LONG_BINGET": 8, "DUP": 8, "PUT": 9, "BINPUT": 9, "LONG_BINPUT": 9, "MEMOIZE": 9,
    "APPEND": 9, "SETITEM": 80, "GLOBAL": 8, "STACK_GLOBAL": 8, "PERSID": 128,
    "BINPERSID": 128,
}
_PER_ITEM = {"APPENDS": 9, "SETITEMS": 40, "DICT": 40, "ADDITEMS": 64}
"""Growth of a list, dict or set per stack item moved into it (a dict entry is two items)."""


class UnsafePickle(pickle.UnpicklingError):
    """A pickle refused by the rules above; the message says which one."""


def _op(name: str) -> int:
    return getattr(pickle, name)[0]


def shallow(value: Any, limit: int = MAX_HASH_DEPTH) -> bool:
    """Whether hashing `value` recurses at most `limit` levels (tuples, frozensets and frozen
    dataclasses hash their parts; anything else hashes without recursing, or refuses)."""
    todo = [(value, 0)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, (tuple, frozenset)):
            parts: Any = v
        elif isinstance(v, slice):  # hashable (and hashed by its parts) since Python 3.12
            parts = (v.start, v.stop, v.step)
        elif hasattr(type(v), "__dataclass_fields__") and hasattr(v, "__dict__"):
            parts = list(vars(v).values())
        else:
            continue
        if depth >= limit:
            return False
        todo.extend((p, depth + 1) for p in parts)
    return True


class BoundedUnpickler(pickle._Unpickler):
    """pickle's pure-Python unpickler under the rules of this module. Subclasses decide which
    globals exist (`find_class`, refused by default), which objects NEWOBJ may create
    (`may_create`) and BUILD may give state (`build`), and which types hash without recursing
    (`flat_keys`)."""

    # typeshed types the table's functions as taking a pickle.Unpickler; they take this class
    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(pickle._Unpickler.dispatch)
    flat_keys: frozenset[type] = frozenset({str, int, bytes, float, bool, type(None)})
    """Key and element types whose hash does not recurse (checked by type, fast)."""

    if TYPE_CHECKING:  # pickle._Unpickler's own, which typeshed does not declare
        _file_read: Callable[[int], bytes]
        _file_readline: Callable[[], bytes]
        metastack: list[list[Any]]

        def pop_mark(self) -> list[Any]: ...

    def __init__(self, data: bytes | BinaryIO, where: str = "pickle",
                 size: int | None = None) -> None:
        """`data`: the pickle's bytes, or a file positioned at it (`size`: the bytes the
        budget is counted on, the file's size by default)."""
        if isinstance(data, (bytes, bytearray)):
            size, data = len(data), io.BytesIO(data)
        elif size is None:
            size = os.fstat(data.fileno()).st_size
        super().__init__(data)
        self._file = data
        self.memo: list[Any] = []  # 8 bytes an entry, not ~100
        self.where = where
        self.budget = MEMORY_PER_BYTE * size + MEMORY_SLACK
        self.charged = 0
        self._callables: dict[int, Any] = {}
        """id -> each object find_class returned (kept alive, so ids stay unique)."""

    # -- hooks ------------------------------------------------------------------------------

    def find_class(self, module: str, name: str) -> Any:
        raise UnsafePickle(f"{self.where}: refers to {module}.{name}, which is not loaded")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickle(f"{self.where}: uses a persistent id, which this data is not made "
                           "with")

    def may_create(self, cls: Any) -> bool:
        """Whether NEWOBJ may make an instance of `cls` (a class find_class returned)."""
        return False

    def hashes_flat(self, value: Any) -> bool:
        """Whether `value` (a key or set element) hashes without recursing deeper than
        MAX_HASH_DEPTH: a fast answer for the data's own types (False: `shallow` decides)."""
        return False

    def build(self, obj: Any, state: Any) -> None:
        """Give `obj` its pickled `state` (BUILD)."""
        raise UnsafePickle(f"{self.where}: sets state on a {type(obj).__name__} object (BUILD), "
                           "which this data is not made with")

    # -- the loop: pickle's own, with each opcode's cost charged ----------------------------

    def load(self) -> Any:
        # Frames are only a hint to buffer; the bytes are read straight from the file.
        self.read, self.readline = self._file_read, self._file_readline
        self.readinto = getattr(self._file, "readinto", None)
        self.metastack = []
        self.stack: list[Any] = []
        self.append = self.stack.append
        self.proto = 0
        read, dispatch, cost, tell = self.read, self.dispatch, _COSTS, self._file.tell
        start, n = tell(), 0
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError
                op = key[0]
                dispatch[op](self)
                self.charged += cost[op]
                n += 1
                if n & 1023 == 0 and (self.charged > self.budget or self.charged >
                                      MEMORY_PER_BYTE * (tell() - start) + MEMORY_SLACK):
                    # the budget holds for every prefix too: a flood is refused early
                    self._too_much()
        except pickle._Stop as stop:  # type: ignore[attr-defined]
            return stop.value

    def load_frame(self) -> None:
        if len(self.read(8)) != 8:
            raise EOFError

    def charge(self, nbytes: int) -> None:
        self.charged += nbytes
        if self.charged > self.budget:
            self._too_much()

    def _too_much(self) -> None:
        raise UnsafePickle(f"{self.where}: would make more than {self.budget} bytes of "
                               f"objects ({MEMORY_PER_BYTE} per byte of pickle, plus "
                               f"{MEMORY_SLACK >> 20} MiB): refused")

    # -- the rules --------------------------------------------------------------------------

    def _hashable(self, value: Any) -> Any:
        if type(value) in self.flat_keys or self.hashes_flat(value) or shallow(value):
            return value
        raise UnsafePickle(f"{self.where}: a key or set element nested deeper than "
                           f"{MAX_HASH_DEPTH} levels (hashing it would overflow the stack)")

    def _global(self, module: str, name: str) -> Any:
        found = self.find_class(module, name)
        self._callables[id(found)] = found
        return found

    def _allowed(self, func: Any, what: str) -> Any:
        if self._callables.get(id(func)) is not func:
            raise UnsafePickle(f"{self.where}: {what} on a {type(func).__name__} object, not on "
                               "a name the data may use")
        return func

    def _into(self, target: Any, kind: type, op: str) -> Any:
        if not isinstance(target, kind):
            raise UnsafePickle(f"{self.where}: {op} into a {type(target).__name__} object")
        return target

    def _put(self, i: int) -> None:
        memo = self.memo
        if i == len(memo):
            memo.append(self.stack[-1])
        elif 0 <= i < len(memo):
            memo[i] = self.stack[-1]
        else:  # picklers number memo entries in order; a gap would have to be allocated
            raise UnsafePickle(f"{self.where}: memo index {i} out of order")

    def load_memoize(self) -> None:
        self.memo.append(self.stack[-1])

    def load_put(self) -> None:
        self._put(int(self.readline()[:-1]))

    def load_binput(self) -> None:
        self._put(self.read(1)[0])

    def load_long_binput(self) -> None:
        self._put(struct.unpack("<I", self.read(4))[0])

    def load_global(self) -> None:
        module = self.readline()[:-1].decode("utf-8")
        name = self.readline()[:-1].decode("utf-8")
        self.append(self._global(module, name))

    def load_stack_global(self) -> None:
        name = self.stack.pop()
        module = self.stack.pop()
        if type(name) is not str or type(module) is not str:
            raise UnsafePickle(f"{self.where}: STACK_GLOBAL needs two strings")
        self.append(self._global(module, name))

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self._allowed(self.stack[-1], "a call (REDUCE)")
        if not isinstance(args, tuple):
            raise UnsafePickle(f"{self.where}: REDUCE arguments are not a tuple")
        if func in (set, frozenset, dict, OrderedDict) and args:
            items = args[0]
            if isinstance(items, (list, tuple)):
                for item in items:
                    self._hashable(item[0] if func in (dict, OrderedDict)
                                   and isinstance(item, tuple) and item else item)
            elif not isinstance(items, (dict, set, frozenset)):  # built under these rules
                raise UnsafePickle(f"{self.where}: {func.__name__} of a "
                                   f"{type(items).__name__}")
        self.stack[-1] = func(*args)
        self.charge(sys.getsizeof(self.stack[-1]) + 8)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self._allowed(self.stack.pop(), "NEWOBJ")
        if not isinstance(cls, type) or not self.may_create(cls) or not isinstance(args, tuple):
            raise UnsafePickle(f"{self.where}: creates a {getattr(cls, '__name__', '?')} object "
                               "(NEWOBJ), which this data is not made with")
        obj = cls.__new__(cls, *args)
        self.append(obj)
        self.charge(sys.getsizeof(obj) + 8)

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        if kwargs:
            raise UnsafePickle(f"{self.where}: NEWOBJ_EX with keyword arguments")
        self.load_newobj()

    def load_build(self) -> None:
        state = self.stack.pop()
        obj = self.stack[-1]
        if isinstance(obj, type) or id(obj) in self._callables:
            raise UnsafePickle(f"{self.where}: sets state on {getattr(obj, '__name__', obj)!s:.60}"
                               " itself (BUILD on a class or function): refused")
        self.build(obj, state)
        inner = getattr(obj, "__dict__", None)
        self.charge(sys.getsizeof(inner) if inner is not None else 0)

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._into(self.stack[-1], dict, "SETITEM")[self._hashable(key)] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        target = self._into(self.stack[-1], dict, "SETITEMS")
        if len(items) % 2:
            raise UnsafePickle(f"{self.where}: SETITEMS with an odd number of items")
        self.charge(_PER_ITEM["SETITEMS"] * len(items))
        hashable = self._hashable
        for i in range(0, len(items), 2):
            target[hashable(items[i])] = items[i + 1]

    def load_dict(self) -> None:
        items = self.pop_mark()
        if len(items) % 2:
            raise UnsafePickle(f"{self.where}: DICT with an odd number of items")
        self.charge(_PER_ITEM["DICT"] * len(items))
        hashable = self._hashable
        self.append({hashable(items[i]): items[i + 1] for i in range(0, len(items), 2)})

    def load_additems(self) -> None:
        items = self.pop_mark()
        target = self._into(self.stack[-1], set, "ADDITEMS")
        self.charge(_PER_ITEM["ADDITEMS"] * len(items))
        target.update(self._hashable(item) for item in items)

    def load_frozenset(self) -> None:
        items = self.pop_mark()
        self.append(frozenset(self._hashable(item) for item in items))
        self.charge(sys.getsizeof(self.stack[-1]) + 8)

    def load_append(self) -> None:
        value = self.stack.pop()
        self._into(self.stack[-1], list, "APPEND").append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        self._into(self.stack[-1], list, "APPENDS").extend(items)
        self.charge(_PER_ITEM["APPENDS"] * len(items))

    def _refuse(self, what: str) -> None:
        raise UnsafePickle(f"{self.where}: uses {what}, which plain data does not need")


def _refusing(what: str) -> Callable:
    def run(self: BoundedUnpickler) -> None:
        self._refuse(what)
    return run


_COSTS = [0] * 256
"""`_COST` by opcode byte."""
for _name, _cost in _COST.items():
    _COSTS[_op(_name)] = _cost
_d = BoundedUnpickler.dispatch
for _name, _what in _REFUSED_OPS.items():
    _d[_op(_name)] = _refusing(_what)
for _name in ("GLOBAL", "STACK_GLOBAL", "REDUCE", "NEWOBJ", "NEWOBJ_EX", "BUILD", "SETITEM",
              "SETITEMS", "DICT", "ADDITEMS", "FROZENSET", "APPEND", "APPENDS", "MEMOIZE",
              "PUT", "BINPUT", "LONG_BINPUT", "FRAME"):
    _d[_op(_name)] = getattr(BoundedUnpickler, f"load_{_name.lower()}")
del _d, _name, _what, _cost


# -- checking a pickle another loader will load -----------------------------------------------

class _StandIn:
    """What a global, a persistent id or a call on them stands for in `check_pickle`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _StandIn:
        return _StandIn()

    def __getitem__(self, key: Any) -> _StandIn:  # a stand-in for a dict-like still hashes
        return _StandIn()

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass

    def update(self, items: Any) -> None:
        for _ in items:  # a generator of checked elements: run it
            pass


_CONTAINERS = {("builtins", "set"): set, ("builtins", "frozenset"): frozenset,
               ("builtins", "dict"): dict, ("collections", "OrderedDict"): OrderedDict,
               ("__builtin__", "set"): set, ("__builtin__", "frozenset"): frozenset}


class _Checker(BoundedUnpickler):
    """Runs a pickle's opcodes with stand-ins for everything it names."""

    def find_class(self, module: str, name: str) -> Any:
        return _CONTAINERS.get((module, name)) or _StandIn

    def persistent_load(self, pid: Any) -> Any:
        return _StandIn()

    def may_create(self, cls: Any) -> bool:
        return cls is _StandIn

    def build(self, obj: Any, state: Any) -> None:
        pass  # the loader that reads it next decides what may have state (nothing is applied)

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if isinstance(func, _StandIn) or func is _StandIn:  # a call on what it named: nothing runs
            self.stack[-1] = _StandIn()
            self.charge(64)
            return
        self.stack.append(args)
        super().load_reduce()

    def _into(self, target: Any, kind: type, op: str) -> Any:
        return target if isinstance(target, _StandIn) else super()._into(target, kind, op)


_Checker.dispatch = dict(BoundedUnpickler.dispatch)
_Checker.dispatch[_op("REDUCE")] = _Checker.load_reduce


def check_pickle(data: bytes | BinaryIO, where: str = "pickle") -> None:
    """UnsafePickle (or another UnpicklingError for a malformed pickle) unless `data` keeps the
    rules of this module; what it names stays unloaded (stand-ins), so a pickle that passes
    may still be refused by the loader that reads it next."""
    _Checker(data, where).load()
