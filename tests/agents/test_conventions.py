"""Issue 9, agent side, against a real auditor: reductions, grad_scale, replicas, small payloads,
run identity (one job per run name), and dp_rank=0 taken at its word."""

from __future__ import annotations

import logging

import pytest
import torch

import numaudit
from numaudit.agents.capture.normalization import grad_scale
from numaudit.agents.config import AgentConfig, apply_env, check
from numaudit.agents.identity import RankIdentity, job_identity
from numaudit.auditor.store import RECORD_COLUMNS, Reader
from numaudit.protos import numaudit_pb2 as pb

pytestmark = pytest.mark.timeout(60)
COL = {name: i for i, name in enumerate(RECORD_COLUMNS)}


def _rows(db, run):
    reader = Reader(db)
    try:
        return [dict(zip(RECORD_COLUMNS, r)) for r in reader.records(run)]
    finally:
        reader.close()


def _run_info(db, run):
    reader = Reader(db)
    try:
        return reader.run_info(run), reader.conflicts(run)
    finally:
        reader.close()


def _one_step(agent, site="loss", value=2.0, batch=3):
    with agent.step(0), agent.microbatch(0):
        agent.capture(torch.ones(batch, 2), site="tokens", phase="input")
        agent.capture(torch.tensor(value), site=site, phase="loss")


