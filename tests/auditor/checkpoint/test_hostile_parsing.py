"""Checkpoints whose metadata costs too much to parse or cannot be used (issue 40): parsing
time linear (or n log n) in the input, memory bounded per input byte, nesting walked without
recursion, and every malformed field one line naming the file and the field (exit 2)."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import torch

from numaudit.agents import pickles
from numaudit.agents.capture.state import TooDeep, expand
from tests.auditor.checkpoint.helpers import (
    REPO,
    cli,
    input_error,
    save_dcp,
    write_raw_safetensors,
    write_safetensors,
)
from tests.auditor.checkpoint.hostile import (
    deep_tuple_key,
    nested_dicts,
    nested_lists,
    pickle_of,
    tensor_entry,
    text,
    torch_save_with,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    return save_dcp({"model": {"w": torch.randn(4, 4)}, "n": 3},
                    tmp_path_factory.mktemp("ref") / "A")


# -- time -------------------------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_30000_chunks_along_dim_1_are_planned_in_linear_time():
    """Chunks that all share their dim-0 range (a tensor split by columns) were compared
    pairwise: 16 s at 4,000, ~900 s at 30,000. Counted by corners, 30,000 take well under a
    second, and one chunk saved twice is still found."""
    from numaudit.auditor.checkpoint.sources import Entry, plan, tensor_chunk, tiles

    n = 30_000
    placed = [((0, c), (4, 1)) for c in range(n)]
    started = time.perf_counter()
    assert tiles(placed, (4, n))
    entry = Entry("w", (4, n), torch.float32,
                  [tensor_chunk(lambda: torch.zeros(4), o, s) for o, s in placed])
    slabs = plan(entry, 1 << 20)
    seconds = time.perf_counter() - started
    assert len(slabs) == 1 and len(slabs[0].parts) == n  # whole rows, every chunk once
    assert not tiles(placed[:-1] + [((0, 7), (4, 1))], (4, n))  # column 7 twice, the last never
    assert not tiles(placed + [((0, 0), (4, 1))], (4, n + 1))
    assert seconds < 5, seconds
    print(f"FIGURE checkpoint.plan_30000_chunks_s {seconds:.2f}")


def test_a_two_star_glob_on_a_480kb_name_takes_linear_time(tmp_path):
    """The documented ``**`` compiled to a backtracking regex took time quadratic in the name."""
    from numaudit.auditor.checkpoint.mapping import load_map

    path = tmp_path / "map.toml"
    path.write_text('[[map]]\ncand = "**.x.**.weight"\nref = "**.y.**.weight"\n')
    rules = load_map(path)
    name = "a." * 240_000 + "b"
    started = time.perf_counter()
    assert rules.apply(name) == (name, False)
    assert rules.apply("m.x.l.0.weight") == ("m.y.l.0.weight", False)
    assert time.perf_counter() - started < 1.0


# -- memory -----------------------------------------------------------------------------------

def _peak_bytes(fn) -> tuple[int, BaseException | None]:
    """Peak bytes Python allocated while `fn` ran, and what it raised."""
    tracemalloc.start()
    try:
        fn()
        error = None
    except BaseException as exc:  # noqa: BLE001 - returned to the test
        error = exc
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak, error


MIB = 1 << 20


FLOODS = {"empty_dicts": b"}", "memoized_dicts": b"}\x94", "empty_sets": b"\x8f",
          "marks": b"(", "tuples": b"N\x85"}
"""One- and two-byte opcodes that each make 50-230 bytes: 21 MB of empty dicts took 1.9 GB
(80x) with pickle.load."""


def _flood(body: bytes, nbytes: int = MIB) -> bytes:
    return b"\x80\x04(" + body * (nbytes // len(body)) + b"l."


@pytest.mark.parametrize("flood", sorted(FLOODS))
def test_a_metadata_pickle_never_makes_more_than_its_budget(flood):
    """What the unpickler makes is charged as it goes, on every prefix of the file: any flood
    stops within the budget (32 bytes a byte plus 16 MiB), or ends as data that is not DCP
    metadata, one line either way."""
    from numaudit.auditor.checkpoint.dcp_metadata import _MetadataUnpickler, check_metadata
    from numaudit.auditor.checkpoint.sources import CheckpointError

    data = _flood(FLOODS[flood], 4 * MIB)
    unpickler = _MetadataUnpickler(data, "x/.metadata")
    with pytest.raises((pickles.UnsafePickle, CheckpointError), match="x/.metadata"):
        check_metadata(unpickler.load(), Path("x/.metadata"))
    assert unpickler.charged <= unpickler.budget + (1 << 18)


def test_what_is_charged_is_what_is_made():
    """The charges are the memory: Python's own count of the peak while the unpickler runs
    stays below the budget (1 MiB of empty dicts, refused at 0.4 MiB by the prefix check)."""
    from numaudit.auditor.checkpoint.dcp_metadata import _dataclasses, read_metadata
    from numaudit.auditor.checkpoint.sources import CheckpointError

    _dataclasses()  # DCP's modules imported before counting
    data = _flood(b"}")
    peak, error = _peak_bytes(lambda: read_metadata(data, Path("x/.metadata")))
    assert isinstance(error, CheckpointError) and "x/.metadata" in str(error), error
    assert peak < pickles.MEMORY_PER_BYTE * len(data) + pickles.MEMORY_SLACK, peak


def test_a_real_metadata_fits_its_budget_with_room():
    """What a real DCP .metadata is charged: 20-22 bytes of objects per byte, under the 32."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from numaudit.auditor.checkpoint.dcp_metadata import _MetadataUnpickler

    entries, storage = {}, {}
    for t in range(50):
        fqn = f"model.layers.{t}.attention.wq.weight"
        entries[fqn] = tensor_entry((64 * 16, 1024), [((c * 16, 0), (16, 1024))
                                                      for c in range(64)])
        for c in range(64):
            storage[(fqn, (c * 16, 0))] = _StorageInfo(f"__{c}_0.distcp", t * 65536, 65536)
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    data = pickle.dumps(Metadata(entries, storage_data={MetadataIndex(f, o): i
                                                        for (f, o), i in storage.items()}))
    unpickler = _MetadataUnpickler(data, "real")
    unpickler.load()
    ratio = unpickler.charged / len(data)
    assert ratio < 0.8 * pickles.MEMORY_PER_BYTE, ratio


