"""Issue 9's acceptance matrix: a single-process reference against DDP-2 (also accumulating
gradients under no_sync, as DDP users do), FSDP2-2, TP-2 (also with sequence parallelism, as
torchtitan plans a transformer) and pipelining (GPipe, 1F1B, Interleaved1F1B), each as users
write it (tests/e2e/parallel_job.py), 2 steps of 4 microbatches, `bwd` captured; clean pairs
pass the fp32 preset (PP bitwise), and each planted bug is caught where it was planted. One
daemon serves the whole matrix; all two-rank cases run in one torchrun job (cases in sequence
in one process group), so the module costs four process starts: the reference and the matrix
job (side by side), a rerun under a taken name, and a 4-rank job (FOUR_RANKS).

Gradient clipping (issue 11) has its own reference in the reference's process, `ref_clip`: the
same loop with clip_grad_norm_ and the optimizer watched (phases optim_grad and update), so
`ref` and the clean pairs against it are unchanged. Against it, a pipeline clipping by the
global norm is bitwise identical and one clipping each stage by its local norm breaches in
step 0 at optim_grad.

Loss conventions inferred from the evidence (auditor/compare/conventions/): torchtitan's
normalization (each rank's summed loss over the global token count), captured as every case
captures its loss (default reduce), either backpropagated times the world size under DDP's
averaging (`ddp_loss_sum`) or as is with the gradients summed (`ddp_grad_sum`), passes with the
convention said in the warnings; one rank normalizing by its own token count
(`ddp_loss_sum_bug`) is not taken as a sum and breaches at the loss.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.helpers import ROOT, Daemon
from tests.e2e.parallel_job import BATCH, DIM, SEQ

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

JOB = ROOT / "tests" / "e2e" / "parallel_job.py"
CLEAN = ("ddp", "ddp_no_sync", "fsdp", "fsdp_no_mesh", "fsdp1", "fsdp1_orig", "tp",
         "tp_dtensor_logits", "tp_sp", "tp_sp_ac", "pp_gpipe", "pp_1f1b", "pp_interleaved",
         "ddp_loss_sum", "ddp_grad_sum")
BUGS = ("ddp_skip_allreduce", "ddp_no_sync_always", "ddp_loss_quarter", "ddp_frozen",
        "ddp_wrong_data", "fsdp1_comm_sum", "fsdp1_frozen", "tp_partial", "tp_sp_norm_plain",
        "pp_detach", "pp_swap", "ddp_loss_sum_bug")
CLIP = ("pp_clip_global", "pp_clip_local", "fsdp1_clip", "fsdp1_clip_local")
ACCUMULATION = ("ddp_acc_div",)
"""DDP that divides each microbatch's loss by the 4 accumulated microbatches after capturing it:
against `ddp` (which does not divide), issue 41's loss not divided by the accumulation count."""
DRILL = ("drill_tp", "drill_tp_noreduce")
"""A Megatron-style tensor-parallel block with its operations captured (tests/e2e/drill_job.py),
and the same block whose all-reduce is left out (issue 43)."""
FOUR_RANKS = ("fsdp_tp_sp", "fsdp_tp_sp_norm_plain", "hsdp", "fsdp1_hybrid", "pp_tp_sp")
"""Cases in their own 4-rank job: FSDP2 over dp=2 x TP with sequence parallelism over tp=2,
HSDP (FSDP2 sharding over dp_shard=2, replicated over dp_replicate=2), FSDP1's HYBRID_SHARD
(the same split), and 2 pipeline stages x TP with sequence parallelism over tp=2."""


def _env(daemon: Daemon, **extra: str) -> dict:
    env = dict(os.environ, NUMAUDIT_ADDR=daemon.address, NUMAUDIT_PHASES="fwd,bwd,grad,loss,input",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), **extra)
    env.pop("NUMAUDIT_RUN", None)
    env.pop("NUMAUDIT_RENAME_IF_TAKEN", None)
    env.update(extra)
    return env


def _run(cmd: list[str], env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-4000:]}")
    return proc


def _torchrun(*cases: str, env: dict, nproc: int = 2) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc-per-node={nproc}", str(JOB), *cases], env)


