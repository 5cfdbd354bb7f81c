"""`auditor checkpoint` on real torch.distributed.checkpoint saves.

A save holds a small model, its Adam state and plain extras (numbers, strings, a bf16 tensor,
a transposed view, a 0-d and an empty tensor); B is that save with one weight element moved by
one ulp. The reader must compare every entry DCP wrote, find the ulp where it was planted, give
the same verdicts when reading in boxes far smaller than a tensor, read entries as a live agent
captures them (`Agent.capture_state_dict`), and never run what a pickle in the directory names.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

import numaudit
from numaudit.agents.capture.state import flatten
from numaudit.auditor.daemon.server import BackgroundServer
from tests.auditor.checkpoint.helpers import (
    all_identical,
    auditor,
    by_site,
    cli,
    input_error,
    save_dcp,
)

pytestmark = pytest.mark.timeout(120)

ULP_SITE = "model.0.weight"
BIG = 256  # model.0.weight and its two Adam moments: 256 x 256 float32, 256 KiB each


def state() -> dict:
    """A model one Adam step in, and what else a training script saves beside it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(BIG, BIG), torch.nn.ReLU(),
                                torch.nn.Linear(BIG, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, BIG)).square().mean().backward()
    optimizer.step()
    msd, osd = get_state_dict(model, optimizer)
    extra = {"count": 7, "scale": 0.5, "name": "run-a", "tags": ["a", "b"],
             "bf16": torch.randn(5, 3).to(torch.bfloat16),
             "strided": torch.arange(12.).reshape(3, 4).t(), "scalar": torch.tensor(2.5),
             "empty": torch.empty(0, 3)}
    return {"model": msd, "optim": osd, "extra": extra}


@pytest.fixture(scope="module")
def saves(tmp_path_factory) -> dict:
    """A/ and B/ (A with ULP_SITE's element [200, 7] one ulp up: in small boxes, in a box of
    its own and not the first), the state A holds and its entries as DCP names them."""
    out = tmp_path_factory.mktemp("dcp")
    sd = state()
    save_dcp(sd, out / "A")
    w = sd["model"]["0.weight"].detach().clone()
    w[200, 7] = torch.nextafter(w[200, 7], torch.tensor(float("inf")))
    save_dcp({**sd, "model": {**sd["model"], "0.weight": w}}, out / "B")
    sites = {name for name, _ in flatten(sd)}
    assert len(sites) == len(list(flatten(sd)))
    return {"dir": out, "A": out / "A", "B": out / "B", "state": sd, "sites": sites}


def copy_of_a(saves, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saves["A"], tmp_path / "copy"))


def test_the_reader_gives_back_every_saved_entry_bitwise(saves):
    """DcpSource alone: each tensor reassembled from boxes of at most 100 elements (streamed
    from the file, or, for the transposed view, loaded whole then sliced) equals what was
    saved, and each plain value loads as itself."""
    from numaudit.auditor.checkpoint.dcp import DcpSource
    from numaudit.auditor.checkpoint.sources import boxes

    saved = dict(flatten(saves["state"]))
    source = DcpSource(saves["A"])
    try:
        entries = list(source.entries())
        assert {e.name for e in entries} == saves["sites"]
        for entry in entries:
            want = saved[entry.name]
            if entry.load_value is not None:
                assert entry.load_value() == (want, ""), entry.name
                continue
            got = torch.full(entry.shape, 7, dtype=entry.dtype)
            for chunk in entry.chunks:
                for off, shape, start in boxes(chunk.shape, 100):
                    at = tuple(slice(c + o, c + o + s)
                               for c, o, s in zip(chunk.offsets, off, shape))
                    got[at] = chunk.read(start, torch.Size(shape).numel(), None).reshape(shape)
            assert got.dtype == want.dtype and torch.equal(got, want), entry.name
    finally:
        source.close()


