"""Verdict decisions under uncertainty, graph-break grouping, finding text."""

from __future__ import annotations

import numpy as np

from numaudit.auditor.compare.measure.findings import group_graph_breaks, headline, judge

T = 1.3e-6
REL_SIGMA = 1 / np.sqrt(512)  # k = 256


def test_tiny_differences_are_close_and_large_ones_diverged_whatever_the_noise():
    rng = np.random.default_rng(0)
    for true, want in ((1e-9, False), (T / 3, False), (3 * T, True), (1.0, True)):
        est = true * (1 + REL_SIGMA * rng.standard_normal(1000))  # 1000 noisy estimates
        breach, unc = judge(est, est * REL_SIGMA, np.full(1000, T), 3.0, "estimate")
        assert (breach == want).all() and not unc.any()


def test_the_band_around_the_threshold_is_uncertain():
    value = np.array([T * 1.05, T * 0.95, T * 2])
    sigma = value * REL_SIGMA
    breach, unc = judge(value, sigma, np.full(3, T), 3.0, "estimate")
    assert unc.tolist() == [True, True, False]
    assert breach.tolist() == [True, False, True]
    assert judge(value, sigma, np.full(3, T), 3.0, "breach")[0].tolist() == [True, True, True]
    assert judge(value, sigma, np.full(3, T), 3.0, "pass")[0].tolist() == [False, False, True]


def test_a_certain_lower_bound_and_nan_always_breach():
    breach, unc = judge(np.array([T * 0.9, np.nan]), np.array([T, 0]), np.array([T, T]), 3.0,
                        "pass", certain_breach=np.array([True, False]))
    assert breach.tolist() == [True, True] and unc.tolist() == [False, False]


def test_graph_breaks_group_by_run_stage_and_module():
    names = {"ref": "ref", "cand": "pp"}
    all_sites = {f"layers.{i}.w{j}" for i in range(4) for j in range(2)}
    stage1 = {s for s in all_sites if s.split(".")[1] in ("2", "3")}
    totals = {("cand", 0): all_sites - stage1, ("cand", 1): stage1}
    run = group_graph_breaks([("cand", "none", 0 if s not in stage1 else 1, s, st)
                              for s in all_sites for st in (0, 1)],
                             totals, {"cand": all_sites}, names)
    assert [(g.scope, g.params) for g in run] == [("run", 8)]
    assert run[0].message == "all 8 parameter gradients are None in pp (present in ref), steps 0-1"
    stage = group_graph_breaks([("cand", "none", 1, s, 0) for s in stage1], totals,
                               {"cand": all_sites}, names)
    assert [(g.scope, g.stage) for g in stage] == [("stage", 1)]
    module = group_graph_breaks([("cand", "zero", 0, "layers.0.w0", 3)], totals,
                                {"cand": all_sites}, names)
    assert module[0].scope == "module" and module[0].module == "layers.0"
    assert "all zero in pp but not in ref" in module[0].message


def test_headline():
    f = {"verdict": "diverged", "key": {"step": 0, "microbatch": 3, "phase": "fwd",
                                        "site": "layers.2.moe", "role": "output", "index": 1,
                                        "call": 0},
         "stage": 1, "metric": "rel_l2", "value": 0.02, "sigma": 0.001, "threshold": 1.3e-6,
         "uncertain": False, "detail": ""}
    assert headline(f) == ("diverged: fwd layers.2.moe output[1] @ step 0 mb 3 (stage 1) — "
                           "rel_l2 0.02 ± 0.001 vs 1.3e-06")
