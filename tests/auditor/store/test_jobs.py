"""Run identity in the store (auditor/store/jobs.py): one job per run name, renames that every
rank of a job agrees on, resumes, and resent batches whose content differs."""

from __future__ import annotations

import pytest

from numaudit.auditor.store import Reader, RunNameTaken
from numaudit.auditor.store.writer import StoreWriter
from tests.auditor.builders import batch, record, register_request

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def writer(tmp_path):
    w = StoreWriter(tmp_path / "audit.db", synchronous="NORMAL")
    yield w
    w.close()


def register(writer, **kw):
    return writer.submit(lambda s: s.register_session(register_request(**kw))).result(10)


def test_a_run_name_belongs_to_the_job_that_registered_it(writer):
    assert register(writer, session_id="a0", job_id="A") == (0, "ref")
    assert register(writer, session_id="a1", rank=1, job_id="A") == (0, "ref")  # same job
    with pytest.raises(RunNameTaken, match=r"run: 'ref' belongs to another job .*rename_if_taken"):
        register(writer, session_id="b0", job_id="B")
    assert register(writer, session_id="legacy", rank=1, job_id="") == (0, "ref")  # no job id


def test_renames_are_the_same_for_every_rank_of_a_job(writer):
    register(writer, session_id="a0", job_id="A")
    got = [register(writer, session_id=f"b{r}", rank=r, job_id="B", rename_if_taken=True)[1]
           for r in (1, 0)]
    assert got == ["ref.2", "ref.2"]
    assert register(writer, session_id="c0", job_id="C", rename_if_taken=True)[1] == "ref.3"
    # a resume after a restart: same session, same job, the renamed name
    assert register(writer, session_id="b1", rank=1, job_id="B", rename_if_taken=True) == (
        0, "ref.2")


def test_a_resent_batch_with_other_content_is_a_conflict(writer, tmp_path):
    register(writer, session_id="sess-0", job_id="A")
    ingest = lambda b: writer.submit(lambda s: s.ingest(b)).result(10)  # noqa: E731
    assert ingest(batch(1, [record(0, j) for j in range(3)])).stored == 3
    honest = ingest(batch(1, [record(0, j) for j in range(3)]))
    assert (honest.duplicates, honest.conflicts) == (3, 0)
    reused = ingest(batch(1, [record(0, 0), record(0, 1, fingerprint=99), record(0, 7)]))
    assert reused.resent_batch and (reused.duplicates, reused.conflicts) == (1, 2)
    reader = Reader(tmp_path / "audit.db")
    try:
        assert reader.conflicts("ref") == 1  # the one with a stored record to flag
        assert len(list(reader.records("ref"))) == 3  # nothing merged
    finally:
        reader.close()


def test_a_rename_that_would_be_too_long_is_refused(writer):
    long = "r" * 128
    register(writer, run=long, session_id="a0", job_id="A")
    with pytest.raises(RunNameTaken, match="longer than 128"):
        register(writer, run=long, session_id="b0", job_id="B", rename_if_taken=True)
