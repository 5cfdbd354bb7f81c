"""Noise bands (issue 39, docs/noise.md) on synthetic runs whose rank 0 backward is
nondeterministic (tests/auditor/noisy_runs.py), written through the real ingest path: the
candidate is judged per key and per rank piece against the reference's own run-to-run noise,
with payloads (exact) and without (sketches)."""

from __future__ import annotations

import json
import math
from contextlib import closing

import numpy as np
import pytest
import torch

from numaudit.auditor.compare.engine import compare_runs
from numaudit.auditor.compare.live import LiveComparison
from numaudit.auditor.compare.noise.bands import BITWISE, NOISY
from numaudit.auditor.compare.noise.calibrate import measure_bands
from numaudit.auditor.compare.noise.judge import DEFAULT_SLACK, NoiseSpec, rounding_floor
from numaudit.auditor.compare.noise.nondeterminism import _mechanism
from numaudit.auditor.compare.policy.load import preset_policy
from numaudit.auditor.compare.read.align import Key
from numaudit.auditor.report.json_report import to_json
from numaudit.auditor.store import Reader
from tests.auditor.noisy_runs import noisy_runs
from tests.auditor.synth import write_runs

BWD = "bwd layers.0.attn grad_output @ step 0 mb 0"
Q_GRAD = "grad layers.0.attn.q.weight value @ step 0"
W1_GRAD = "grad layers.0.mlp.w1.weight value @ step 0"
PREFIXES = ["", "s_"]
"""Runs with payloads (exact distances) and without (sketch estimates, k = 64)."""


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    path = tmp_path_factory.mktemp("noise") / "audit.db"
    return write_runs(path, *noisy_runs(), *noisy_runs(payload=False, prefix="s_"))


def _compare(db, p, cand, preset, **spec):
    noise = NoiseSpec(reruns=(p + "ref2", p + "ref3"), **spec)
    return compare_runs(db, p + "ref", p + cand, preset_policy(preset), noise=noise)


def _finding(report, key: str):
    comp = report.comparison
    for i in range(len(comp)):
        if str(comp.key(i)) == key:
            return report.finding(i)
    raise AssertionError(key)


@pytest.mark.parametrize("p", PREFIXES)
def test_bands_keep_each_rank_piece(db, p):
    """The bands: the noisy keys are those rank 0's nondeterminism reaches; the activation
    gradient keeps two boxes, rank 0's noisy and rank 1's bitwise equal."""
    with closing(Reader(db)) as reader:
        bands = measure_bands(reader, [p + "ref", p + "ref2", p + "ref3"], preset_policy("fp32"))
    assert (bands.runs, bands.pairs) == ([p + "ref", p + "ref2", p + "ref3"], 3)
    states = {str(_key(bands, g)): int(bands.state[g]) for g in range(len(bands))}
    assert states == {"fwd layers.0 output @ step 0 mb 0": BITWISE, BWD: NOISY, Q_GRAD: NOISY,
                      W1_GRAD: BITWISE}
    g = next(g for g in range(len(bands)) if str(_key(bands, g)) == BWD)
    pieces = bands.pieces(g)
    assert set(pieces) == {((0, 0), (4, 32)), ((4, 0), (4, 32))}
    rank0, rank1 = pieces[((0, 0), (4, 32))], pieces[((4, 0), (4, 32))]
    assert not bands.p_bitwise[rank0] and bands.p_rel[rank0] > 1e-4
    assert bands.p_bitwise[rank1] and bands.p_rel[rank1] == 0.0


def _key(bands, g):
    from numaudit.auditor.compare.noise.nondeterminism import _key as key

    return key(bands, g)