def test_a_save_against_itself_is_identical_on_every_entry(saves):
    res = auditor("checkpoint", saves["A"], saves["A"], "--format", "json")
    assert res.code == 0, res.stderr
    report = res.report()
    all_identical(report, saves["sites"])
    # the extras, each by the name DCP gives it, and every kind of value among them
    assert {"extra.count", "extra.scale", "extra.name", "extra.tags", "extra.bf16",
            "extra.strided", "extra.scalar", "extra.empty",
            "optim.state.0.weight.exp_avg_sq", "optim.param_groups.0.lr"} <= saves["sites"]
    found = by_site(report)
    assert found["extra.bf16"]["dtype"]["ref"] == "bfloat16"
    assert found["extra.strided"]["shape"] == [4, 3]
    assert found["extra.empty"]["numel"] == 0 and found["extra.scalar"]["shape"] == []


def test_one_ulp_is_found_where_it_was_planted(saves):
    res = cli("checkpoint", saves["A"], saves["B"], "--format", "json")
    assert res.code == 1
    report = res.report()
    first = report["first_divergence"]
    assert (first["key"]["site"], first["key"]["phase"], first["verdict"]) == (
        ULP_SITE, "state", "diverged")
    assert report["summary"]["breaches"] == 1  # nothing else moved
    assert report["summary"]["verdicts"]["identical"] == len(saves["sites"]) - 1


def test_fp32_accepts_one_ulp_as_close(saves):
    res = cli("checkpoint", saves["A"], saves["B"], "--preset", "fp32", "--format", "json")
    assert res.code == 0
    report = res.report()
    assert by_site(report)[ULP_SITE]["verdict"] == "close"
    assert report["summary"]["verdicts"]["close"] == 1
    assert report["summary"]["verdicts"]["identical"] == len(saves["sites"]) - 1


def test_reading_in_boxes_far_below_a_tensor_gives_the_same_verdicts(saves, tmp_path):
    """A and B read in 8 KiB boxes: the ulp is still found, alone; and A so read is identical,
    entry by entry, to A read whole (the digest of the boxes is the digest of the tensor)."""
    biggest = saves["state"]["model"]["0.weight"]
    assert biggest.numel() * biggest.element_size() >= 256 << 10
    db = tmp_path / "boxes.db"
    res = cli("checkpoint", saves["A"], saves["B"], "--max-memory", "24KiB", "--db", db,
              "--format", "json")
    assert res.code == 1, (res.stderr, res.exception)
    report = res.report()
    first = report["first_divergence"]
    assert (first["key"]["site"], first["verdict"]) == (ULP_SITE, "diverged")
    assert report["summary"]["breaches"] == 1
    assert report["summary"]["verdicts"]["identical"] == len(saves["sites"]) - 1
    # one reader per piece of the most cut tensor (digest.py): read in boxes indeed
    assert int(report["runs"]["ref"]["labels"]["checkpoint_readers"]) >= 32
    bounded_a = report["runs"]["ref"]["name"]
    res = cli("checkpoint", f"run:{bounded_a}", saves["A"], "--db", db, "--format", "json")
    assert res.code == 0, (res.stderr, res.exception)
    report = res.report()
    assert report["runs"]["cand"]["labels"]["checkpoint_readers"] == "1"  # read whole
    all_identical(report, saves["sites"])


def test_a_live_capture_compares_with_the_files_it_saved(saves, tmp_path):
    """The contract of capture_state_dict: a live run's checkpoint is comparable with the files
    without reading them back, entry by entry, bitwise."""
    db = tmp_path / "audit.db"
    with BackgroundServer("127.0.0.1:0", db, grace=1.0) as server:
        agent = numaudit.attach(None, run="live", address=server.address, spool_mode="off")
        agent.capture_state_dict(saves["state"], step=3)
        summary = agent.close(timeout=30)
    assert summary["acked"] == summary["captured"] == len(saves["sites"]), summary
    res = cli("checkpoint", "run:live", saves["A"], "--db", db, "--step", "3", "--format", "json")
    assert res.code == 0, (res.stderr, res.exception)
    all_identical(res.report(), saves["sites"])
    # and the live capture against the save with the planted ulp
    res = cli("checkpoint", "run:live", saves["B"], "--db", db, "--step", "3", "--format", "json")
    assert res.code == 1
    assert res.report()["first_divergence"]["key"]["site"] == ULP_SITE


# -- Untrusted files ----------------------------------------------------------------------------

