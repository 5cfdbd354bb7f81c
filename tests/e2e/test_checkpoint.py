"""Issue 31's acceptance: `auditor checkpoint` on real saves, as a user runs it.

One torchrun job of 2 ranks (tests/e2e/ckpt_job.py) trains one small model one Adam step three
ways and saves each with torch.distributed.checkpoint: unsharded by one process (`ref/`),
FSDP2-sharded (`fsdp2/`) and as two pipeline stages saving into one directory (`pp/`). The
three hold bitwise-equal tensors (checked here with torch itself, so a failure below is the
auditor's), and the job plants beside them a one-ulp change (`ulp/`), a save without the
optimizer's per-parameter state (`noopt/`), the reference's weights as a Hugging-Face-style
safetensors file with a conversion map (`hf.safetensors`, `hf_map.toml`), and that file from a
conversion that transposed a square weight (`hf_bad.safetensors`).

Every comparison below goes through the CLI's entry point (`auditor checkpoint REF CAND
--format json`, in this process: a subprocess would spend most of its time importing torch);
the clean pairs pass the bitwise preset, since the saves are bitwise equal.

Bounded memory: ref against fsdp2 is read with `--max-memory` at half the largest tensor (the
2 MiB embedding and its moments), so those tensors are read in boxes; it must still compare every
entry, bitwise. Peak RSS is not asserted here: the CLI's peak RSS is ~470 MiB with or without the
limit (torch imported), the whole checkpoint 6.6 MiB, so no bound on RSS could tell bounded
reading from reading everything; the bound on bytes held is for a unit test of the reader.

Weights-only files hold no optimizer state: the reference for `hf*.safetensors` is the
reference's model half saved alone (`ref_model/`, the same tensors as `ref/`'s `model.*`).

Live captures: the job runs against a real auditor (`auditor serve` on port 0, a SQLite store),
and where it saves `fsdp2/` and `pp/` each rank's agent captures the state dict it is saving
(`capture_state_dict`: FSDP2's DTensor shards; each pipeline stage's own entries) into runs
`fsdp2-live` and `pp-live`. `auditor checkpoint run:NAME DIR --db STORE --step 1` must then find
every entry of the saved files identical, as reading the files back does, and the planted ulp
where the files comparison finds it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.ckpt_job import LARGEST_TENSOR_BYTES, LIVE_RUNS, LIVE_STEP, TRANSPOSED_SITE, ULP_SITE
from tests.e2e.helpers import ROOT, Daemon, checkpoint_json, saved_entries, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

JOB = ROOT / "tests" / "e2e" / "ckpt_job.py"
CLEAN_PAIRS = (("ref", "fsdp2"), ("ref", "pp"), ("fsdp2", "pp"))
BOUNDED = ("--max-memory", str(LARGEST_TENSOR_BYTES // 2))
COMPARISONS = {
    # name: (REF, CAND, preset, extra arguments; "{out}" is the job's output directory)
    "ref-fsdp2": ("ref", "fsdp2", "bitwise", BOUNDED),
    "ref-pp": ("ref", "pp", "bitwise", ()),
    "fsdp2-pp": ("fsdp2", "pp", "bitwise", ()),
    "ulp-bitwise": ("ref", "ulp", "bitwise", ()),
    "ulp-fp32": ("ref", "ulp", "fp32", ()),
    "noopt": ("ref", "noopt", "bitwise", ()),
    "hf": ("ref_model", "hf.safetensors", "bitwise", ("--map", "{out}/hf_map.toml")),
    "hf_bad": ("ref_model", "hf_bad.safetensors", "bitwise", ("--map", "{out}/hf_map.toml")),
}


def by_site(report: dict) -> dict[str, dict]:
    return {f["key"]["site"]: f for f in report["findings"]}


LIVE_COMPARISONS = {
    # name: (REF, CAND): a live run against a save, keyed by the files comparison to match
    "fsdp2-live": ("run:" + LIVE_RUNS["fsdp2"], "ref"),
    "pp-live": ("run:" + LIVE_RUNS["pp"], "ref"),
    "fsdp2-live-ulp": ("run:" + LIVE_RUNS["fsdp2"], "ulp"),
}


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[Path, Path]:
    """The job, run against an auditor: (its output directory, the store of its live runs)."""
    out = tmp_path_factory.mktemp("ckpt")
    daemon = Daemon(tmp_path_factory.mktemp("auditor"))
    try:
        torchrun(str(JOB), 2, str(out), env={"NUMAUDIT_ADDR": daemon.address})
    finally:
        code = daemon.stop()
    assert code == 0, daemon.log.read_text()
    return out, daemon.db


@pytest.fixture(scope="module")
def saves(job) -> Path:
    return job[0]


@pytest.fixture(scope="module")
def live_reports(job):
    """Every comparison of LIVE_COMPARISONS: name -> (exit code, report)."""
    out, db = job
    return {name: checkpoint_json(run, out / cand, "--db", str(db), "--step", str(LIVE_STEP))
            for name, (run, cand) in LIVE_COMPARISONS.items()}


@pytest.fixture(scope="module")
def reports(saves):
    """Every comparison of COMPARISONS: name -> (exit code, report)."""
    return {name: checkpoint_json(saves / ref, saves / cand,
                                  *(a.format(out=saves) for a in extra), preset=preset)
            for name, (ref, cand, preset, extra) in COMPARISONS.items()}


def test_the_saves_are_bitwise_equal_by_torch(saves):
    """Ground truth without the auditor: every entry of ref/, fsdp2/ and pp/ loads back equal."""
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    def load(name: str) -> dict:
        return flatten_state_dict(_load_state_dict_from_keys(checkpoint_id=str(saves / name)))[0]

    ref = load("ref")
    assert len(ref) > 100 and any(k.startswith("optim.state.") for k in ref)
    for name in ("fsdp2", "pp"):
        other = load(name)
        assert other.keys() == ref.keys(), name
        for k, v in ref.items():
            assert (torch.equal(v, other[k]) if isinstance(v, torch.Tensor) else v == other[k]), \
                (name, k)


@pytest.mark.parametrize("ref,cand", CLEAN_PAIRS)
def test_clean_saves_are_identical_on_every_entry(saves, reports, ref, cand):
    code, report = reports[f"{ref}-{cand}"]
    entries = saved_entries(saves / ref)
    assert saved_entries(saves / cand) == entries
    summary = report["summary"]
    assert (code, summary["breaches"]) == (0, 0), summary
    assert summary["verdicts"]["identical"] == summary["keys"] == len(entries), summary
    assert len(report["findings"]) == len(entries)
    assert {f["key"]["site"] for f in report["findings"]} == entries
    assert {f["key"]["phase"] for f in report["findings"]} == {"state"}
    assert report["first_divergence"] is None


def test_bounded_memory_still_compares_every_entry(saves, reports):
    """ref-fsdp2 ran with --max-memory below the largest tensor: read in boxes, still exact."""
    code, report = reports["ref-fsdp2"]
    assert 2 * int(BOUNDED[1]) == LARGEST_TENSOR_BYTES
    assert max(f["numel"] * 4 for f in report["findings"]) == LARGEST_TENSOR_BYTES
    assert (code, report["summary"]["verdicts"]["identical"]) == (
        0, len(saved_entries(saves / "ref")))


def test_one_ulp_is_caught_where_it_was_planted(reports):
    code, report = reports["ulp-bitwise"]
    assert code == 1
    first = report["first_divergence"]
    assert (first["key"]["site"], first["verdict"]) == (ULP_SITE, "diverged")
    assert report["summary"]["breaches"] == 1  # nothing else moved
    # fp32's tolerances accept one ulp: within policy, but reported as close, never identical.
    code, report = reports["ulp-fp32"]
    assert code == 0
    assert by_site(report)[ULP_SITE]["verdict"] == "close"
    assert report["summary"]["verdicts"]["close"] == 1


def test_dropped_optimizer_state_is_reported_missing(saves, reports):
    code, report = reports["noopt"]
    dropped = saved_entries(saves / "ref") - saved_entries(saves / "noopt")
    assert dropped and all(k.startswith("optim.state.") for k in dropped)
    assert code == 1
    breaches = {f["key"]["site"]: f["verdict"] for f in report["findings"] if f["breach"]}
    assert breaches == {k: "missing_in_cand" for k in dropped}
    assert report["first_divergence"]["key"]["site"] in dropped
    assert report["summary"]["verdicts"]["identical"] == len(report["findings"]) - len(dropped)


def test_converted_weights_match_under_the_map(saves, reports):
    """hf.safetensors against the reference's model half: every weight renamed by the map, the
    head compared after the transpose the map declares."""
    code, report = reports["hf"]
    entries = saved_entries(saves / "ref_model")
    summary = report["summary"]
    assert (code, summary["breaches"]) == (0, 0), summary
    assert summary["verdicts"]["identical"] == len(report["findings"]) == len(entries)
    assert {f["key"]["site"] for f in report["findings"]} == entries


def test_a_transposed_square_weight_is_named_with_its_cause(reports):
    code, report = reports["hf_bad"]
    assert code == 1
    first = report["first_divergence"]
    assert (first["key"]["site"], first["verdict"]) == (TRANSPOSED_SITE, "diverged")
    assert report["summary"]["breaches"] == 1
    reason = (first["cause"] or {}).get("reason", "")
    assert "transpose" in reason or "permut" in reason, first


@pytest.mark.parametrize("live,files", [("fsdp2-live", "ref-fsdp2"), ("pp-live", "ref-pp")])
def test_a_live_capture_is_identical_to_the_saved_files_on_every_entry(
        saves, reports, live_reports, live, files):
    """What each rank held when it saved (FSDP2 shards; pipeline stages) against the reference
    save: every entry identical, bitwise, the same entries as reading the save back finds."""
    code, report = live_reports[live]
    entries = saved_entries(saves / "ref")
    summary = report["summary"]
    assert (code, summary["breaches"]) == (0, 0), summary
    assert summary["verdicts"]["identical"] == summary["keys"] == len(entries), summary
    assert {f["key"]["site"] for f in report["findings"]} == entries
    assert {f["key"]["phase"] for f in report["findings"]} == {"state"}
    assert len(report["findings"]) == len(reports[files][1]["findings"])
    assert report["first_divergence"] is None


def test_a_live_capture_finds_the_planted_ulp_where_the_files_do(live_reports, reports):
    code, report = live_reports["fsdp2-live-ulp"]
    assert code == 1
    first, files_first = report["first_divergence"], reports["ulp-bitwise"][1]["first_divergence"]
    assert (first["key"]["site"], first["verdict"]) == (ULP_SITE, "diverged")
    def where(finding: dict) -> dict:  # its key but the step (the live one is LIVE_STEP)
        return {k: v for k, v in finding["key"].items() if k != "step"}

    assert where(first) == where(files_first)
    assert report["summary"]["breaches"] == 1  # nothing else moved