@pytest.mark.parametrize("p", PREFIXES)
def test_clean_candidate_is_within_the_reference_noise_where_the_preset_breaches(db, p):
    """Under the fp32 preset one bfloat16 ulp breaches; the clean candidate differs from the
    reference as much as its reruns do, so the bands excuse it."""
    plain = compare_runs(db, p + "ref", p + "clean", preset_policy("fp32"))
    assert plain.exit_code == 1
    report = _compare(db, p, "clean", "fp32")
    assert report.exit_code == 0, report.first and report.first.headline()
    counts = report.header_dict()["summary"]["noise"]
    assert counts["excused"] >= 1 and counts["beyond_noise"] == counts["beyond_floor"] == 0
    f = _finding(report, BWD)
    assert (f.verdict, f.breach, f.metrics["noise"]["kind"]) == ("close", False, "excused")
    assert any("within the reference's own noise" in n for n in f.notes)
    assert "within the reference's run-to-run noise" in f.headline()


@pytest.mark.parametrize("p", PREFIXES)
def test_a_one_percent_gradient_scale_where_reruns_are_bitwise_equal_is_the_first_divergence(
        db, p):
    """x1.01 is within the bf16 preset (rtol 1.6e-2); the reruns are bitwise equal at that
    gradient, so the bands allow only the rounding floor and the key is the first divergence."""
    plain = compare_runs(db, p + "ref", p + "scaled", preset_policy("bf16"))
    assert not _finding(plain, W1_GRAD).breach
    report = _compare(db, p, "scaled", "bf16")
    assert report.exit_code == 1
    first = report.first
    assert str(first.key) == W1_GRAD
    assert first.metrics["noise"]["kind"] == "beyond_floor"
    assert first.metrics["scaled_by"] == pytest.approx(1.01, abs=2e-3)
    assert first.threshold == pytest.approx(rounding_floor("float32"))
    assert "the reference's reruns are bitwise equal here" in first.headline()
    assert any("bitwise equal here" in n for n in first.notes)


@pytest.mark.parametrize("p", PREFIXES)
def test_a_x125_error_at_a_noisy_site_is_caught_there(db, p):
    report = _compare(db, p, "x125", "bf16")
    first = report.first
    assert str(first.key) == BWD
    noise = first.metrics["noise"]
    assert noise["kind"] == "beyond_noise" and noise["times"] > 10
    assert f"{noise['times']:.0f}x the reference's run-to-run noise" in first.headline()
    assert report.header_dict()["summary"]["noise"]["beyond_noise"] == 2


@pytest.mark.parametrize("p", PREFIXES)
def test_a_band_of_one_rank_never_excuses_another_ranks_piece(db, p):
    """rank1: rank 1's share is as noisy as rank 0's. Pooled over the key, the candidate would
    lie within the band (the whole tensor's distance is within slack x the whole key's band);
    kept per piece, rank 1's box, bitwise equal in every rerun, breaches and is named."""
    report = _compare(db, p, "rank1", "bf16")
    first = report.first
    assert str(first.key) == BWD
    assert first.metrics["noise"]["kind"] == "beyond_floor"
    differ = first.pieces["differ"]
    assert [d["box"] for d in differ] == ["[4:8, 0:32]"] and differ[0]["ranks"] == [1]
    assert first.pieces["method"] == "band" and first.pieces["agree"] == 1
    with closing(Reader(db)) as reader:
        bands = measure_bands(reader, [p + "ref", p + "ref2", p + "ref3"], preset_policy("bf16"))
    g = next(g for g in range(len(bands)) if str(_key(bands, g)) == BWD)
    whole = first.metrics.get("payload", {}).get("rel_l2") or \
        first.metrics["rel_l2"]["estimate"]
    assert whole <= DEFAULT_SLACK * bands.rel[g]  # a pooled band would have excused it


def test_candidate_on_other_boxes_is_cut_at_the_reference_pieces_from_payloads(db):
    """One process against the 2-rank reference: with payloads, both tensors are cut at the
    reference's boxes and judged per box."""
    report = _compare(db, "", "single", "fp32")
    assert report.exit_code == 0
    f = _finding(report, BWD)
    assert f.metrics["noise"]["kind"] == "excused"
    assert {p["box"] for p in f.metrics["noise"]["pieces"]} == {"[0:4, 0:32]", "[4:8, 0:32]"}