class _Touch:
    """Unpickled by an unpickler that trusts the file: runs `touch marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_metadata_pickle_naming_another_global_is_refused_not_run(saves, tmp_path):
    ckpt, marker = copy_of_a(saves, tmp_path), tmp_path / "pwned"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Touch(marker), protocol=2))
    res = auditor("checkpoint", saves["A"], ckpt)
    line = input_error(res, ckpt / ".metadata", f"{os.system.__module__}.system")
    assert res.stderr.strip() == line  # refused before reading anything
    assert not marker.exists()


def _stack_global_call(module: str, name: str, arg: str) -> bytes:
    """A protocol-4 pickle of `module.name(arg)`: STACK_GLOBAL, whose name may be dotted."""
    def s(text: str) -> bytes:
        raw = text.encode()
        return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE

    return b"\x80\x04" + s(module) + s(name) + b"\x93" + s(arg) + b"\x85R."


def test_a_metadata_global_reached_through_an_allowed_module_is_refused(saves, tmp_path):
    ckpt, marker = copy_of_a(saves, tmp_path), tmp_path / "pwned"
    (ckpt / ".metadata").write_bytes(_stack_global_call(
        "torch.distributed.checkpoint.metadata", "os.system", f"touch {marker}"))
    res = cli("checkpoint", saves["A"], ckpt)
    assert not marker.exists()
    input_error(res, ckpt / ".metadata", "os.system")


def _plant_chunk_archive(ckpt: Path, fqn: str, data_pkl: bytes) -> Path:
    """Append to the .distcp file a torch.save archive of `fqn`'s chunk whose data.pkl is
    `data_pkl`, and point `.metadata` at it (a consistent save that names another global)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(ckpt)).read_metadata()
    (index, info), = [(i, v) for i, v in md.storage_data.items() if i.fqn == fqn]
    buf = io.BytesIO()
    torch.save(torch.zeros(md.state_dict_metadata[fqn].size), buf)
    genuine = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for name in genuine.namelist():
            z.writestr(name, data_pkl if name.endswith("data.pkl") else genuine.read(name))
    path = ckpt / info.relative_path
    info.offset, info.length = path.stat().st_size, len(out.getvalue())
    with open(path, "ab") as f:
        f.write(out.getvalue())
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    return path


def test_a_chunk_pickle_naming_another_global_is_never_run(saves, tmp_path):
    ckpt, marker = copy_of_a(saves, tmp_path), tmp_path / "pwned"
    _plant_chunk_archive(ckpt, "model.2.bias", pickle.dumps(_Touch(marker), protocol=2))
    res = cli("checkpoint", saves["A"], ckpt, "--format", "json")
    assert not marker.exists()
    assert res.code != 0


def test_a_chunk_pickle_naming_another_global_is_an_input_error(saves, tmp_path):
    ckpt, marker = copy_of_a(saves, tmp_path), tmp_path / "pwned"
    path = _plant_chunk_archive(ckpt, "model.2.bias", pickle.dumps(_Touch(marker), protocol=2))
    res = cli("checkpoint", saves["A"], ckpt, "--format", "json")
    assert not marker.exists()
    input_error(res, path, "model.2.bias")


def test_a_truncated_distcp_file_is_an_input_error_naming_it(saves, tmp_path):
    ckpt = copy_of_a(saves, tmp_path)
    (path,) = ckpt.glob("*.distcp")
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    input_error(cli("checkpoint", saves["A"], ckpt), path)


class _Runs:
    """Unpickled, runs `touch PATH`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def trainer_state(steps: int, marker: Path) -> dict:
    """What a torchtitan-style trainer saves beside the model: an LR scheduler, a train state,
    and the dataloader's state pickled to bytes per dp rank; `steps` steps in. A second
    dataloader entry is a pickle that would create `marker` if it were ever loaded."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    loader = {"samples_yielded": 32 * steps, "epoch": 0, "sampler": {"seed": 7, "order": [3, 1]}}
    return {"model": model.state_dict(), "lr_scheduler": scheduler.state_dict(),
            "train_state": {"step": torch.tensor(steps, dtype=torch.int32)},
            "dataloader": {"dp_rank_0": pickle.dumps(loader),
                           # a pickle naming a function: compared as bytes, never loaded
                           "other": pickle.dumps(_Runs(marker))}}