JSON_SHAPES = {
    "objects_in_an_object": b"{" + b",".join(b'"t%d":{}' % i for i in range(200_000)) + b"}",
    "arrays_in_an_array": b"[" + b",".join(b"[]" for _ in range(200_000)) + b"]",
    "short_keys": b"{" + b",".join(b'"%x":1' % i for i in range(200_000)) + b"}",
    "short_strings": b"[" + b",".join(b'"ab"' for _ in range(200_000)) + b"]",
}


@pytest.mark.parametrize("shape", sorted(JSON_SHAPES))
def test_a_json_header_is_parsed_in_memory_bounded_by_its_size(shape):
    """21 MB of ``{}`` items took 818 MB (39x) to parse. A header whose braces, brackets and
    keys would take more than 24 bytes a byte is refused unparsed; what is parsed stays
    below that (measured: 15x at most)."""
    from numaudit.auditor.checkpoint.safetensors import JSON_MEMORY_PER_BYTE, parse_json
    from numaudit.auditor.checkpoint.sources import CheckpointError

    data = JSON_SHAPES[shape]
    peak, error = _peak_bytes(lambda: parse_json(data, "h"))
    assert error is None or (isinstance(error, CheckpointError) and "not parsed" in str(error))
    assert peak < JSON_MEMORY_PER_BYTE * len(data) + MIB, (peak / len(data))


def test_a_header_of_empty_arrays_is_one_line_and_never_parsed(tmp_path, ref):
    path = write_raw_safetensors(tmp_path / "empty.safetensors", JSON_SHAPES[
        "arrays_in_an_array"], b"")
    input_error(cli("checkpoint", ref, path), path, "not parsed")


# -- nesting ----------------------------------------------------------------------------------

