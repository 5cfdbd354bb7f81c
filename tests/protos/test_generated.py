"""The committed generated code matches protos/numaudit.proto (`make proto` regenerates it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GENERATED = ("numaudit_pb2.py", "numaudit_pb2_grpc.py", "numaudit_pb2.pyi")


@pytest.mark.timeout(60)
def test_generated_code_is_not_stale(tmp_path):
    pytest.importorskip("grpc_tools")
    (tmp_path / "numaudit" / "protos").mkdir(parents=True)
    shutil.copy(REPO / "protos" / "numaudit.proto", tmp_path / "numaudit" / "protos")
    # The same command as the Makefile's `make proto`, run in a copy of the tree.
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.",
         "--grpc_python_out=.", "--pyi_out=.", "numaudit/protos/numaudit.proto"],
        cwd=tmp_path, check=True, capture_output=True, timeout=60,
    )
    fresh, committed = tmp_path / "numaudit" / "protos", REPO / "protos"
    stale = [name for name in GENERATED
             if (fresh / name).read_bytes() != (committed / name).read_bytes()]
    assert not stale, f"stale generated code: {stale}; run `make proto` and commit the result"
