"""examples/audit.py's job runner on a failing torchrun job: the failure says why a rank died,
and the job's log survives a rerun into the same file."""

from __future__ import annotations

import pytest

from examples import audit

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_a_rank_that_aborts_is_reported_with_its_own_words_and_its_log_kept(tmp_path):
    log = tmp_path / "ref.log"
    with pytest.raises(audit.SetupError) as failed:
        audit.run_job("../tests/examples/aborting_job.py", 2, "ref", "127.0.0.1:1", log)
    message = str(failed.value)
    # The rank's own message, printed long before torchrun's summary at the end of the log.
    assert "terminate called after throwing an instance of 'gloo::EnforceNotMet'" in message
    assert "what():  [enforce fail" in message
    # The faulthandler's stack of the rank that died: the line of the job that aborted.
    assert "Fatal Python error: Aborted" in message
    assert 'aborting_job.py", line' in message
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("ref.failed-")]
    assert len(kept) == 1 and str(kept[0]) in message
    log.write_text("a rerun of the job\n")  # what the next run does to the log
    assert "gloo::EnforceNotMet" in kept[0].read_text()


def test_the_failure_lines_come_before_the_end_of_a_long_log(tmp_path):
    log = tmp_path / "job.log"
    lines = ([f"rank 0: step {i}" for i in range(100)] + ["Traceback (most recent call last):",
             "RuntimeError: boom"] + [f"rank 2: step {i}" for i in range(100)]
             + ["torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"])
    log.write_text("\n".join(lines) + "\n")
    tail = audit._tail(log).splitlines()
    assert tail[:2] == ["Traceback (most recent call last):", "RuntimeError: boom"]
    assert tail[-1] == "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"
    assert "rank 0: step 5" not in tail  # the chatter before is left out