def test_dp_rank_zero_and_dp_size_one_are_taken_at_their_word(monkeypatch):
    """`dp_rank or cfg.dp_rank` dropped the 0; on rank 1 of 2 it then raised."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    agent = numaudit.attach(None, dp_rank=0, dp_size=1)
    assert (agent.ident.dp_rank, agent.ident.dp_size) == (0, 1)
    assert agent.ident.ranks_per_dp_rank == 2  # the other rank holds the same batch share


def test_loss_is_a_weighted_mean_reduction_over_dp_by_default(auditor_server):
    agent = numaudit.attach(None, run="r", address=auditor_server.address, dp_rank=1, dp_size=2)
    _one_step(agent)
    agent.capture(torch.tensor(1.0), site="aux", phase="loss", reduce="sum")
    agent.capture(torch.tensor(1.0), site="plain", phase="loss", reduce=None)
    s = agent.close()
    assert s["acked"] == s["captured"] == 4
    rows = {r["site"]: r for r in _rows(auditor_server.db_path, "r")}
    loss = rows["loss"]
    assert (loss["reduce"], loss["reduce_index"], loss["reduce_count"]) == (pb.REDUCTION_MEAN, 1, 2)
    assert loss["reduce_weight"] == 3.0  # dim 0 of the microbatch's input capture
    assert loss["logical_shape"] == "[]" and loss["shape"] == "[]"
    assert rows["aux"]["reduce"] == pb.REDUCTION_SUM
    assert rows["plain"]["reduce"] == pb.REDUCTION_NONE and rows["plain"]["logical_shape"] == "[2]"
    assert rows["tokens"]["logical_shape"] == "[6, 2]" and rows["tokens"]["offsets"] == "[3, 0]"


def test_weight_comes_from_microbatch_size_or_the_argument(auditor_server):
    agent = numaudit.attach(None, run="r", address=auditor_server.address, dp_rank=0, dp_size=2,
                          microbatch_size=5)
    with agent.step(0), agent.microbatch(0):
        agent.capture(torch.tensor(1.0), site="loss", phase="loss")
        agent.capture(torch.tensor(1.0), site="loss2", phase="loss", weight=7)
    agent.close()
    rows = {r["site"]: r for r in _rows(auditor_server.db_path, "r")}
    assert rows["loss"]["reduce_weight"] == 5.0 and rows["loss2"]["reduce_weight"] == 7.0


@pytest.mark.parametrize("options, dp, expected", [
    ({}, 1, 1.0), ({}, 4, 4.0), ({"loss_normalization": "global_mean"}, 4, 1.0),
    ({"loss_normalization": "sum", "microbatch_size": 8}, 2, 16.0),
    ({"grad_scale": 0.25}, 4, 0.25),
])
def test_grad_scale_follows_the_convention(options, dp, expected):
    cfg = AgentConfig(**options)
    check(cfg)
    value, source = grad_scale(cfg, RankIdentity(dp_size=dp))
    assert value == expected and source.startswith(("inferred", "declared"))


def test_grad_scale_of_a_sum_needs_the_batch_size_and_env_overrides():
    with pytest.raises(ValueError, match="microbatch_size"):
        grad_scale(AgentConfig(loss_normalization="sum"), RankIdentity(dp_size=2))
    cfg = apply_env(AgentConfig(), {"NUMAUDIT_GRAD_SCALE": "3", "NUMAUDIT_PAYLOAD_MAX_BYTES": "0",
                                    "NUMAUDIT_LOSS_NORMALIZATION": "global_mean",
                                    "NUMAUDIT_RENAME_IF_TAKEN": "1", "NUMAUDIT_JOB_ID": "j"})
    assert (cfg.grad_scale, cfg.payload_max_bytes, cfg.loss_normalization, cfg.rename_if_taken,
            cfg.job_id) == (3.0, 0, "global_mean", True, "j")
    with pytest.raises(ValueError, match="loss_normalization"):
        check(AgentConfig(loss_normalization="tokens"))


def test_grad_scale_and_job_reach_the_store(auditor_server):
    agent = numaudit.attach(None, run="r", address=auditor_server.address, dp_rank=0, dp_size=4,
                          job_id="job-a")
    _one_step(agent)
    agent.close()
    info, _ = _run_info(auditor_server.db_path, "r")
    assert info["job_id"] == "job-a" and info["grad_scale"] == 4.0
    assert info["grad_scale_sources"][0].startswith("inferred: per-rank mean loss")


def test_a_data_parallel_run_lists_its_batchnorms_in_a_label(auditor_server):
    """BatchNorms (SyncBatchNorm aside) of a data-parallel run reach the store as the label the
    auditor explains differences with; one process, or no BatchNorm, sets none."""
    from numaudit.agents.capture.normalization import note_batch_norms
    from numaudit.wire.labels import BATCH_STATS_LABEL

    def net():
        return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4),
                                   torch.nn.SyncBatchNorm(4), torch.nn.LayerNorm(4),
                                   torch.nn.BatchNorm1d(4))

    agent = numaudit.attach(net(), run="bn", address=auditor_server.address, dp_rank=1,
                          dp_size=2)
    _one_step(agent)
    agent.close()
    info, _ = _run_info(auditor_server.db_path, "bn")
    assert info["labels"][BATCH_STATS_LABEL] == "1, 4"
    for dp_size, model in ((1, net()), (2, torch.nn.Linear(2, 2))):
        ident = RankIdentity(rank=0, world_size=dp_size, dp_rank=0, dp_size=dp_size)
        note_batch_norms(ident, model)
        assert BATCH_STATS_LABEL not in ident.labels
    # many of them: the first ones that fit the label's limit, and "..."
    ident = RankIdentity(rank=0, world_size=2, dp_rank=0, dp_size=2)
    note_batch_norms(ident, torch.nn.ModuleDict({f"block{i:03d}": torch.nn.BatchNorm1d(2)
                                                 for i in range(200)}))
    text = ident.labels[BATCH_STATS_LABEL]
    assert len(text) <= 1024 and text.startswith("block000, block001") and text.endswith(", ...")


def test_dropout_sites_reach_the_store_as_a_label_in_any_run(auditor_server):
    """Modules that drop elements at random in training (dropout modules with p > 0,
    MultiheadAttention with dropout > 0) reach the store as the label the auditor explains
    differences with, in one process too; p = 0, eval mode and modules without dropout are left
    out."""
    from numaudit.agents.capture.normalization import note_dropouts
    from numaudit.wire.labels import DROPOUT_LABEL

    net = torch.nn.ModuleDict({
        "drop": torch.nn.Dropout(0.1), "off": torch.nn.Dropout(0.0),
        "attn": torch.nn.MultiheadAttention(4, 2, dropout=0.2),
        "quiet": torch.nn.MultiheadAttention(4, 2),
        "block": torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout2d(0.5)),
        "alpha": torch.nn.AlphaDropout(0.3), "norm": torch.nn.LayerNorm(4)})
    agent = numaudit.attach(net, run="drop", address=auditor_server.address)
    _one_step(agent)
    agent.close()
    info, _ = _run_info(auditor_server.db_path, "drop")
    assert info["labels"][DROPOUT_LABEL] == "drop, attn, block.1, alpha"
    ident = RankIdentity(rank=0, world_size=1)
    note_dropouts(ident, torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0)))
    note_dropouts(ident, torch.nn.Sequential(torch.nn.Dropout(0.5)).eval())  # drops nothing
    assert DROPOUT_LABEL not in ident.labels


def test_the_depths_and_the_block_lists_reach_the_store_as_labels(auditor_server):
    """What the agent's depths left out, for the auditor's advice on a module without
    captures: max_depth, block_depth and the ModuleLists/ModuleDicts whose children are the
    blocks block_depth counts from (under their normalized sites), not a Sequential."""
    from numaudit.wire.labels import BLOCK_DEPTH_LABEL, BLOCK_LISTS_LABEL, CAPTURE_DEPTH_LABEL

    inner = torch.nn.Module()
    inner.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(2)])
    inner.experts = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2)})
    inner.head = torch.nn.Sequential(torch.nn.Linear(2, 2))
    net = torch.nn.Module()
    net.model = inner
    agent = numaudit.attach(net, run="depths", address=auditor_server.address, max_depth=2,
                            block_depth=2)
    _one_step(agent)
    agent.close()
    info, _ = _run_info(auditor_server.db_path, "depths")
    assert info["labels"][CAPTURE_DEPTH_LABEL] == "2"
    assert info["labels"][BLOCK_DEPTH_LABEL] == "2"
    assert info["labels"][BLOCK_LISTS_LABEL] == "model.layers, model.experts"


def test_plain_tensors_are_replicas_when_other_ranks_share_the_dp_rank(auditor_server,
                                                                        monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = torch.nn.Linear(2, 2)
    agent = numaudit.attach(model, run="tp", address=auditor_server.address, dp_rank=0, dp_size=1,
                          shard_sites=["fwd:mine"])
    with agent.step(0), agent.microbatch(0):
        model(torch.ones(3, 2)).sum().backward()
        agent.capture(torch.ones(2), site="mine", phase="fwd")
        agent.capture(torch.ones(2), site="forced", phase="fwd", replicate=False)
    agent.close()
    rows = {(r["phase"], r["site"]): r for r in _rows(auditor_server.db_path, "tp")}
    assert rows[(pb.PHASE_GRAD, "weight")]["replica"] == 1
    assert rows[(pb.PHASE_FWD, "mine")]["replica"] == 0
    assert rows[(pb.PHASE_FWD, "forced")]["replica"] == 0


def test_small_tensors_carry_payloads_up_to_the_limit(auditor_server):
    agent = numaudit.attach(None, run="p", address=auditor_server.address, payload_max_bytes=64)
    with agent.step(0), agent.microbatch(0):
        agent.capture(torch.ones(16), site="small", phase="fwd")   # 64 bytes
        agent.capture(torch.ones(17), site="big", phase="fwd")     # 68 bytes
    agent.close()
    rows = {r["site"]: r for r in _rows(auditor_server.db_path, "p")}
    assert rows["small"]["has_payload"] and not rows["big"]["has_payload"]


def test_another_job_under_a_taken_name_is_refused_with_one_error(auditor_server, caplog):
    """Refused, and its records spooled for `auditor ingest --run NEW` (issue 41): nothing of
    the job is lost to the name clash."""
    first = numaudit.attach(None, run="ref", address=auditor_server.address, job_id="job-a")
    _one_step(first)
    assert first.close()["acked"] == 2
    caplog.set_level(logging.ERROR, logger="numaudit.agents")
    second = numaudit.attach(None, run="ref", address=auditor_server.address, job_id="job-b",
                           spool_mode="spill")
    _one_step(second, value=3.0)
    s = second.close(timeout=5.0)
    assert s["acked"] == 0 and s["spooled"] == 2 and s["dropped_by_reason"] == {}
    off = numaudit.attach(None, run="ref", address=auditor_server.address, job_id="job-c",
                        spool_mode="off")
    _one_step(off)
    s = off.close(timeout=5.0)  # no spool asked for: counted as dropped, as they were before
    assert s["spooled"] == 0 and s["dropped_by_reason"] == {"run_name_taken": 2}
    errors = [r for r in caplog.records
              if r.levelno >= logging.ERROR and r.name.startswith("numaudit.agents")]
    assert len(errors) == 2 and "ALREADY_EXISTS" in errors[0].getMessage()
    assert "rename_if_taken" in errors[0].getMessage()
    rows = _rows(auditor_server.db_path, "ref")
    assert len(rows) == 2  # never merged


def test_rename_if_taken_gives_every_rank_of_the_job_the_same_new_name(auditor_server):
    first = numaudit.attach(None, run="ref", address=auditor_server.address, job_id="job-a")
    _one_step(first)
    first.close()
    renamed = []
    for rank in (1, 0):  # ranks of job b, registering in any order
        a = numaudit.attach(None, run="ref", address=auditor_server.address, job_id="job-b",
                          rename_if_taken=True, dp_rank=rank, dp_size=2)
        a.ident.rank, a.ident.world_size = rank, 2
        _one_step(a)
        s = a.close()
        assert s["acked"] == 2
        renamed.append(s["run"])
    assert renamed == ["ref.2", "ref.2"]
    again = numaudit.attach(None, run="ref", address=auditor_server.address, job_id="job-c",
                          rename_if_taken=True)
    _one_step(again)
    assert again.close()["run"] == "ref.3"
    assert len(_rows(auditor_server.db_path, "ref")) == 2
    assert len(_rows(auditor_server.db_path, "ref.2")) == 4


def test_same_job_resumes_and_conflicting_content_is_counted(auditor_server):
    first = numaudit.attach(None, run="ref", address=auditor_server.address, job_id="job-a")
    _one_step(first)
    first.close()
    rerun = numaudit.attach(None, run="ref", address=auditor_server.address, job_id="job-a")
    _one_step(rerun, value=5.0)  # same job (an elastic restart), same keys, other loss
    s = rerun.close()
    assert s["conflicts"] == 1  # the input is the same; the loss is not
    assert _run_info(auditor_server.db_path, "ref")[1] == 1


def test_job_id_precedence(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default: not an id
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert job_identity("mine") == ("mine", "declared")
    assert job_identity(None)[1] == "generated"
    assert job_identity(None) == job_identity(None)  # one process, one job
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert job_identity(None) == ("abc", "torchrun")


def test_through_the_sidecar_a_taken_name_is_renamed_or_refused(auditor_server, tmp_path):
    from numaudit.agents.sidecar import Sidecar

    first = numaudit.attach(None, run="ref", address=auditor_server.address, job_id="job-a")
    _one_step(first)
    first.close()
    sock = f"unix://{tmp_path}/s.sock"
    sidecar = Sidecar(sock, tmp_path / "relay", auditor=auditor_server.address)
    sidecar.start()
    try:
        renamed = numaudit.attach(None, run="ref", sidecar=sock, job_id="job-b",
                                rename_if_taken=True)
        _one_step(renamed)
        s = renamed.close(timeout=10.0)
        assert s["run"] == "ref.2" and s["acked"] == 2
        refused = numaudit.attach(None, run="ref", sidecar=sock, job_id="job-c")
        _one_step(refused)
        s = refused.close(timeout=10.0)
        assert s["acked"] == 0 and s["dropped_by_reason"] == {"run_name_taken": 2}
    finally:
        sidecar.stop(grace=5)
    assert len(_rows(auditor_server.db_path, "ref")) == 2
    assert len(_rows(auditor_server.db_path, "ref.2")) == 2
