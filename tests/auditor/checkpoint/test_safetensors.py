"""`auditor checkpoint` on safetensors files written here by the documented layout (the
`safetensors` package is not a dependency), against a DCP save of the same tensors: same names,
shards, a renaming map, declared and undeclared transposes, and files or maps that are wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.auditor.checkpoint.helpers import (
    all_identical,
    by_site,
    cli,
    input_error,
    save_dcp,
    write_raw_safetensors,
    write_safetensors,
)

pytestmark = pytest.mark.timeout(60)


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "layers.0.w": torch.randn(16, 16, generator=g),
        "layers.1.w": torch.randn(16, 16, generator=g),  # square: a transpose keeps its shape
        "proj": torch.randn(64, 48, generator=g),        # 12 KiB: read in boxes below
        "norm": torch.randn(16, generator=g),
        "emb": torch.randn(10, 16, generator=g).to(torch.bfloat16),
        "half": torch.randn(3, 5, generator=g).to(torch.float16),
        "count": torch.tensor(5, dtype=torch.int64),
        "mask": torch.rand(3, 4, generator=g) > 0.5,
        "wide": torch.randn(2, 2048, generator=g),  # 8 KiB rows: cut within rows below
    }


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> dict:
    """A DCP save of {"model": tensors()} and the names DCP gives them."""
    out = tmp_path_factory.mktemp("st")
    ts = tensors()
    save_dcp({"model": ts}, out / "dcp")
    return {"dir": out, "dcp": out / "dcp", "tensors": ts, "sites": {f"model.{k}" for k in ts}}


def hf_names(ts: dict[str, torch.Tensor], *, transpose: set[str] = frozenset()
             ) -> dict[str, torch.Tensor]:
    """The tensors as a converter names them (`transpose`: stored transposed)."""
    out = {}
    for name, t in ts.items():
        if name.startswith("layers."):
            new = f"model.{name[:-1]}weight"  # layers.0.w -> model.layers.0.weight
        elif name == "proj":
            new = "model.proj.weight"
        else:
            new = f"extra.{name}"
        out[new] = t.t() if name in transpose else t
    return out


MAP = """
[[map]]
cand = "model.layers.*.weight"
ref = "model.layers.*.w"

[[map]]
cand = "model.proj.weight"
ref = "model.proj"
transpose = {proj}