def test_candidate_on_other_boxes_without_payloads_is_never_excused_as_a_whole(db):
    """Without payloads a sub-box of the single process has no digest: the band, per piece,
    cannot excuse the key (the preset decides, and says why), though the whole tensor lies
    within the whole key's band."""
    report = _compare(db, "s_", "single", "fp32")
    f = _finding(report, BWD)
    assert f.breach and f.metrics["noise"]["kind"] == "not_applied"
    assert any("a band is per piece" in n for n in f.notes)
    assert report.header_dict()["summary"]["noise"]["not_applied"] == 1


def test_bands_saved_and_loaded_judge_as_measured_ones(db, tmp_path):
    from numaudit.auditor.compare.noise.bands_file import load_bands, save_bands

    with closing(Reader(db)) as reader:
        bands = measure_bands(reader, ["ref", "ref2", "ref3"], preset_policy("bf16"))
    save_bands(bands, tmp_path / "bands.npz")
    loaded = load_bands(tmp_path / "bands.npz")
    assert loaded.meta["nondeterminism"]["first"] == bands.meta["nondeterminism"]["first"]
    for cand in ("clean", "scaled", "x125", "rank1"):
        a = _compare(db, "", cand, "bf16")
        b = compare_runs(db, "ref", cand, preset_policy("bf16"),
                         noise=NoiseSpec(bands=loaded, source="bands.npz"))
        assert a.header_dict()["summary"] == b.header_dict()["summary"], cand
        assert b.header_dict()["noise"]["source"] == "bands.npz"


def test_the_reference_nondeterminism_is_named(db):
    report = _compare(db, "", "clean", "bf16")
    nd = report.header_dict()["noise"]["nondeterminism"]
    assert nd["differs"] and nd["first"] == {"step": 0, "microbatch": 0, "phase": "bwd",
                                             "site": "layers.0.attn", "role": "grad_output",
                                             "index": 0, "call": 0}
    assert nd["previous"]["phase"] == "fwd"  # the capture before it is bitwise equal
    assert nd["mechanism"]["name"] == "attention backward"
    assert nd["reach"]["keys"] == 2 and nd["reach"]["by_phase"]["grad"] == {"differ": 1, "of": 2}
    assert "sdpa_kernel" in nd["advice"] and f"first differ at {BWD}" in nd["text"]


@pytest.mark.parametrize("first, previous, name", [
    (Key(0, 0, "bwd", "model.layers.3.self_attn", "grad_output"),
     Key(0, 0, "bwd", "model.layers.3.mlp", "grad_output"), "attention backward"),
    (Key(0, 0, "bwd", "model.embed_tokens", "grad_output"),
     Key(0, 0, "bwd", "model.layers.0.input_layernorm", "grad_output"), "embedding backward"),
    (Key(0, -1, "grad", "model.layers.0.input_layernorm.weight", "value"), None,
     "norm-weight reductions"),
    (Key(0, -1, "grad", "model.embed_tokens.weight", "value"), None, "embedding backward"),
    (Key(0, -1, "grad", "model.layers.0.mlp.down_proj.weight", "value"), None,
     "split-K matmuls"),
    (Key(1, 0, "fwd", "model.layers.0.mlp", "output"), None, "forward kernels"),
    (Key(0, 0, "input", "input", "value"), None, "data loading"),
])
def test_mechanism_read_off_the_sites(first, previous, name):
    assert _mechanism(first, previous)["name"] == name


def test_bitwise_reruns_have_no_nondeterminism(db):
    with closing(Reader(db)) as reader:
        bands = measure_bands(reader, ["ref", "same"], preset_policy("bf16"))
    assert bands.counts()["noisy"] == 0
    assert not bands.meta["nondeterminism"]["differs"]