class Matrix:
    def __init__(self, daemon: Daemon, out: Path, rerun: subprocess.CompletedProcess) -> None:
        self.daemon, self.out, self.rerun = daemon, out, rerun
        self._reports: dict[tuple[str, str, str], tuple[int, str]] = {}

    def compare(self, cand: str, fmt: str = "json", ref: str = "ref") -> tuple[int, object]:
        """`auditor compare REF CAND --preset fp32`, as a user runs it: (exit code, report).

        Each (ref, cand, format) is compared once: the store is complete when the fixture
        returns, so tests asking for the same report read the one made first (a fresh copy)."""
        key = (ref, cand, fmt)
        if key not in self._reports:
            path = self.out / f"{ref}-{cand}.{fmt}"
            proc = subprocess.run(
                [sys.executable, "-m", "numaudit.auditor", "compare", ref, cand, "--db",
                 str(self.daemon.db), "--preset", "fp32", "--format", fmt, "-o", str(path)],
                cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                text=True, timeout=120)
            assert proc.returncode in (0, 1), proc.stderr
            self._reports[key] = proc.returncode, path.read_text()
        code, text = self._reports[key]
        return code, (json.loads(text) if fmt == "json" else text)

    def show(self, run: str) -> str:
        return _run([sys.executable, "-m", "numaudit.auditor", "show", run,
                     "--db", str(self.daemon.db)], dict(os.environ, PYTHONPATH=str(ROOT))).stdout


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> Matrix:
    tmp = tmp_path_factory.mktemp("matrix")
    daemon = Daemon(tmp)
    try:
        env = _env(daemon)
        # The reference is one process: it runs beside the matrix job (other run names, the
        # same daemon) on the core that job's start-up leaves it, instead of before it.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            ref = pool.submit(_run, [sys.executable, str(JOB), "single:ref",
                                     "single_clip:ref_clip"], dict(env, WORLD_SIZE="1"))
            _torchrun(*(f"{c}:{c}" for c in CLEAN + BUGS + CLIP + ACCUMULATION + DRILL),
                      env=env)
            ref.result()
        # A second job under a name the first one owns: refused; then asked to rename.
        # Its records are spooled (for `auditor ingest --run NEW`), here into the test's folder.
        rerun = _torchrun("ddp:ddp", "ddp+rename:ddp",
                          env=dict(env, NUMAUDIT_SPOOL=str(tmp / "spool")))
        _torchrun(*(f"{c}:{c}" for c in FOUR_RANKS), env=env, nproc=4)
        yield Matrix(daemon, tmp, rerun)
    finally:
        daemon.stop()


@pytest.mark.parametrize("cand", CLEAN + ("fsdp_tp_sp", "hsdp", "fsdp1_hybrid", "pp_tp_sp"))
def test_clean_pairs_pass_the_fp32_preset(matrix, cand):
    code, report = matrix.compare(cand)
    summary = report["summary"]
    assert (code, summary["breaches"]) == (0, 0), summary
    assert summary["keys"] == 370  # every key of the reference aligned
    if cand.startswith("pp_"):
        assert report["runs"]["cand"]["labels"]["pp_param_grads"] == "summed"
    if cand.startswith("pp_") and "_tp_" not in cand:
        assert summary["verdicts"]["identical"] == summary["keys"]  # pipelining is bitwise


def test_activation_gradient_scale_is_inferred_per_run(matrix):
    _, report = matrix.compare("ddp")
    assert report["runs"]["ref"]["grad_scale"] == 1.0
    assert report["runs"]["cand"]["grad_scale"] == 2.0
    assert report["runs"]["cand"]["grad_scale_sources"][0].startswith(
        "inferred: per-rank mean loss with gradients averaged over 2 dp ranks")


LOSS_AS_SUM = ("{}'s per-rank losses are sums over its 2 dp ranks, not means: merged as a sum "
               "they equal ref's loss (as a mean, the default for phase loss, x0.5), and the "
               "parameter gradients agree")


