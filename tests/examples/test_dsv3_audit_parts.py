"""The audit-facing parts of the DS3 examples, single process (no torchrun, no daemon)."""

from __future__ import annotations

import argparse

import pytest
import torch

from examples import audit
from examples.dsv3 import auditing
from examples.dsv3.data import batches
from examples.dsv3.model import ModelArgs, Transformer, prune_to_stage

NUM_STAGES = 4


class _RecordingAgent:
    """Stands in for an agent: records what `capture` was given."""

    def __init__(self) -> None:
        self.captures: list[tuple[str, str, torch.Tensor]] = []

    def capture(self, tensor, *, site, phase="fwd", **_):
        self.captures.append((phase, site, tensor))


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--microbatch-size", type=int, default=2)
    auditing.add_audit_args(p)
    args = p.parse_args([])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_injection_names_agree_between_driver_and_candidate():
    from examples.dsv3_pp import INJECTIONS

    assert set(audit.INJECTIONS) == set(INJECTIONS)


def test_agent_options_default_and_bwd():
    opts = auditing.agent_options(_args())
    assert opts["phases"] == ("fwd", "grad", "loss", "input")
    assert opts["payload"] == ("fwd:output",)
    assert opts["max_depth"] == auditing.CAPTURE_DEPTH
    assert "bwd" in auditing.agent_options(_args(bwd=True))["phases"]


def test_input_tokens_are_captured_only_where_embedded():
    model = Transformer(ModelArgs())
    model.init_weights(0)
    agent = _RecordingAgent()
    auditing.capture_input_tokens(agent, model)
    tokens, _ = next(batches(0, 0, 1, 2, 16, model.args.vocab_size))[0]
    model(tokens)
    assert [(p, s) for p, s, _ in agent.captures] == [("input", auditing.INPUT_SITE)]
    assert torch.equal(agent.captures[0][2], tokens)

    later = prune_to_stage(Transformer(ModelArgs()), 1, NUM_STAGES)
    auditing.capture_input_tokens(agent, later)  # no tok_embeddings: nothing hooked
    later(torch.zeros(2, 16, later.args.dim))
    assert len(agent.captures) == 1


@pytest.mark.parametrize("stage_index", range(NUM_STAGES))
def test_static_stage_metadata_matches_what_each_stage_computes(stage_index):
    from examples.dsv3_pp import _stage_metadata

    margs = ModelArgs()
    args = _args()
    inputs, outputs = _stage_metadata(args, margs, stage_index, NUM_STAGES)
    stage = prune_to_stage(Transformer(margs), stage_index, NUM_STAGES)
    stage.init_weights(0)
    x = (torch.randint(0, margs.vocab_size, inputs.shape) if inputs.dtype == torch.long
         else torch.randn(inputs.shape, requires_grad=True))
    y = stage(x)
    assert (y.shape, y.dtype) == (outputs.shape, outputs.dtype)
    assert inputs.requires_grad == (stage_index > 0)  # stage 0 gets integer tokens
    assert outputs.requires_grad


def test_skip_ref_without_a_database_is_a_setup_error(tmp_path, capsys):
    rc = audit.main(["--build", str(tmp_path), "--skip-ref", "--cand-name", "x"])
    assert rc == 2
    assert "--skip-ref: no database" in capsys.readouterr().err


def test_unknown_injection_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        audit.main(["--inject", "no-such-fault"])
    assert exc.value.code == 2