def test_plain_data_nested_deeper_than_the_limit_is_named(tmp_path, ref):
    """Pickled plain data nested 5,000 deep (10 KB, under the 1 MiB cap), as torchtitan saves
    a dataloader's state: the live capture and the checkpoint reader walk it without recursion
    and name the entry (before: RecursionError, a traceback, exit 3)."""
    deep = pickle_of(nested_lists(5000))
    with pytest.raises(TooDeep, match="loader.dp_rank_0"):
        expand("loader.dp_rank_0", deep)
    ckpt = save_dcp({"loader": {"dp_rank_0": deep}}, tmp_path / "deep")
    input_error(cli("checkpoint", ckpt, ckpt), ckpt, "loader.dp_rank_0", "nested deeper")


def test_a_key_nested_in_tuples_never_reaches_hash():
    """A dict key 200,000 tuples deep (200 KB): hashing it overflows the C stack (SIGSEGV), in
    the training process for `capture_state_dict`. Checked in a child process, so that the
    crash it would be fails the test instead of ending it."""
    code = ("from numaudit.agents.capture.state import expand; import sys; "
            "data = sys.stdin.buffer.read(); "
            "print(expand('x', data) == [('x', data)])")
    deep = pickle_of(deep_tuple_key(200_000))
    proc = subprocess.run([sys.executable, "-c", code], input=deep, capture_output=True,
                          cwd=REPO, timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip() == b"True"  # compared as its bytes, like any other pickle


# -- one line each (exit 2) -------------------------------------------------------------------

def _dcp_with(tmp_path: Path, field: str, value) -> Path:
    """A real save of a value and a tensor whose metadata says `field` = `value`."""
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = save_dcp({"w": torch.zeros(2, 2), "n": 3}, tmp_path / field)
    md = FileSystemReader(str(ckpt)).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "n")
    if field == "chunks":
        md.state_dict_metadata["w"].chunks = value
    else:
        setattr(info, field, value)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    return ckpt


def _st(tmp_path: Path, name: str, entry: dict) -> Path:
    return write_raw_safetensors(tmp_path / "x.safetensors", json.dumps({name: entry}).encode(),
                                 b"")


CASES = {
    # case: (build(tmp_path) -> path, words the line must hold)
    "shape_2_pow_64": (lambda t: _st(t, "w", {"dtype": "F32", "shape": [2 ** 64, 0],
                                              "data_offsets": [0, 0]}), "'w'"),
    "dims_65": (lambda t: _st(t, "w", {"dtype": "F32", "shape": [1] * 65,
                                       "data_offsets": [0, 4]}), "'w'"),
    "site_600": (lambda t: write_safetensors(t / "x.safetensors", {"s" * 600: torch.zeros(1)}),
                 "sssss"),
    "json_nested_deep": (lambda t: write_raw_safetensors(
        t / "x.safetensors", b'{"a":' * 200_000 + b"1" + b"}" * 200_000, b""), "header"),
    "json_nested_past_the_recursion_limit": (lambda t: write_raw_safetensors(
        t / "x.safetensors", b'{"aaaaaaaaaaaaaaaaaa":' * 5000 + b"1" + b"}" * 5000, b""),
        "nested too deep"),
    "relative_path_empty": (lambda t: _dcp_with(t, "relative_path", ""), "relative_path"),
    "offset_abc": (lambda t: _dcp_with(t, "offset", "abc"), "offset: 'abc'"),
    "chunks_none": (lambda t: _dcp_with(t, "chunks", None), "chunks"),
    "torch_save_dict_3000_deep": (lambda t: torch_save_with(
        t / "x.pt", pickle_of(b"}" + text("m") + nested_dicts(3000) + b"s")), "nested deeper"),
    "torch_save_list_5000_deep": (lambda t: torch_save_with(
        t / "x.pt", pickle_of(b"}" + text("m") + nested_lists(5000) + b"s")), "nested deeper"),
    "torch_save_deep_tuple_key": (lambda t: torch_save_with(
        t / "x.pt", pickle_of(deep_tuple_key(100_000))), "deeper than"),
    "dcp_chunk_count_past_its_size": (lambda t: _dcp_with(t, "chunks", [
        tensor_entry((2, 2), [((1, 0), (2, 2))]).chunks[0]]), "outside its size"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_field_is_one_line_naming_the_file_and_the_field(ref, tmp_path, case):
    build, words = CASES[case]
    path = build(tmp_path)
    res = cli("checkpoint", ref, path)
    line = input_error(res, words)
    assert str(path) in line or str(path.parent) in line, line