@pytest.mark.parametrize("cand", ["ddp_loss_sum", "ddp_grad_sum"])
def test_a_globally_normalized_loss_is_taken_as_the_runs_convention(matrix, cand):
    """Each rank's loss is its summed per-token losses over the step's global token count: the
    ranks' losses add up to the reference's, read as sums (said in the warnings and on every
    loss key). Backpropagated times the world size under DDP's averaging, the activation
    gradients are the x2 the agent infers; backpropagated as is with the gradients summed, they
    are the reference's, the x1 taken from the evidence."""
    code, report = matrix.compare(cand)
    assert (code, report["summary"]["breaches"]) == (0, 0), report["summary"]
    warnings = report["warnings"]
    assert warnings[0].startswith(LOSS_AS_SUM.format(cand)), warnings
    losses = [f for f in report["findings"] if f["key"]["phase"] == "loss"]
    assert len(losses) == 8 and all("inferred from the evidence" in " ".join(f["notes"])
                                    for f in losses), losses[0]
    if cand == "ddp_loss_sum":
        assert len(warnings) == 1, warnings
    else:
        assert len(warnings) == 2, warnings
        assert warnings[1].startswith(
            "activation gradients (phase bwd): every one of ddp_grad_sum's is x0.5 of what the "
            "runs' agents inferred from their data-parallel sizes, while the parameter gradients "
            "agree: compared after the x1 inferred from the evidence (each rank's loss "
            "normalized by the whole batch, gradients summed over ranks"), warnings


def test_a_loss_normalized_by_one_ranks_own_tokens_is_not_taken_as_a_sum(matrix):
    """Rank 1 divides its summed loss by its own token count: neither a mean nor a sum of the
    ranks' losses is the reference's, and the gradients differ, so nothing is inferred: the
    first divergence is step 0's first loss, introduced there, and the activation gradients
    below it differ on rank 1's rows only."""
    _, report = matrix.compare("ddp_loss_sum_bug")
    first = _first(report)
    assert (first["verdict"], _key(first), first["cause"]["kind"]) == (
        "diverged", ("loss", "loss", 0, 0), "introduced")
    assert any("neither as a mean nor as a sum over its 2 dp ranks" in n and
               "no loss reduction explains the difference" in n for n in first["notes"])
    assert not any("per-rank losses are sums" in w or "inferred from the evidence" in w
                   for w in report["warnings"]), report["warnings"]
    found = {(f["key"]["phase"], f["key"]["site"]): f for f in report["findings"]
             if f["key"]["step"] == 0 and f["key"]["microbatch"] in (0, -1)}
    assert found[("grad", "out.weight")]["verdict"] == "diverged"
    assert [d["ranks"] for d in found[("bwd", "out")]["pieces"]["differ"]] == [[1]]


def _first(report) -> dict:
    first = report["first_divergence"]
    assert first is not None and report["summary"]["exit_code"] == 1
    return first


def _key(finding) -> tuple:
    k = finding["key"]
    return k["phase"], k["site"], k["step"], k["microbatch"]


def test_gradient_all_reduce_skipped_on_one_rank(matrix):
    first = _first(matrix.compare("ddp_skip_allreduce")[1])
    assert first["verdict"] == "replica_divergence"
    assert _key(first)[0] == "grad" and _key(first)[2] == 0
    assert "ranks 1 disagree with rank 0" in first["detail"]


def test_gradients_never_synced_under_no_sync(matrix):
    """Every microbatch's backward under DDP's no_sync (the accumulation's last one included):
    each rank steps on its own gradients, caught in the first step's gradients as replicas
    that disagree; the forward of that step is still identical to the clean accumulation."""
    _, report = matrix.compare("ddp_no_sync_always")
    first = _first(report)
    assert first["verdict"] == "replica_divergence"
    assert _key(first)[0] == "grad" and _key(first)[2] == 0
    assert "a collective over dp is missing or wrong" in first["cause"]["reason"]
    verdicts = {_key(f): f["verdict"] for f in report["findings"]}
    assert all(v in ("identical", "close") for k, v in verdicts.items()
               if k[2] == 0 and k[0] in ("fwd", "bwd", "loss")), verdicts


