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

from numaudit.agents.digest.digest import digest_piece
from numaudit.agents.digest.fastpath import Digester
from numaudit.agents.digest.rows import RowBatch
from numaudit.agents.kernels import accel
from numaudit.agents.layout import PieceLayout

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
    """A stand-in for the Triton digest module (``prepare``, ``digest_prepared``,
    ``digest_rows``): the eager
    digest, optionally wrong, failing, or refusing pieces. ``calls`` counts the pieces it
    digested (or failed on), ``lists`` its digest calls."""

    def __init__(self, *, flip_fingerprint=False, fail_after=None, refuse=lambda t: False):
        self.calls = self.lists = 0
        self.flip, self.fail_after, self.refuse = flip_fingerprint, fail_after, refuse

    def prepare(self, t, layout):
        if self.refuse(t):
            raise ValueError("shape: 5 dims after merging > 4")
        return t, layout

    def digest_rows(self, prepared, *, sketch_k):
        f64, i64 = self.digest_prepared(prepared, sketch_k=sketch_k)
        return list(zip(f64, i64))

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


def _checks(*dtypes) -> tuple[int, int]:
    """(pieces digested, lists digested) by the self-checks of ``dtypes``: each test piece
    twice in one list and twice alone."""
    sizes = [len(accel._test_pieces(torch.device("cpu"), d)) for d in dtypes]
    return sum(4 * n for n in sizes), sum(2 * (1 + n) for n in sizes)


CHECK_CALLS, CHECK_LISTS = _checks(torch.float32, torch.int64)
"""The self-checks of the test pieces' dtypes."""


def _digester_with(monkeypatch, stand) -> Digester:
    monkeypatch.setattr(accel, "_load", lambda: stand)
    return Digester("auto", triton_devices=("cpu",))


def test_a_kernel_that_agrees_is_used(monkeypatch):
    stand = _Stand()
    pieces = _pieces()
    got = _rows(_digester_with(monkeypatch, stand), pieces)
    assert _same(got, _eager(pieces))
    # the self-checks of float32 and int64, then the pieces
    assert stand.calls == CHECK_CALLS + len(pieces)
    # and one call for the whole list (float32 and int64 pieces together)
    assert stand.lists == CHECK_LISTS + 1


def _digest_twice(monkeypatch, caplog, stand) -> tuple[list, list, list]:
    """The test pieces digested twice by one Digester over `stand`: (pieces, first, second)."""
    pieces = _pieces()
    with caplog.at_level(logging.WARNING, logger="numaudit.agents.kernels.accel"):
        digester = _digester_with(monkeypatch, stand)
        return pieces, _rows(digester, pieces), _rows(digester, pieces)


def test_a_kernel_that_disagrees_is_never_used(monkeypatch, caplog):
    stand = _Stand(flip_fingerprint=True)
    pieces, got, again = _digest_twice(monkeypatch, caplog, stand)
    assert _same(got, _eager(pieces)) and _same(again, got)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "disagrees with the eager reference" in warnings[0]
    # each check's first round (every piece once in its list, once alone), nothing after
    assert stand.calls == CHECK_CALLS // 2


def test_a_kernel_that_fails_later_falls_back_for_good(monkeypatch, caplog):
    stand = _Stand(fail_after=CHECK_CALLS + 2)
    pieces, got, more = _digest_twice(monkeypatch, caplog, stand)
    assert _same(got, _eager(pieces)) and _same(more, got)
    failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(failed) == 1 and "float32" in failed[0] and "int64" in failed[0], failed
    # the checks of float32 and int64, then the list of 3 fails at its third piece: every
    # piece of that list gets eager rows, both dtypes are distrusted, and the second round
    # never reaches the kernel
    assert stand.calls == CHECK_CALLS + 3 and stand.lists == CHECK_LISTS + 1


def test_shapes_the_kernel_refuses_take_the_eager_path_silently(monkeypatch, caplog):
    stand = _Stand(refuse=lambda t: tuple(t.shape) in ((5, 300), (3, 300), (40,)))  # not checks
    pieces = _pieces()
    with caplog.at_level(logging.WARNING, logger="numaudit.agents.kernels.accel"):
        got = _rows(_digester_with(monkeypatch, stand), pieces)
    assert _same(got, _eager(pieces)) and not caplog.records
    assert stand.calls == CHECK_CALLS  # the checks only


def test_a_refused_piece_leaves_the_rest_of_its_list_to_triton(monkeypatch, caplog):
    stand = _Stand(refuse=lambda t: t.shape == (3, 300))  # the shard only
    pieces = _pieces()
    with caplog.at_level(logging.WARNING, logger="numaudit.agents.kernels.accel"):
        got = _rows(_digester_with(monkeypatch, stand), pieces)
    assert _same(got, _eager(pieces)) and not caplog.records
    # the whole tensor and the ints: one list
    assert stand.calls == CHECK_CALLS + 2 and stand.lists == CHECK_LISTS + 1


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
from numaudit.agents.digest.fastpath import Digester
from numaudit.agents.digest.rows import RowBatch
from numaudit.agents.kernels.accel import term_magnitudes, within_contract
from tests.agents.test_accel_dispatch import K, _pieces, _rows, _eager
d = Digester("auto", triton_devices=("cpu",))
pieces = _pieces()
got = _rows(d, pieces)
# fingerprints, counts, min/max bitwise; sums and sketch within the float32-tile bound
assert all(within_contract(a, b, term_magnitudes(p, lay, K))
           for a, b, (p, lay, _) in zip(got, _eager(pieces), pieces)), "triton rows differ"
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
