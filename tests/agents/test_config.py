"""Configuration: arguments, then NUMAUDIT_* variables on top; bad settings named."""

import pytest

from numaudit.agents.config import AgentConfig, apply_env, check, parse_int_set


def test_environment_overrides_arguments():
    cfg = AgentConfig(address="a:1", run="ref", phases=("fwd",))
    env = {"NUMAUDIT_ADDR": "b:2", "NUMAUDIT_RUN": "pp8", "NUMAUDIT_PHASES": "fwd,bwd,grad",
           "NUMAUDIT_STEPS": "0-2,7", "NUMAUDIT_DEPTH": "2", "NUMAUDIT_BATCH_DIM": "1"}
    out = apply_env(cfg, env)
    assert (out.address, out.run) == ("b:2", "pp8")
    assert out.phases == ("fwd", "bwd", "grad")
    assert out.steps == frozenset({0, 1, 2, 7})
    assert out.max_depth == 2 and out.batch_dim == 1
    assert cfg.address == "a:1"  # the argument object is not mutated


def test_unset_environment_keeps_arguments():
    cfg = AgentConfig(address="a:1", run="ref")
    assert apply_env(cfg, {}) == cfg


def test_disable_switch():
    assert apply_env(AgentConfig(), {"NUMAUDIT_DISABLE": "1"}).enabled is False


@pytest.mark.parametrize("spec, why", [("3-1", "bad range"), ("x", "not an integer")])
def test_bad_ranges_are_named(spec, why):
    with pytest.raises(ValueError, match=why):
        parse_int_set(spec)


@pytest.mark.parametrize("changes, field", [
    (dict(phases=("fwd", "weights")), "phases"),
    (dict(sketch_k=100), "sketch_k"),
    (dict(sketch_k=1 << 17), "sketch_k"),  # over wire.limits.MAX_SKETCH_BUCKETS
    (dict(address="h:1"), "run"),
    (dict(batch_dim=-1), "batch_dim"),
])
def test_check_names_the_field(changes, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        check(AgentConfig(**changes))


def test_step_selection_every_first_and_list_compose():
    from numaudit.agents.config import AgentConfig, apply_env, check, step_selected

    cfg = apply_env(AgentConfig(step_every=5), {"NUMAUDIT_STEP_FIRST": "21"})
    assert [s for s in range(40) if step_selected(cfg, s)] == [0, 5, 10, 15, 20]
    cfg = apply_env(AgentConfig(), {"NUMAUDIT_STEPS": "0-3,10", "NUMAUDIT_STEP_EVERY": "2"})
    assert [s for s in range(40) if step_selected(cfg, s)] == [0, 2, 10]
    cleared = apply_env(AgentConfig(step_every=3), {"NUMAUDIT_STEP_EVERY": ""})
    assert cleared.step_every is None and step_selected(cleared, 7)
    for bad in (AgentConfig(step_every=0), AgentConfig(step_first=-1), AgentConfig(digest="x")):
        with pytest.raises(ValueError):
            check(bad)


def test_capturer_captures_only_selected_steps():
    import torch

    from numaudit.agents.capture.capture import Capturer, Counters
    from numaudit.agents.config import AgentConfig
    from numaudit.agents.identity import RankIdentity
    from numaudit.agents.ragged import RaggedRows

    batches = []
    cap = Capturer(AgentConfig(step_every=2, step_first=5, phases=("input",)), RankIdentity(),
                   batches.append, Counters())
    for step in range(8):
        cap.start_step(step)
        assert cap.wants("input") == (step in (0, 2, 4))
        cap.capture(torch.ones(4), phase="input", site="x")  # explicit captures follow it too
        cap.capture_segments(torch.ones(3, 2), [1, 2],
                             [RaggedRows(0, 1, 0, 1), RaggedRows(0, 2, 0, 1)],
                             phase="fwd", site="experts", role="output")
        cap.flush()
    assert [(c.step, c.site) for b in batches for c in b.captures] == [
        (s, site) for s in (0, 2, 4) for site in ("x", "experts", "experts")]
