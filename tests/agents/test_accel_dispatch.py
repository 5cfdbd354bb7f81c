"""Accelerator pieces go to the Triton digest only where it agrees with the eager reference
(agents/kernels/accel.py): a kernel that computes anything else, fails to compile, fails later
or is not installed leaves the digests exactly the eager path's, with one warning.

The kernel under test here is a stand-in function (these tests run without Triton and without a
GPU); `test_triton_digest_is_used_where_it_agrees` routes CPU pieces to the real Triton kernel
under Triton's CPU interpreter when triton is installed.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys

import pytest
import torch

from agents.digest import digest_piece
from agents.fastpath import Digester
from agents.kernels import accel
from agents.layout import PieceLayout
from agents.rows import RowBatch

K = 16


def _pieces() -> list[tuple[torch.Tensor, PieceLayout, None]]:
    g = torch.Generator().manual_seed(3)
    full = torch.randn(5, 300, generator=g)
    return [(full, PieceLayout.full((5, 300)), None),
            (full[2:], PieceLayout((5, 300), (2, 0), (3, 300)), None),
            (torch.randint(0, 9, (40,), generator=g), PieceLayout.full((40,)), None)]


def _rows(digester: Digester, pieces) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rows = RowBatch(len(pieces), K)
    out = digester.digest(pieces, K, rows)
    assert all(isinstance(r, int) for r in out), out
    return [(rows.f64[r].clone(), rows.i64[r].clone()) for r in out]


def _eager(pieces):
    return _rows(Digester("eager"), pieces)


def _same(a, b) -> bool:
    return all(torch.equal(fa, fb) and torch.equal(ia, ib) for (fa, ia), (fb, ib) in zip(a, b))


class _Stand:
    """A stand-in for the Triton digest module (``prepare``, ``digest_prepared``): the eager
    digest, optionally wrong, failing, or refusing pieces. ``calls`` counts the pieces it
    digested (or failed on), ``lists`` its digest calls."""

    def __init__(self, *, flip_fingerprint=False, fail_after=None, refuse=lambda t: False):
        self.calls = self.lists = 0
        self.flip, self.fail_after, self.refuse = flip_fingerprint, fail_after, refuse

    def prepare(self, t, layout):
        if self.refuse(t):
            raise ValueError("shape: 5 dims after merging > 4")
        return t, layout

    def digest_prepared(self, prepared, *, sketch_k):
        self.lists += 1
        f64s, i64s = [], []
        for t, layout in prepared:
            self.calls += 1
            if self.fail_after is not None and self.calls > self.fail_after:
                raise RuntimeError("device-side assert")
            f64, i64 = digest_piece(t, layout, sketch_k=sketch_k)
            if self.flip:
                i64 = i64.clone()
                i64[5] ^= 1
            f64s.append(f64)
            i64s.append(i64)
        return torch.stack(f64s), torch.stack(i64s)


def _digester_with(monkeypatch, stand) -> Digester:
    monkeypatch.setattr(accel, "_load", lambda: stand)
    return Digester("auto", triton_devices=("cpu",))


def test_a_kernel_that_agrees_is_used(monkeypatch):
    stand = _Stand()
    pieces = _pieces()
    got = _rows(_digester_with(monkeypatch, stand), pieces)
    assert _same(got, _eager(pieces))
    # three self-check pieces per (device, dtype, k): float32 and int64 here, then the pieces
    assert stand.calls == 3 * 2 + len(pieces)
    # one call per self-check and one for the whole list (float32 and int64 pieces together)
    assert stand.lists == 3


def _digest_twice(monkeypatch, caplog, stand) -> tuple[list, list, list]:
    """The test pieces digested twice by one Digester over `stand`: (pieces, first, second)."""
    pieces = _pieces()
    with caplog.at_level(logging.WARNING, logger="agents.kernels.accel"):
        digester = _digester_with(monkeypatch, stand)
        return pieces, _rows(digester, pieces), _rows(digester, pieces)


def test_a_kernel_that_disagrees_is_never_used(monkeypatch, caplog):
    stand = _Stand(flip_fingerprint=True)
    pieces, got, again = _digest_twice(monkeypatch, caplog, stand)
    assert _same(got, _eager(pieces)) and _same(again, got)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "disagrees with the eager reference" in warnings[0]
    assert stand.calls == 6  # the self-check pieces of each dtype, nothing after


def test_a_kernel_that_fails_later_falls_back_for_good(monkeypatch, caplog):
    stand = _Stand(fail_after=8)
    pieces, got, more = _digest_twice(monkeypatch, caplog, stand)
    assert _same(got, _eager(pieces)) and _same(more, got)
    failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(failed) == 1 and "float32" in failed[0] and "int64" in failed[0], failed
    # 3 checks each for float32 and int64, then the list of 3 fails at its third piece: every
    # piece of that list gets eager rows, both dtypes are distrusted, and the second round
    # never reaches the kernel
    assert stand.calls == 9 and stand.lists == 3


def test_shapes_the_kernel_refuses_take_the_eager_path_silently(monkeypatch, caplog):
    stand = _Stand(refuse=lambda t: t.shape[-1] in (300, 40))  # every piece, not the checks
    pieces = _pieces()
    with caplog.at_level(logging.WARNING, logger="agents.kernels.accel"):
        got = _rows(_digester_with(monkeypatch, stand), pieces)
    assert _same(got, _eager(pieces)) and not caplog.records
    assert stand.calls == 6  # the checks only


def test_a_refused_piece_leaves_the_rest_of_its_list_to_triton(monkeypatch, caplog):
    stand = _Stand(refuse=lambda t: t.shape == (3, 300))  # the shard only
    pieces = _pieces()
    with caplog.at_level(logging.WARNING, logger="agents.kernels.accel"):
        got = _rows(_digester_with(monkeypatch, stand), pieces)
    assert _same(got, _eager(pieces)) and not caplog.records
    assert stand.calls == 6 + 2 and stand.lists == 3  # the whole tensor and the ints: one list


def test_without_triton_the_eager_path_is_used(monkeypatch):
    monkeypatch.setattr(accel, "_load", lambda: "ImportError: No module named 'triton'")
    pieces = _pieces()
    digester = Digester("auto", triton_devices=("cpu",))
    assert _same(_rows(digester, pieces), _eager(pieces))


def test_eager_mode_never_routes_to_triton(monkeypatch):
    stand = _Stand()
    monkeypatch.setattr(accel, "_load", lambda: stand)
    _rows(Digester("eager"), _pieces())
    assert stand.calls == 0


_REAL = """
import os, torch
os.environ["TRITON_INTERPRET"] = "1"
from agents.fastpath import Digester
from agents.rows import RowBatch
from agents.kernels.accel import _agree
from tests.agents.test_accel_dispatch import _pieces, _rows, _eager
d = Digester("auto", triton_devices=("cpu",))
pieces = _pieces()
got = _rows(d, pieces)
# fingerprints, counts, min/max bitwise; sums and sketch within float64 rounding
assert all(_agree(a, b) for a, b in zip(got, _eager(pieces))), "triton rows differ"
assert d._triton._trusted and all(d._triton._trusted.values()), d._triton._trusted
print("ok", sorted(str(k[1]) for k in d._triton._trusted))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (optional: pip install triton)")
def test_triton_digest_is_used_where_it_agrees():
    """The real kernel, under the interpreter (in a child: TRITON_INTERPRET must be set before
    triton is first imported)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _REAL], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok") and "torch.float32" in out.stdout