def test_fsdp1_flat_parameters_compare_with_whole_and_sharded_ones(matrix):
    """FSDP1 (FlatParameters, both forms) keeps each rank's range of a parameter, which is not a
    box of its shape: captured as flat pieces, they rebuild each original parameter, bitwise
    equal to FSDP2's Shard(0) boxes of it, and compare with one another as with the single
    process."""
    for cand, ref in (("fsdp1", "fsdp"), ("fsdp1_orig", "fsdp1")):
        code, report = matrix.compare(cand, ref=ref)
        assert (code, report["summary"]["breaches"], report["summary"]["keys"]) == (0, 0, 370)
    assert matrix.compare("fsdp1", ref="fsdp")[1]["summary"]["verdicts"]["identical"] == 370
    _, report = matrix.compare("fsdp1")
    weight = [f for f in report["findings"] if _key(f) == ("grad", "layers.0.w1.weight", 0, -1)]
    assert weight and weight[0]["verdict"] in ("identical", "close")


def test_fsdp1_reduce_scatter_that_sums(matrix):
    """An FSDP1 comm hook that sums the gradients' reduce-scatter instead of averaging: the first
    divergence is step 0's first parameter gradient, scaled by the dp size, while that step's
    forward and backward still match."""
    _, report = matrix.compare("fsdp1_comm_sum")
    first = _first(report)
    assert (first["verdict"], _key(first)[0], _key(first)[2]) == ("diverged", "grad", 0)
    assert first["metrics"]["norm_ratio"] == pytest.approx(2.0, rel=1e-5)
    verdicts = {_key(f): f["verdict"] for f in report["findings"]}
    assert all(v in ("identical", "close") for k, v in verdicts.items()
               if k[2] == 0 and k[0] in ("fwd", "bwd", "loss")), verdicts


def test_fsdp1_frozen_parameter_is_a_graph_break_on_every_rank(matrix):
    """A frozen parameter under FSDP1 (use_orig_params=True): its gradient is None on the rank
    that holds its range and on those that hold none of it alike, so it is one graph break."""
    _, report = matrix.compare("fsdp1_frozen")
    first = _first(report)
    assert (first["verdict"], _key(first)) == ("grad_none", ("grad", "layers.1.w1.weight", 0, -1))
    (brk,) = report["graph_breaks"]
    assert (brk["side"], brk["kind"], brk["sites"]) == ("cand", "none", ["layers.1.w1.weight"])


def test_loss_scaled_by_a_quarter(matrix):
    first = _first(matrix.compare("ddp_loss_quarter")[1])
    assert _key(first) == ("loss", "loss", 0, 0)
    assert first["metrics"]["norm_ratio"] == pytest.approx(0.25, rel=1e-5)
    text = matrix.compare("ddp_loss_quarter", "text")[1]
    assert "scaled by 0.25" in text


def test_one_parameter_frozen(matrix):
    _, report = matrix.compare("ddp_frozen")
    first = _first(report)
    assert (first["verdict"], _key(first)) == ("grad_none", ("grad", "layers.1.w1.weight", 0, -1))
    (brk,) = report["graph_breaks"]
    assert (brk["side"], brk["kind"], brk["sites"]) == ("cand", "none", ["layers.1.w1.weight"])


def test_detach_at_a_stage_boundary(matrix):
    _, report = matrix.compare("pp_detach")
    first = _first(report)
    assert _key(first) == ("bwd", "layers.1", 0, 0) and first["stage"] == 0
    assert first["metrics"]["payload"]["rel_l2"] == pytest.approx(1.0)  # all zero in cand
    assert any(b["kind"] == "zero" and b["stage"] == 0 for b in report["graph_breaks"])


def test_one_parameter_frozen_is_explained_as_frozen_or_unused(matrix):
    (brk,) = matrix.compare("ddp_frozen")[1]["graph_breaks"]
    text = brk["message"] + " " + (brk["boundary"] or "")
    assert "gradients stop at the model" not in text
    assert re.search(r"frozen|unused|requires_grad", text), text


def test_detach_at_a_stage_boundary_is_explained_by_zero_activation_gradients(matrix):
    breaks = [b for b in matrix.compare("pp_detach")[1]["graph_breaks"] if b["stage"] == 0]
    text = " ".join(b["message"] + " " + (b["boundary"] or "") for b in breaks)
    assert "skipped weight-gradient step" not in text
    assert re.search(r"detach|activation gradients[^.]*zero", text), text


