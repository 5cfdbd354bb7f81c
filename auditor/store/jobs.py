"""Run identity in the store: which run a session joins, and whether a resent batch is a resend.

A run name belongs to the job that registered it first (DESIGN.md "Vocabulary"): another job's
session is refused, or renamed when it asks, and never merged. A batch at or below a session's
acked sequence is a resend only if its records are what was stored; anything else is a conflict.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

from numaudit.auditor.store.dbapi import SqlConnection
from numaudit.auditor.store.errors import RunNameTaken
from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire import limits
from numaudit.wire.packed import RecordColumns


def run_for_job(conn: SqlConnection, req: pb.RegisterRequest) -> tuple[str, tuple | None]:
    """The run name this session registers under, and its (run_id, world_size, job_id) row.

    Another job's session is refused (RunNameTaken), or with rename_if_taken goes to the first of
    NAME.2, NAME.3, ... that is free or already this job's, so every rank of the job lands on the
    same name whatever order they register in (the single writer serializes registrations). An
    empty job id (an agent that sends none, a spool from before job ids) matches any job.
    """
    name, n = req.run, 1
    while True:
        row = conn.execute(
            "SELECT run_id, world_size, job_id FROM runs WHERE name = ?", (name,)
        ).fetchone()
        if row is None or not req.job_id or not row[2] or row[2] == req.job_id:
            return name, row
        if not req.rename_if_taken:
            raise RunNameTaken(
                f"run: {req.run!r} belongs to another job (job_id {row[2]!r}; this session's "
                f"job_id is {req.job_id!r}) and runs are never merged: choose another run name "
                f"(run= or NUMAUDIT_RUN), or set rename_if_taken (agent option "
                f"rename_if_taken=True or NUMAUDIT_RENAME_IF_TAKEN=1) to register as "
                f"{req.run}.2, {req.run}.3, ...")
        n += 1
        name = f"{req.run}.{n}"
        if len(name) > limits.MAX_RUN_NAME_CHARS:
            raise RunNameTaken(f"run: {req.run!r} belongs to another job and {name!r} would be "
                               f"longer than {limits.MAX_RUN_NAME_CHARS} characters: choose "
                               "another (shorter) run name")


def resent(conn: sqlite3.Connection, site_ids: dict[str, int], session_id: str, seq: int,
           cols: RecordColumns, hashes: Sequence[bytes], run_id: int, rank: int,
           now: float) -> tuple[int, int]:
    """(duplicates, conflicts) of a batch at or below the session's acked sequence.

    A true resend stores nothing. A session id reused with other content (another job that
    copied it, a foreign spool replayed) must not pass as duplicates: records whose stored content
    differs are flagged in `conflicts`; records whose key was never stored for this rank count as
    conflicts too (in the ack; there is no stored record to flag them against).
    """
    duplicates = conflicts = 0
    c = cols.cols
    keys = zip(c["site"].tolist(), c["step"].tolist(), c["microbatch"].tolist(),
               c["phase"].tolist(), c["role"].tolist(), c["index"].tolist(), c["call"].tolist())
    repeated = cols.repeated_rows()  # later chunks: counted with their record's first row
    for i, ((site, step, microbatch, phase, role, index, call), chash) in enumerate(
            zip(keys, hashes)):
        if i in repeated:
            continue
        site_id = site_ids.get(cols.sites[site]) if cols.sites else None
        row = None if site_id is None else conn.execute(
            "SELECT record_id, content_hash FROM records WHERE run_id=? AND step=? AND"
            " microbatch=? AND phase=? AND site_id=? AND role=? AND idx=? AND call=? AND rank=?",
            (run_id, step, microbatch, phase, site_id, role, index, call, rank),
        ).fetchone()
        if row is not None and row[1] == chash:
            duplicates += 1
            continue
        if row is not None:
            conn.execute(
                "INSERT INTO conflicts (record_id, session_id, seq, content_hash, received)"
                " VALUES (?,?,?,?,?)", (row[0], session_id, seq, chash, now))
        conflicts += 1
    return duplicates, conflicts
