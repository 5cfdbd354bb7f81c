"""DescribeRun and ListRuns bodies, run in the daemon's read worker processes
(`auditor.daemon.workers`): module-level functions of a store path, so a spawned worker can
import and call them."""

from __future__ import annotations

from pathlib import Path

from numaudit.auditor.store import Reader, summary
from numaudit.protos import numaudit_pb2 as pb


def describe_run(db: Path, run: str) -> pb.DescribeRunResponse:
    reader = Reader(db)
    try:
        return summary.describe_run(reader, run)
    finally:
        reader.close()


def list_runs(db: Path) -> pb.ListRunsResponse:
    reader = Reader(db)
    try:
        return summary.list_runs(reader)
    finally:
        reader.close()