def test_scheduler_train_and_dataloader_state_are_compared_field_by_field(tmp_path):
    marker = tmp_path / "ran"
    save_dcp(trainer_state(3, marker), tmp_path / "A")
    save_dcp(trainer_state(4, marker), tmp_path / "B")
    res = cli("checkpoint", tmp_path / "A", tmp_path / "B", "--format", "json")
    assert res.code == 1, (res.stderr, res.exception)
    found = by_site(res.report())
    moved = {site: f["cause"]["reason"].split(" (")[0]
             for site, f in found.items() if f["verdict"] != "identical"}
    assert moved == {
        "lr_scheduler.last_epoch": "lr_scheduler.last_epoch is 3 in ref, 4 in cand",
        "lr_scheduler._step_count": "lr_scheduler._step_count is 4 in ref, 5 in cand",
        "lr_scheduler._last_lr": "lr_scheduler._last_lr is 0.0004 in ref, 0.0005 in cand",
        "train_state.step": "train_state.step is 3 in ref, 4 in cand",
        # the dataloader's pickled state, opened as plain data: the field that moved is named
        "dataloader.dp_rank_0.samples_yielded":
            "dataloader.dp_rank_0.samples_yielded is 96 in ref, 128 in cand"}
    assert {"dataloader.dp_rank_0.epoch", "dataloader.dp_rank_0.sampler.seed",
            "dataloader.dp_rank_0.sampler.order", "dataloader.other",
            "lr_scheduler.base_lrs", "model.weight"} <= set(found)
    # a live capture of the same state names and values every entry as the reader does
    db = tmp_path / "live.db"
    with BackgroundServer("127.0.0.1:0", db, grace=1.0) as server:
        agent = numaudit.attach(None, run="live", address=server.address, spool_mode="off")
        agent.capture_state_dict(trainer_state(3, marker), step=0)
        assert agent.close(timeout=30)["dropped"] == 0
    res = cli("checkpoint", "run:live", tmp_path / "A", "--db", db, "--format", "json")
    assert res.code == 0, (res.stderr, res.exception)
    all_identical(res.report(), set(found))
    assert not marker.exists()


def test_a_save_in_dcps_safetensors_serialization_is_read_entry_by_entry(saves, tmp_path,
                                                                         monkeypatch):
    """`FileSystemWriter(serialization_format=SAFETENSORS)`: a rank's plain values as pickles,
    then its tensors as one safetensors blob whose start is every tensor's offset in .metadata.
    torch writes the blob with the `safetensors` package, not a dependency here: the documented
    layout, written by this suite's own writer, stands in for its `save`."""
    import sys
    import types
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat

    from tests.auditor.checkpoint.helpers import write_safetensors

    def save(tensors: dict, metadata: dict | None = None) -> bytes:
        return write_safetensors(tmp_path / "blob", tensors, metadata).read_bytes()

    package = types.ModuleType("safetensors")
    package.torch = types.SimpleNamespace(save=save)
    monkeypatch.setitem(sys.modules, "safetensors", package)
    monkeypatch.setitem(sys.modules, "safetensors.torch", package.torch)
    out = tmp_path / "st"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(saves["state"], no_dist=True, storage_writer=FileSystemWriter(
            out, serialization_format=SerializationFormat.SAFETENSORS))
    assert not zipfile.is_zipfile(next(out.glob("*.distcp")))
    res = cli("checkpoint", saves["A"], out, "--format", "json")
    assert res.code == 0, (res.stderr, res.exception)
    all_identical(res.report(), saves["sites"])
    res = cli("checkpoint", saves["B"], out, "--format", "json")
    assert res.code == 1 and res.report()["first_divergence"]["key"]["site"] == ULP_SITE


def test_a_large_square_weight_saved_transposed_is_named_a_permutation(saves, tmp_path):
    """model.0.weight (256 KiB, far above the payloads' 16 KiB) saved transposed: its cause
    comes from moments and sketches alone, and still names the permutation."""
    sd = saves["state"]
    moved = {**sd, "model": {**sd["model"], "0.weight": sd["model"]["0.weight"].t()}}
    save_dcp(moved, tmp_path / "T")
    res = cli("checkpoint", saves["A"], tmp_path / "T", "--format", "json")
    assert res.code == 1
    first = res.report()["first_divergence"]
    assert first["key"]["site"] == ULP_SITE
    assert "same values in other positions" in first["cause"]["reason"], first["cause"]
