"""Agent tests never spool into the working tree; `fake_rank` makes a test process one rank of a
fake 4-rank world."""

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _spool_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMAUDIT_SPOOL", str(tmp_path / "spool"))


@pytest.fixture
def fake_rank():
    """Make this process rank r of a fake 4-rank world (no communication happens)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")

    def init(rank: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", rank=rank, world_size=4, store=FakeStore())

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()
