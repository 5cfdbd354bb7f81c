"""Where activations hold the batch (issue 9's conventions, beyond the batch on dim 0): a 2-rank
DDP and FSDP2 run of a model with an LSTM, a MultiheadAttention and a tied head
(tests/e2e/seq_job.py) against one process. torch's modules say their own batch dim (an LSTM's
hidden states hold it on dim 1 whatever `batch_first` says); sequence-first code declares
`batch_dim=1`, and without it the report says which dim the split is on."""

from __future__ import annotations

import concurrent.futures
import sys

import pytest

from tests.e2e.helpers import ROOT, Daemon, compare_json, job_env, run_ok

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

JOB = ROOT / "tests" / "e2e" / "seq_job.py"



@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch_dims")
    daemon = Daemon(tmp)
    try:
        env = job_env(daemon)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            ref = pool.submit(run_ok, [sys.executable, str(JOB), "single:ref",
                                     "single_seq:ref_seq"], dict(env, WORLD_SIZE="1"))
            run_ok([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc-per-node=2", str(JOB), "ddp:ddp", "fsdp:fsdp", "ddp_seq:ddp_seq",
                  "ddp_seq_undeclared:ddp_seq_undeclared"], env)
            ref.result()
        yield daemon.db
    finally:
        daemon.stop()



@pytest.mark.parametrize("ref, cand", [("ref", "ddp"), ("ref", "fsdp"), ("ref_seq", "ddp_seq")])
def test_rnn_and_attention_outputs_rebuild_on_their_batch_dim(store, ref, cand):
    """The LSTM's output and hidden states, the attention's output and weights and the model's
    own modules: every key aligned and within policy."""
    code, report = compare_json(store, ref, cand)
    summary = report["summary"]
    assert (code, summary["breaches"], summary["keys"]) == (0, 0, 102), summary
    sites = {f["key"]["site"] for f in report["findings"]}
    assert {"lstm", "attn", "mix"} <= sites


def test_sequence_first_code_that_does_not_say_so_is_told_which_dim(store):
    """Sequence-first tensors concatenated on dim 0 do not rebuild the reference's: the shape
    differs, and the note says the batch looks to be on dim 1 and how to declare it."""
    code, report = compare_json(store, "ref_seq", "ddp_seq_undeclared")
    first = report["first_divergence"]
    assert code == 1 and first["key"]["site"] == "emb"
    notes = " ".join(first["notes"])
    assert "logical shape [5, 4, 8] in ref_seq, [10, 2, 8] in ddp_seq_undeclared" in notes
    assert "batch on dim 1" in notes and "batch_dim=1" in notes