def test_rowwise_output_left_partial(matrix):
    first = _first(matrix.compare("tp_partial")[1])
    assert (first["verdict"], _key(first)) == ("replica_divergence", ("fwd", "layers.1.w2", 0, 0))
    assert "ranks 1 disagree with rank 0" in first["detail"]


def test_a_loss_from_dtensor_logits_rebuilds_from_each_ranks_addend(matrix):
    """The head left as DTensors (ColwiseParallel(use_local_output=False)): the loss,
    ``logits.square().mean()``, is a Partial(avg) DTensor, each tp rank's local mean one
    addend; it rebuilds as the reference's loss."""
    _, report = matrix.compare("tp_dtensor_logits")
    losses = [f for f in report["findings"] if f["key"]["phase"] == "loss"]
    assert len(losses) == 8 and {f["verdict"] for f in losses} <= {"identical", "close"}
    assert all(f["ranks"]["cand"] == [0, 1] for f in losses), losses[0]


def test_sequence_parallel_blocks_rebuild_from_each_ranks_tokens(matrix):
    """TP with sequence parallelism: the embedding's and every block's output are plain tensors
    holding each rank's tokens. They are pieces of the logical activation (rebuilt, compared
    with the reference's, not replicas), as are their gradients."""
    _, report = matrix.compare("tp_sp")
    found = {(f["key"]["phase"], f["key"]["site"]): f for f in report["findings"]
             if f["key"]["step"] == 0 and f["key"]["microbatch"] == 0}
    for phase in ("fwd", "bwd"):
        for site in ("tok", "layers.0", "layers.3", "layers.2.w2"):
            f = found[(phase, site)]
            assert f["verdict"] in ("identical", "close"), f
            assert f["shape"] == [BATCH, SEQ, DIM] and f["ranks"]["cand"] == [0, 1], f


@pytest.mark.parametrize("cand", ["tp_sp_norm_plain", "fsdp_tp_sp_norm_plain"])
def test_sequence_parallel_norm_left_out_of_the_plan(matrix, cand):
    """Also under FSDP2 (2-D), where the norm's parameters are DTensors over dp only: copies
    over tp, compared with each other as replicas."""
    first = _first(matrix.compare(cand)[1])
    assert first["verdict"] == "replica_divergence"
    assert _key(first)[:3] in (("grad", "layers.1.norm.weight", 0),
                               ("grad", "layers.1.norm.bias", 0)), first
    assert "a collective over tp is missing or wrong" in first["cause"]["reason"]


def test_a_pipeline_stage_of_sequence_parallel_blocks_places_its_tokens(matrix):
    """3-D, 2 pipeline stages each TP + SP over 2 ranks: the second stage's first block gets
    its tokens from the first stage (no input the agent saw), and is still placed as each tp
    rank's tokens, from its w2's output."""
    _, report = matrix.compare("pp_tp_sp")
    found = {(f["key"]["phase"], f["key"]["site"]): f for f in report["findings"]
             if f["key"]["step"] == 0 and f["key"]["microbatch"] == 0}
    for site, ranks in (("layers.1", [0, 1]), ("layers.2", [2, 3]), ("layers.3", [2, 3])):
        for phase in ("fwd", "bwd"):
            f = found[(phase, site)]
            assert f["verdict"] in ("identical", "close"), f
            assert f["shape"] == [BATCH, SEQ, DIM] and f["ranks"]["cand"] == ranks, f


def test_fsdp_and_sequence_parallel_place_each_ranks_rows_and_tokens(matrix):
    """2-D: each rank's activations are its dp rank's rows and its tp rank's tokens; the
    SequenceParallel norms' DTensor outputs (on the tp mesh only) are placed in the batch
    too."""
    _, report = matrix.compare("fsdp_tp_sp")
    found = {(f["key"]["phase"], f["key"]["site"]): f for f in report["findings"]
             if f["key"]["step"] == 0 and f["key"]["microbatch"] == 0}
    for site in ("tok", "layers.0.norm", "layers.0", "layers.3.w2", "norm"):
        f = found[("fwd", site)]
        assert f["verdict"] in ("identical", "close"), f
        assert f["shape"] == [BATCH, SEQ, DIM] and f["ranks"]["cand"] == [0, 1, 2, 3], f