def test_json_report_carries_the_bands(db):
    report = _compare(db, "", "x125", "bf16")
    doc = json.loads(to_json(report))
    assert doc["schema_version"] == 5
    assert set(doc["summary"]["noise"]) == {"within_band", "excused", "preset_breach",
                                            "beyond_noise", "beyond_floor", "not_applied",
                                            "unbanded"}
    assert doc["noise"]["runs"] == ["ref", "ref2", "ref3"] and doc["noise"]["pairs"] == 3
    assert doc["noise"]["keys"] == {"noisy": 2, "bitwise": 2, "unusable": 0}
    by_key = {(f["key"]["phase"], f["key"]["site"]): f for f in doc["findings"]}
    noise = by_key[("bwd", "layers.0.attn")]["metrics"]["noise"]
    assert noise["kind"] == "beyond_noise" and noise["slack"] == DEFAULT_SLACK
    rank0 = next(p for p in noise["pieces"] if p["box"] == "[0:4, 0:32]")
    assert rank0["band"] == "noisy" and rank0["beyond"] and rank0["band_rel_l2"] > 0
    assert "noise" not in by_key[("fwd", "layers.0")]["metrics"]  # identical: nothing to judge


def test_a_candidate_among_the_band_runs_is_warned_about(db):
    report = compare_runs(db, "ref", "ref2", preset_policy("bf16"),
                          noise=NoiseSpec(reruns=("ref2", "ref3")))
    assert any("within them by construction" in w for w in report.warnings)


def test_watch_judges_keys_against_the_bands(db):
    """The live comparison applies the same bands: the first divergence it announces is
    compare's."""
    with closing(Reader(db)) as reader:
        live = LiveComparison(reader, "ref", "rank1", preset_policy("bf16"),
                              noise=NoiseSpec(reruns=("ref2", "ref3")))
        events = live.poll() + live.flush()
    first = [e.finding for e in events if e.first_divergence]
    assert [str(f.key) for f in first] == [BWD]
    assert first[0].metrics["noise"]["kind"] == "beyond_floor"
    assert first[0].pieces["method"] == "band" and first[0].pieces["differ"][0]["ranks"] == [1]
    breaches = {str(e.finding.key) for e in events if e.finding is not None and
                not e.first_divergence and e.finding.breach}
    assert breaches == {BWD}


def test_rounding_floor_per_dtype():
    assert rounding_floor("bfloat16") == 2.0 ** -7
    assert rounding_floor("float32") == 16 * 2.0 ** -23
    assert rounding_floor("int64") == 0.0 and math.isclose(rounding_floor("float16"), 2 ** -10)
    assert np.isclose(rounding_floor("float64"), 16 * 2.0 ** -52)


@pytest.mark.parametrize("preset", ["bf16", "fp32"])
def test_an_error_in_one_element_within_the_noise_distance_breaches_by_max_abs(tmp_path,
                                                                              preset):
    """Noise on every element (one bfloat16 ulp each): one element off by 1 keeps the relative
    L2 within 4x the reruns', but its max_abs is beyond 8x theirs."""
    from tests.auditor.noisy_runs import one_bf16_ulp
    from tests.auditor.synth import RunBuilder

    base = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))

    def run(name, seed, bump=0.0):
        t = one_bf16_ulp(base, seed, share=1.0)
        t[5, 7] += bump
        b = RunBuilder(name)
        b.add_full(t, step=0, microbatch=-1, phase="grad", site="w", role="value",
                   payload=True)
        return b

    db = write_runs(tmp_path / "a.db", run("ref", 1), run("ref2", 2), run("ref3", 3),
                    run("clean", 4), run("cand", 5, bump=1.0))
    noise = NoiseSpec(reruns=("ref2", "ref3"))
    clean = compare_runs(db, "ref", "clean", preset_policy(preset), noise=noise)
    assert clean.exit_code == 0
    first = compare_runs(db, "ref", "cand", preset_policy(preset), noise=noise).first
    info = first.metrics["noise"]
    assert info["kind"] == "beyond_noise" and first.metric == "max_abs"
    piece = info["pieces"][0]
    assert piece["rel_l2"] <= DEFAULT_SLACK * piece["band_rel_l2"]
    assert piece["max_abs"] > 2 * DEFAULT_SLACK * piece["band_max_abs"]
    assert any("max_abs 1 against" in n for n in first.notes)
