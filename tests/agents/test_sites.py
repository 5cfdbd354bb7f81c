"""Sites do not depend on wrappers, so runs with different wrapping align."""

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from numaudit.agents.capture.sites import normalize_site, select_modules


def test_wrapper_prefixes_are_stripped():
    assert normalize_site("_orig_mod.layers.0._checkpoint_wrapped_module.moe") == "layers.0.moe"
    assert normalize_site("module.layers.0._fsdp_wrapped_module.attention.wq.weight") == \
        "layers.0.attention.wq.weight"
    # "module" is a DDP wrapper only in front; deeper it is a real name.
    assert normalize_site("layers.module.w") == "layers.module.w"


def _model():
    return torch.nn.Sequential(torch.nn.Linear(2, 2),
                               torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(2, 2)))


def test_selection_by_glob_depth_and_exclusion():
    m = _model()
    sites = [s for s, _ in select_modules(m, ["*"], [], 1)]
    assert sites == ["0", "1"]
    sites = [s for s, _ in select_modules(m, ["*"], ["1.0"], 2)]
    assert sites == ["0", "1", "1.1"]
    sites = [s for s, _ in select_modules(m, ["1.*"], [], 5)]
    assert sites == ["1.0", "1.1"]


def test_checkpoint_wrapped_model_selects_the_same_sites():
    plain = _model()
    wrapped = _model()
    wrapped[1] = checkpoint_wrapper(wrapped[1])
    assert [s for s, _ in select_modules(plain, ["*"], [], 3)] == \
        [s for s, _ in select_modules(wrapped, ["*"], [], 3)]