def test_two_microbatches_swapped(matrix):
    first = _first(matrix.compare("pp_swap")[1])
    assert _key(first) == ("fwd", "tok", 0, 1) and first["stage"] == 0


def test_one_rank_reads_another_ranks_data(matrix):
    first = _first(matrix.compare("ddp_wrong_data")[1])
    assert _key(first) == ("fwd", "tok", 0, 0)


def test_one_rank_reads_another_ranks_data_is_localized_to_that_rank(matrix):
    text = matrix.compare("ddp_wrong_data", "text")[1]
    section = text.split("First divergence", 1)[1].split("\n\n", 1)[0]
    section = re.sub(r"ranks: ref .*", "", section)
    assert re.search(r"\branks? 1\b", section), section


def test_rerun_under_an_existing_name_is_refused_then_renamed(matrix):
    log = matrix.rerun.stdout + matrix.rerun.stderr
    refused = [line for line in log.splitlines()
               if "ERROR" in line and "ALREADY_EXISTS" in line and "'ddp' belongs to another job"
               in line]
    assert len(refused) == 2, log[-3000:]  # one clear error per rank
    spooled = re.findall(r"numaudit run=ddp: captured 370: acked by the auditor 0, "
                         r"spooled 370 in \S+, dropped 0; "
                         r".*`(auditor ingest \S+ --run NEW_NAME --address \S+)` "
                         r"stores them under a new name", log)
    assert len(spooled) == 2, log[-3000:]  # nothing lost to the name clash: told how to keep it
    kept = re.findall(r"numaudit run=ddp\.2: captured 370: acked by the auditor 370,", log)
    assert len(kept) == 2
    shown = matrix.show("ddp")
    assert "2 ranks registered" in shown and "740 records" in shown  # the first job's, untouched
    assert "conflicts: 0" in shown
    code, report = matrix.compare("ddp.2")
    assert code == 0 and report["runs"]["cand"]["ranks_registered"] == 2
    # the refused job's spools, stored as its log says, under a new name: the same run as ddp
    files = [cmd.split()[2] for cmd in spooled]
    _run([sys.executable, "-m", "numaudit.auditor", "ingest", *files, "--run", "ddp_kept",
          "--address", matrix.daemon.address], dict(os.environ, PYTHONPATH=str(ROOT)))
    code, report = matrix.compare("ddp_kept", ref="ddp")
    assert code == 0 and report["summary"]["keys"] == 370, report["summary"]


CLIP_KEYS = 370 + 2 * 2 * 29
"""ref's keys plus optim_grad and update of the model's 29 parameters in each of the 2 steps."""


def test_pipeline_clipping_by_the_global_norm_passes_bitwise(matrix):
    code, report = matrix.compare("pp_clip_global", ref="ref_clip")
    summary = report["summary"]
    assert (code, summary["breaches"]) == (0, 0), summary
    assert summary["keys"] == CLIP_KEYS
    assert summary["verdicts"]["identical"] == CLIP_KEYS  # optim_grad and update included
    phases = {f["key"]["phase"] for f in report["findings"]}
    assert {"optim_grad", "update"} <= phases


def test_fsdp1_clipping_by_its_own_clip_grad_norm_passes(matrix):
    """FSDP1's clip_grad_norm_ takes the norm over every rank's shard: the optimizer-side
    gradients and updates of its flat parameters, captured per original parameter, match."""
    code, report = matrix.compare("fsdp1_clip", ref="ref_clip")
    summary = report["summary"]
    assert (code, summary["breaches"], summary["keys"]) == (0, 0, CLIP_KEYS), summary
    phases = {f["key"]["phase"] for f in report["findings"]}
    assert {"optim_grad", "update"} <= phases


def test_fsdp1_clipping_by_each_ranks_shard_norm_is_told_per_rank(matrix):
    """torch.nn.utils.clip_grad_norm_ on FSDP1's flat parameters sees only this rank's shard:
    each rank clips by its own norm. Caught at step 0's optim_grad, and the cause gives each
    rank's factor."""
    _, report = matrix.compare("fsdp1_clip_local", ref="ref_clip")
    first = _first(report)
    assert (_key(first)[0], _key(first)[2]) == ("optim_grad", 0)
    reason = first["cause"]["reason"]
    assert first["cause"]["kind"] == "introduced", reason
    assert re.search(r"rank 0 x[0-9.]+, rank 1 x[0-9.]+\)", reason), reason
    assert "norm of each rank's shard instead of the global norm" in reason