[[map]]
cand = "extra.**"
ref = "model.**"
"""


def map_file(tmp_path: Path, text: str, name: str = "map.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def compare_json(*args) -> tuple[int, dict]:
    res = cli("checkpoint", *args, "--format", "json")
    return res.code, res.report()


def test_same_tensors_same_names_are_identical(ref, tmp_path):
    path = write_safetensors(tmp_path / "model.safetensors",
                             {f"model.{k}": v for k, v in ref["tensors"].items()})
    code, report = compare_json(ref["dcp"], path)
    assert code == 0
    all_identical(report, ref["sites"])
    assert report["runs"]["cand"]["labels"]["checkpoint_format"] == "safetensors"
    assert by_site(report)["model.emb"]["dtype"]["cand"] == "bfloat16"


def test_a_directory_of_shards_is_one_checkpoint(ref, tmp_path):
    items = [(f"model.{k}", v) for k, v in ref["tensors"].items()]
    shards = tmp_path / "hf"
    shards.mkdir()
    write_safetensors(shards / "model-00001-of-00002.safetensors", dict(items[:3]))
    write_safetensors(shards / "model-00002-of-00002.safetensors", dict(items[3:]))
    code, report = compare_json(ref["dcp"], shards)
    assert code == 0
    all_identical(report, ref["sites"])


@pytest.mark.parametrize("record", ["numbered", "index"])
def test_a_shard_the_directory_says_it_holds_is_named_when_missing(ref, tmp_path, record):
    """A copy that lost one of its files is one line naming the file (exit 2), not one
    missing_in_cand finding per tensor it held: the set's own numbering, or its index, says it
    should be there."""
    items = [(f"model.{k}", v) for k, v in ref["tensors"].items()]
    shards = tmp_path / "hf"
    shards.mkdir()
    first = shards / ("model-00001-of-00003.safetensors" if record == "numbered"
                      else "a.safetensors")
    write_safetensors(first, dict(items[:3]))
    lost = "model-00002-of-00003.safetensors" if record == "numbered" else "b.safetensors"
    if record == "numbered":
        write_safetensors(shards / "model-00003-of-00003.safetensors", dict(items[3:]))
    else:
        index = {"metadata": {}, "weight_map": {**{n: first.name for n, _ in items[:3]},
                                                **{n: lost for n, _ in items[3:]}}}
        (shards / "model.safetensors.index.json").write_text(json.dumps(index))
    input_error(cli("checkpoint", ref["dcp"], shards), shards, lost, "not there")


def test_renamed_tensors_compare_under_the_map(ref, tmp_path):
    path = write_safetensors(tmp_path / "hf.safetensors", hf_names(ref["tensors"]))
    code, report = compare_json(ref["dcp"], path, "--map",
                                map_file(tmp_path, MAP.format(proj="false")))
    assert code == 0
    all_identical(report, ref["sites"])  # every tensor under its REF name


@pytest.mark.parametrize("max_memory", ["256MiB", "4KiB"])
def test_tensors_stored_transposed_compare_under_a_declared_transpose(ref, tmp_path,
                                                                      max_memory):
    """proj (64 x 48) stored as 48 x 64; with 4 KiB each box of rows is transposed into a box
    of REF's columns, so REF's tensor is matched piece by piece."""
    path = write_safetensors(tmp_path / "hf.safetensors",
                             hf_names(ref["tensors"], transpose={"proj"}))
    code, report = compare_json(ref["dcp"], path, "--map",
                                map_file(tmp_path, MAP.format(proj="true")),
                                "--max-memory", max_memory)
    assert code == 0
    all_identical(report, ref["sites"])
    assert by_site(report)["model.proj"]["shape"] == [64, 48]
    if max_memory == "4KiB":
        assert int(report["runs"]["cand"]["labels"]["checkpoint_readers"]) > 1


def test_a_square_weight_stored_transposed_undeclared_is_named_with_its_cause(ref, tmp_path):
    path = write_safetensors(tmp_path / "hf.safetensors",
                             hf_names(ref["tensors"], transpose={"layers.1.w"}))
    code, report = compare_json(ref["dcp"], path, "--map",
                                map_file(tmp_path, MAP.format(proj="false")))
    assert code == 1
    first = report["first_divergence"]
    assert (first["key"]["site"], first["verdict"]) == ("model.layers.1.w", "diverged")
    assert report["summary"]["breaches"] == 1
    reason = (first["cause"] or {}).get("reason", "")
    assert "transposed" in reason or "permutation" in reason, first


# -- Files that are not what they claim ---------------------------------------------------------

def _entry(dtype="F32", shape=(2, 2), offsets=(0, 16)) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def _header(**entries) -> bytes:
    return json.dumps({"__metadata__": {"format": "pt"}, **entries}).encode()


MALFORMED = {
    # case: (file writer taking a directory -> the path the message must name, words it says)
    "header_longer_than_file": (lambda d: write_raw_safetensors(
        d / "bad.safetensors", _header(x=_entry()), bytes(16), length=1 << 20),
        "header length"),
    "header_not_json": (lambda d: write_raw_safetensors(
        d / "bad.safetensors", b"{not json", bytes(16)), "not JSON"),
    "unknown_dtype": (lambda d: write_raw_safetensors(
        d / "bad.safetensors", _header(x=_entry(dtype="F12")), bytes(16)), "'F12'"),
    "offsets_out_of_range": (lambda d: write_raw_safetensors(
        d / "bad.safetensors", _header(x=_entry(offsets=(0, 64))), bytes(16)), "data_offsets"),
    "shape_and_offsets_disagree": (lambda d: write_raw_safetensors(
        d / "bad.safetensors", _header(x=_entry(shape=(4, 4))), bytes(16)), "needs 64"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_file_is_one_line_naming_it(ref, tmp_path, case):
    write, words = MALFORMED[case]
    path = write(tmp_path)
    res = cli("checkpoint", ref["dcp"], path)
    line = input_error(res, path, words)
    assert res.stderr.strip() == line  # refused when opened, before reading anything


def test_a_name_in_two_shards_is_one_line_naming_both(ref, tmp_path):
    shards = tmp_path / "hf"
    shards.mkdir()
    x = {"model.norm": ref["tensors"]["norm"]}
    first = write_safetensors(shards / "model-00001-of-00002.safetensors", x)
    second = write_safetensors(shards / "model-00002-of-00002.safetensors", x)
    res = cli("checkpoint", ref["dcp"], shards)
    line = input_error(res, second, first, "'model.norm'")
    assert res.stderr.strip() == line


def dcp_shard(path: Path, placed: dict[str, tuple[torch.Tensor, list[int]]]) -> Path:
    """A file as torch.distributed.checkpoint's HuggingFaceStorageWriter writes a rank's shards
    unconsolidated: each tensor the rank's chunk, placed by ``DCP_SHARDING_INFO`` in the
    metadata (torch/distributed/checkpoint/filesystem.py, SerializationFormat.SAFETENSORS)."""
    info = {name: {"saved_offsets": offsets} for name, (_, offsets) in placed.items()}
    return write_safetensors(path, {name: t for name, (t, _) in placed.items()},
                             {"DCP_SHARDING_INFO": json.dumps(info), "DCP_VERSION": "1.0",
                              "format": "pt"})


def test_dcp_sharded_safetensors_are_rebuilt_from_their_saved_offsets(ref, tmp_path):
    # two ranks' files: proj split by rows (FSDP's dim 0), layers.0.w by columns, the rest on
    # rank 0 alone (a replicated tensor is written once); the same model as the DCP save
    ts = {f"model.{k}": v for k, v in ref["tensors"].items()}
    proj, w0 = ts.pop("model.proj"), ts.pop("model.layers.0.w")
    shards = tmp_path / "sharded"
    shards.mkdir()
    dcp_shard(shards / "shard-00001-model-00001-of-00001.safetensors",
              {"model.proj": (proj[:40], [0, 0]), "model.layers.0.w": (w0[:, :5], [0, 0]),
               **{name: (t, [0] * t.dim()) for name, t in ts.items()}})
    dcp_shard(shards / "shard-00002-model-00001-of-00001.safetensors",
              {"model.proj": (proj[40:], [40, 0]), "model.layers.0.w": (w0[:, 5:], [0, 5])})
    code, report = compare_json(ref["dcp"], shards)
    assert code == 0
    all_identical(report, ref["sites"])
    assert by_site(report)["model.proj"]["shape"] == [64, 48]
    # the last rank's file missing: its chunks' ends are the only shape the files give (as for
    # torch's own reader), so proj reads as 40 rows and layers.0.w as 5 columns; both breach
    (shards / "shard-00002-model-00001-of-00001.safetensors").unlink()
    code, report = compare_json(ref["dcp"], shards)
    assert code == 1
    found = by_site(report)
    assert found["model.proj"]["notes"] == ["logical shape [64, 48] in ref, [40, 48] in cand"]
    assert {s for s, f in found.items() if f["verdict"] != "identical"} == {
        "model.proj", "model.layers.0.w"}


def test_dcp_shards_that_overlap_are_refused(ref, tmp_path):
    proj = ref["tensors"]["proj"]
    shards = tmp_path / "overlap"
    shards.mkdir()
    # rows 0..40 and 24..48, and an empty chunk ending at 64: 64 rows of 64, but 24..40 twice
    # and 48..64 never, which the count alone would not tell
    first = dcp_shard(shards / "shard-00001.safetensors", {"model.proj": (proj[:40], [0, 0])})
    dcp_shard(shards / "shard-00002.safetensors", {"model.proj": (proj[24:48], [24, 0])})
    dcp_shard(shards / "shard-00003.safetensors", {"model.proj": (proj[:0], [64, 0])})
    res = cli("checkpoint", ref["dcp"], shards)
    line = input_error(res, "'model.proj'", "not each once", first.name)
    assert res.stderr.strip() == line


def test_a_tensor_saved_by_many_ranks_is_read_in_few_pieces(ref, tmp_path):
    # 96 ranks' files (DCP_SHARDING_INFO): proj in 96 row chunks of uneven sizes (FSDP with a
    # remainder, some ranks empty), emb as a 2 x 2 grid (FSDP x TP). Read in slabs of whole
    # rows filled from every chunk they cross: readers as the sizes need, not one a rank; the
    # same verdicts whole, in slabs that cut chunks, and with a cap below one row of emb
    ts = {f"model.{k}": v for k, v in ref["tensors"].items()}
    proj, emb = ts.pop("model.proj"), ts.pop("model.emb")
    cuts = [0] + sorted(torch.randint(0, 65, (95,), generator=torch.Generator().manual_seed(3))
                        .tolist()) + [64]
    shards = tmp_path / "ranks"
    shards.mkdir()
    for r in range(96):
        a, b = cuts[r], cuts[r + 1]
        placed = {"model.proj": (proj[a:b], [a, 0])}
        if r < 4:
            rows, cols = (slice(0, 6), slice(6, 10))[r // 2], (slice(0, 9), slice(9, 16))[r % 2]
            placed["model.emb"] = (emb[rows, cols], [rows.start, cols.start])
        if r == 0:
            placed.update({name: (t, [0] * t.dim()) for name, t in ts.items()})
        dcp_shard(shards / f"shard-{r:05d}-model-00001-of-00001.safetensors", placed)
    assert len(set(cuts)) < len(cuts)  # some ranks hold no row of proj
    # readers: the most pieces of one tensor; at 4 KiB (boxes of 1365 bytes) proj takes 10
    # slabs of 7 rows and wide's 8 KiB rows are cut within (7 boxes a row, 14 in all)
    for cap, readers in (("256MiB", 1), ("12KiB", 4), ("4KiB", 14)):
        code, report = compare_json(ref["dcp"], shards, "--max-memory", cap)
        assert code == 0, cap
        all_identical(report, ref["sites"])
        assert int(report["runs"]["cand"]["labels"]["checkpoint_readers"]) == readers, cap


# -- Maps that are wrong ------------------------------------------------------------------------

BAD_MAPS = {
    "unknown_field": ('[[map]]\ncand = "a.*"\nref = "b.*"\nrename = true\n', "'rename'"),
    "wildcards": ('[[map]]\ncand = "model.layers.*.weight"\nref = "model.layers.w"\n',
                  "0 wildcards for the 1"),
    "transpose_not_a_bool": ('[[map]]\ncand = "a"\nref = "b"\ntranspose = "yes"\n',
                             "'transpose'"),
}


@pytest.mark.parametrize("case", sorted(BAD_MAPS))
def test_a_wrong_map_is_one_line_naming_it(ref, tmp_path, case):
    text, words = BAD_MAPS[case]
    path = map_file(tmp_path, text)
    data = write_safetensors(tmp_path / "m.safetensors", {"model.norm": ref["tensors"]["norm"]})
    res = cli("checkpoint", ref["dcp"], data, "--map", path)
    line = input_error(res, path, "map 1", words)
    assert res.stderr.strip() == line


def test_a_transpose_of_a_3d_tensor_is_refused(ref, tmp_path):
    cube = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    data = write_safetensors(tmp_path / "cube.safetensors", {"extra.cube": cube})
    path = map_file(tmp_path, '[[map]]\ncand = "extra.*"\nref = "model.*"\ntranspose = true\n')
    input_error(cli("checkpoint", ref["dcp"], data, "--map", path), "extra.cube", "3 dims")
