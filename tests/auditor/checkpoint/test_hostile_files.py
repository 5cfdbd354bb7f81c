"""Checkpoints that try to make `auditor checkpoint` read what they should not (issue 40):
state set on a class through an allow-listed pickle, symlinks out of the directory, FIFOs and
devices where files belong, and more files than descriptors. Each is refused with one line
naming the file (exit 2), reads nothing outside the checkpoint, and never blocks."""

from __future__ import annotations

import os
import pathlib
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.auditor.checkpoint.helpers import REPO, cli, input_error, save_dcp, write_safetensors
from tests.auditor.checkpoint.hostile import (
    bytes_entries,
    one_row_files_dcp,
    poison_path_class,
    write_metadata,
)

pytestmark = pytest.mark.timeout(60)

SECRET = "NUMAUDIT_TOKEN=s3cr3t-value-that-must-not-leak"


@pytest.fixture(scope="module")
def dcp_a(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hostile")
    torch.manual_seed(0)
    return save_dcp({"model": {"w": torch.randn(4, 4)}, "extra": {"n": 3, "name": "a"}},
                    out / "A")


@pytest.fixture
def secret(tmp_path) -> Path:
    path = tmp_path / "outside" / "secret.txt"
    path.parent.mkdir()
    path.write_text(SECRET)
    return path


def _no_leak(res) -> None:
    for part in ("s3cr3t", "must-not-leak"):
        assert part not in res.stdout + res.stderr
    # nor byte by byte, as ``leak.k is N in ref, 0 in cand`` lines did
    assert "leak." not in res.stdout


def test_state_set_on_a_class_by_the_metadata_is_refused_and_nothing_leaks(dcp_a, secret,
                                                                         tmp_path):
    """The issue's attack: allow-listed names only, BUILD with slot state on pathlib.Path makes
    `is_absolute` falsy, and 1-byte values at an absolute path print the file byte by byte."""
    evil = tmp_path / "evil"
    evil.mkdir()
    write_metadata(evil, *bytes_entries(str(secret), len(SECRET)), prefix=poison_path_class())
    before = pathlib.Path.is_absolute
    res = cli("checkpoint", dcp_a, evil)
    assert pathlib.Path.is_absolute is before  # the class was never touched
    input_error(res, evil / ".metadata", "BUILD")
    _no_leak(res)


def test_an_absolute_storage_path_is_refused_unread(dcp_a, secret, tmp_path):
    evil = tmp_path / "evil"
    evil.mkdir()
    write_metadata(evil, *bytes_entries(str(secret), len(SECRET)))
    res = cli("checkpoint", dcp_a, evil)
    input_error(res, "outside the checkpoint directory")
    _no_leak(res)


def test_a_storage_file_symlinked_out_of_the_directory_is_refused_unread(dcp_a, secret,
                                                                         tmp_path):
    ckpt = Path(shutil.copytree(dcp_a, tmp_path / "copy"))
    (data,) = ckpt.glob("*.distcp")
    data.unlink()
    data.symlink_to(secret)
    res = cli("checkpoint", dcp_a, ckpt)
    input_error(res, data, "outside the checkpoint directory")
    _no_leak(res)


def test_a_symlink_inside_the_directory_is_followed(dcp_a, tmp_path):
    ckpt = Path(shutil.copytree(dcp_a, tmp_path / "copy"))
    (data,) = ckpt.glob("*.distcp")
    data.rename(ckpt / "real.bin")
    data.symlink_to("real.bin")
    res = cli("checkpoint", dcp_a, ckpt)
    assert res.code == 0, res.stderr


# -- files that are not files -----------------------------------------------------------------

def _fifo(path: Path) -> Path:
    if path.exists() or path.is_symlink():
        path.unlink()
    os.mkfifo(path)
    return path


def _shards(tmp_path: Path) -> Path:
    shards = tmp_path / "shards"
    shards.mkdir()
    write_safetensors(shards / "model-00001-of-00001.safetensors",
                      {"model.w": torch.zeros(4, 4)})
    return shards


def _index(shards: Path) -> Path:
    return shards / "model.safetensors.index.json"


def _fifo_dcp_storage(t: Path, a: Path):
    # values only: a value's bytes are read without a size check first
    ckpt = save_dcp({"extra": {"n": 3, "name": "a"}}, t / "c")
    return ckpt, [], _fifo(next(ckpt.glob("*.distcp")))


def _fifo_shard(t: Path, a: Path):
    shards = _shards(t)
    return shards, [], _fifo(shards / "b.safetensors")


def _fifo_index(t: Path, a: Path):
    shards = _shards(t)
    return shards, [], _fifo(_index(shards))


def _fifo_map(t: Path, a: Path):
    return _shards(t), ["--map", _fifo(t / "map.toml")], t / "map.toml"


def _dev_zero_map(t: Path, a: Path):
    return _shards(t), ["--map", "/dev/zero"], "/dev/zero"


def _dev_zero_index(t: Path, a: Path):
    shards = _shards(t)
    _index(shards).symlink_to("/dev/zero")
    return shards, [], _index(shards)


def _directory_shard(t: Path, a: Path):
    shards = _shards(t)
    (shards / "b.safetensors").mkdir()
    return shards, [], shards / "b.safetensors"


SPECIAL = {f.__name__[1:]: f for f in (_fifo_dcp_storage, _fifo_shard, _fifo_index, _fifo_map,
                                       _dev_zero_map, _dev_zero_index, _directory_shard)}
"""case -> build(tmp_path, a DCP save) -> (CAND, extra arguments, the path the line names)"""


@pytest.mark.parametrize("case", sorted(SPECIAL))
def test_a_fifo_device_or_directory_where_a_file_belongs_is_one_line(dcp_a, tmp_path, case):
    cand, extra, named = SPECIAL[case](tmp_path, dcp_a)
    started = time.monotonic()
    res = cli("checkpoint", dcp_a, cand, *extra)
    input_error(res, named)
    assert time.monotonic() - started < 30  # refused by stat, never opened: no blocking


# -- descriptors ------------------------------------------------------------------------------

FILES = 10_000
NOFILE = 1024


def _limit_descriptors() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


@pytest.mark.timeout(240)
def test_ten_thousand_files_read_under_ulimit_1024(tmp_path):
    """A tensor saved a row a file, 10,000 files, read by `auditor checkpoint` in a process
    limited to 1024 descriptors against the same tensor in one safetensors file: identical,
    exit 0 (before: every touched file stayed open; EMFILE, a traceback, exit 3)."""
    ckpt = one_row_files_dcp(tmp_path / "many", FILES)
    whole = write_safetensors(tmp_path / "whole.safetensors", {
        "w": torch.arange(FILES, dtype=torch.float32)[:, None].expand(FILES, 2).contiguous()})
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "numaudit.auditor", "checkpoint", whole, ckpt],
                          cwd=REPO, capture_output=True, text=True, timeout=220,
                          preexec_fn=_limit_descriptors,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    seconds = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 keys: 1 identical" in proc.stdout, proc.stdout
    print(f"FIGURE checkpoint.files_{FILES}_ulimit_{NOFILE}_s {seconds:.1f}")