def test_pipeline_clipping_by_each_stages_local_norm_breaches_at_optim_grad(matrix):
    _, report = matrix.compare("pp_clip_local", ref="ref_clip")
    first = _first(report)
    # the step where it happens, at the optimizer-side gradient, not a later forward
    assert _key(first) == ("optim_grad", "tok.weight", 0, -1) and first["stage"] == 0
    reason = first["cause"]["reason"]
    assert first["cause"]["kind"] == "introduced", reason
    assert "the gradients matched before the optimizer" in reason
    assert "differ as it consumed them" in reason
    assert re.search(r"stage 0 x3\.69, stage 1 x1\.04", reason), reason
    assert "local norm instead of the global norm" in reason
    verdicts = {_key(f): f["verdict"] for f in report["findings"]}
    step0 = {k: v for k, v in verdicts.items() if k[2] == 0 and k[0] in ("fwd", "bwd", "grad")}
    assert len(step0) > 29 and set(step0.values()) == {"identical"}
    assert verdicts[("optim_grad", "out.weight", 0, -1)] == "diverged"  # stage 1 clipped too


@pytest.mark.parametrize("ref", ["ddp_acc_div", "ddp_loss_quarter"])
def test_a_loss_not_divided_by_the_accumulation_count_fits_one_screen(matrix, ref):
    """Issue 41's acceptance: the loss divided by the 4 accumulated microbatches (after its
    capture, or before) against `ddp`, which does not divide, both DDP on 2 ranks of an
    18-module model. The text report `auditor compare -o FILE` writes fits in 40 lines and
    says the factor once per group; the JSON report keeps every finding, each naming its
    group, and the groups count them all."""
    code, text = matrix.compare("ddp", "text", ref=ref)
    assert code == 1 and len(text.splitlines()) <= 40, text
    flat = " ".join(text.split())
    assert "29 parameter gradients of step 0: all scaled by 4.00" in flat
    assert flat.count("x4 = 4 microbatches a step of ddp") <= 2  # the first divergence, grads
    _, report = matrix.compare("ddp", ref=ref)
    breaches = [f for f in report["findings"] if f["breach"]]
    assert len(breaches) == report["summary"]["breaches"] > 250
    groups = report["groups"]
    assert sum(g["count"] for g in groups) == len(breaches)
    assert {f["group"] for f in breaches} == {g["index"] for g in groups}
    # the losses of step 1 differ as any two scalars do: no factor is named for them
    assert not [g for g in groups if g["phase"] == "loss" and 1 in g["steps"] and
                g["scaled_by"] is not None], groups
    for g in groups:
        assert g["headline"] in flat
        members = [f for f in breaches if f["group"] == g["index"]]
        assert len(members) == g["count"] and set(g["sites"]) == {f["key"]["site"]
                                                                  for f in members}


def test_a_missing_all_reduce_is_named_as_the_absent_collective(matrix):
    """Operations of the TP block (issue 43): the candidate's all-reduce is absent, named as
    the collective it leaves out; the block's shards and partial sums, which both runs' ranks
    hold each their own, compare rank by rank (the reference against itself: no finding)."""
    code, report = matrix.compare("drill_tp_noreduce", ref="drill_tp")
    assert code == 1
    ops = report["ops"]
    assert ops["modules"] == ["block"] and ops["calls"] == 4
    fwd = [f for f in ops["findings"] if f["phase"] == "fwd"]
    assert len(fwd) == 2  # one per microbatch
    for f in fwd:
        assert f["kind"] == "absent" and f["op"].startswith("c10d.allreduce_"), f
        assert "the 6 operations before it match" in f["reason"]
        assert "the module's output differs" in f["reason"]
    code, same = matrix.compare("drill_tp", ref="drill_tp")
    assert same["ops"]["findings"] == [] and same["ops"]["calls"] == 4

