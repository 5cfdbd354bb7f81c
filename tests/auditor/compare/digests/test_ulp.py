"""ULP distances (auditor.compare.digests.ulp): by bits within a sign, in ULPs of the larger
magnitude across zero."""

from __future__ import annotations

import numpy as np
import torch

from numaudit.auditor.compare.digests.ulp import ulp_distance, ulp_of


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int32).numpy().view(np.uint32)


def _dist(r: list[float], c: list[float]) -> float:
    rt, ct = torch.tensor(r, dtype=torch.float32), torch.tensor(c, dtype=torch.float32)
    return ulp_distance(_bits(rt), _bits(ct), rt.double().numpy(), ct.double().numpy(),
                        "float32")


def test_one_step_is_one_ulp_and_equal_is_zero():
    one = torch.tensor(1.0)
    nxt = float(torch.nextafter(one, torch.tensor(2.0)))
    assert _dist([1.0, 3.0], [nxt, 3.0]) == 1
    assert _dist([1.0], [1.0]) == 0 and _dist([0.0], [-0.0]) == 0


def test_across_zero_is_measured_at_the_larger_magnitude():
    """-2e-3 against +2e-3: twice the value, 2**24 ULPs at float32's precision (by bits it
    would read 1.98e9, the exponent range between them)."""
    d = _dist([-2e-3], [2e-3])
    assert 1.6e7 < d < 1.8e7
    x = float(np.float32(2e-3))
    assert d == 2 * x / float(ulp_of(np.array([x]), "float32")[0])
    near = _dist([-1e-30], [1e-30])
    assert near < 1e8, near  # tiny values across zero are not billions of ULPs apart


def test_ulp_of_matches_numpys_spacing():
    xs = np.array([1.0, 3.0, 1e-3, 1e30, 1e-40], np.float32)
    assert np.array_equal(ulp_of(xs.astype(np.float64), "float32"),
                          np.spacing(xs).astype(np.float64))
