"""Issue 37's acceptance with real frameworks (tests/e2e/frameworks_job.py): transformers'
LlamaForCausalLM and Qwen3-MoE (tiny, random init) under one process, DDP-2 and FSDP2-2 with the
README's lines, and torchtitan's llama3 with its own parallelize function under FSDP2 and TP with
no batch-split declaration (attach(mesh=parallel_dims)).

Clean pairs pass `auditor compare --preset fp32` and `--preset bf16` with no policy and no
payload settings (most tensors are above 16 KiB); transformers' rotary cos/sin compare as
replicas; the default depth sees inside the decoder blocks; a data shift on one rank is first
found at `fwd model.embed_tokens` of its microbatch; a loss not divided by the accumulation count
is found with its factor named; accumulation 4 x 2 against 1 x 8 passes (measured by per-sample
digests at these sizes).

One daemon; the one-process runs in one job beside one 2-rank torchrun job of every other case.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys

import pytest

from tests.e2e.helpers import ROOT, Daemon, run_ok

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
pytest.importorskip("transformers")  # installed by make (pyproject's frameworks extra)
pytest.importorskip("torchtitan")

JOB = ROOT / "tests" / "e2e" / "frameworks_job.py"
SINGLE = ("llama", "moe", "tt", "llama_acc4", "llama_acc1", "llama_acc4_nodiv")
TWO_RANKS = ("llama_ddp", "llama_fsdp", "llama_ddp_shift", "moe_ddp", "moe_fsdp", "tt_fsdp",
             "tt_tp")
CLEAN = [("llama", "llama_ddp"), ("llama", "llama_fsdp"), ("moe", "moe_ddp"),
         ("moe", "moe_fsdp"), ("tt", "tt_fsdp"), ("tt", "tt_tp")]


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("frameworks")
    daemon = Daemon(tmp)
    try:
        env = dict(os.environ, NUMAUDIT_ADDR=daemon.address, OMP_NUM_THREADS="1",
                   PYTHONPATH=str(ROOT))
        for var in ("NUMAUDIT_RUN", "NUMAUDIT_RENAME_IF_TAKEN", "NUMAUDIT_PAYLOAD_MAX_BYTES",
                    "NUMAUDIT_PAYLOAD", "NUMAUDIT_PHASES", "NUMAUDIT_DEPTH", "NUMAUDIT_DP_DIMS"):
            env.pop(var, None)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            single = pool.submit(run_ok, [sys.executable, str(JOB), *(f"{c}:{c}" for c in SINGLE)],
                                 dict(env, WORLD_SIZE="1"), 400)
            run_ok([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node=2", str(JOB), *(f"{c}:{c}" for c in TWO_RANKS)], env, 500)
            single.result()
        yield daemon.db
    finally:
        daemon.stop()


_REPORTS: dict[tuple, tuple[int, dict]] = {}


def compare(db, ref: str, cand: str, preset: str = "fp32") -> tuple[int, dict]:
    """`auditor compare REF CAND --preset P --format json`, through the CLI's entry point in
    this process (each pair once)."""
    key = (str(db), ref, cand, preset)
    if key not in _REPORTS:
        from click.testing import CliRunner

        from numaudit.auditor.cli import main

        res = CliRunner().invoke(main, ["compare", ref, cand, "--db", str(db), "--preset", preset,
                                        "--format", "json"])
        assert res.exit_code in (0, 1), f"exit {res.exit_code}: {res.output[-3000:]}"
        _REPORTS[key] = res.exit_code, json.loads(res.stdout)
    return _REPORTS[key]


def _sites(report: dict, phase: str = "fwd") -> set[str]:
    return {f["key"]["site"] for f in report["findings"] if f["key"]["phase"] == phase}


@pytest.mark.parametrize("preset", ["fp32", "bf16"])
@pytest.mark.parametrize("ref, cand", CLEAN)
def test_clean_pairs_pass_with_no_policy_and_no_payload_settings(db, ref, cand, preset):
    code, report = compare(db, ref, cand, preset)
    summary = report["summary"]
    assert (code, summary["breaches"]) == (0, 0), summary
    v = summary["verdicts"]
    assert v["missing_in_ref"] == v["missing_in_cand"] == v["incomplete"] == 0, v


@pytest.mark.parametrize("ref, cand", [("llama", "llama_ddp"), ("moe", "moe_fsdp")])
def test_rotary_outputs_are_replicas_and_blocks_are_seen_inside(db, ref, cand):
    """transformers' rotary cos/sin ([1, seq, dim] on every rank) are identical replicas, not
    batch pieces of [2, seq, dim]; the default depth reaches the blocks' attention, MLP and
    norms (model.layers.N.*), one level below the absolute max_depth of 3."""
    _, report = compare(db, ref, cand)
    rotary = [f for f in report["findings"] if f["key"]["site"] == "model.rotary_emb"]
    assert rotary and all(f["verdict"] == "identical" for f in rotary), rotary[:2]
    assert {"model.layers.0.self_attn", "model.layers.0.mlp", "model.layers.0.input_layernorm",
            "model.layers.1.post_attention_layernorm"} <= _sites(report)


def test_torchtitan_needs_no_batch_split_declaration(db):
    """attach(model, mesh=parallel_dims): the data-loading mesh's `batch` dim splits the
    samples under FSDP2; under TP (its `tp` dim spans the world) there is one dp rank."""
    from numaudit.auditor.store import Reader

    reader = Reader(db)
    try:
        info = {run: reader.run_info(run) for run in ("tt_fsdp", "tt_tp")}
    finally:
        reader.close()
    assert list(info["tt_fsdp"]["mesh_dim_names"]) == ["batch"]
    assert list(info["tt_tp"]["mesh_dim_names"]) == ["tp"]
    for cand in ("tt_fsdp", "tt_tp"):
        _, report = compare(db, "tt", cand)
        assert {"layers.0.attention", "layers.1.feed_forward"} <= _sites(report)


def test_a_data_shift_on_one_rank_is_first_found_at_the_embedding(db):
    code, report = compare(db, "llama", "llama_ddp_shift")
    first = report["first_divergence"]
    assert code == 1 and first is not None
    k = first["key"]
    assert (k["phase"], k["site"], k["step"], k["microbatch"]) == (
        "fwd", "model.embed_tokens", 0, 1), first


def test_a_loss_not_divided_by_the_accumulation_count_is_named(db):
    code, report = compare(db, "llama_acc4", "llama_acc4_nodiv")
    first = report["first_divergence"]
    assert code == 1 and first["key"]["phase"] == "grad", first
    assert first["metrics"]["scaled_by"] == 4.0, first["metrics"]
    assert "x4 = 4 microbatches a step" in " ".join(first["notes"]), first["notes"]


@pytest.mark.parametrize("preset", ["fp32", "bf16"])
def test_accumulation_4x2_against_1x8_passes_at_real_sizes(db, preset):
    """Tensors of 24-96 KiB (no payloads): regrouped keys whose bits differ are measured by
    per-sample digests; the rotary outputs of the 4 microbatches are replicas of the one's
    (before: missing_in_ref at microbatches 1-3, or in the one microbatch side's terms)."""
    code, report = compare(db, "llama_acc1", "llama_acc4", preset)
    summary = report["summary"]
    assert (code, summary["breaches"]) == (0, 0), summary
    assert summary["verdicts"]["missing_in_ref"] == summary["verdicts"]["missing_in_cand"] == 0
    rotary = [f for f in report["findings"] if f["key"]["site"] == "model.rotary_emb"]
    assert rotary and all(f["verdict"] == "identical" for f in rotary), rotary[:2]
