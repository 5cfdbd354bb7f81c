"""What the store holds about runs, as the wire's ListRuns/DescribeRun messages.

Shared by the daemon (answering RPCs) and the CLI (reading a store file directly), so that
`auditor show --db` and `auditor show --address` print the same thing.
"""

from __future__ import annotations

from numaudit.auditor.store import Reader
from numaudit.protos import numaudit_pb2 as pb


def run_summary(reader: Reader, name: str, sessions: list[dict] | None = None) -> pb.RunSummary:
    info = reader.run_info(name)
    if sessions is None:
        sessions = reader.sessions(name)
    return pb.RunSummary(
        run=name,
        world_size=info["world_size"],
        ranks_registered=len({s["rank"] for s in sessions}),
        ranks_closed=len({s["rank"] for s in sessions if s["closed"] is not None}),
        records=sum(s["records_stored"] for s in sessions),
        created_unix=info["created"],
    )


def list_runs(reader: Reader) -> pb.ListRunsResponse:
    """Every run in the store, oldest first."""
    return pb.ListRunsResponse(runs=[run_summary(reader, name) for name in reader.run_names()])


def describe_run(reader: Reader, name: str) -> pb.DescribeRunResponse:
    """Everything `auditor show` prints; raises store.UnknownRun for a run not in the store."""
    info = reader.run_info(name)
    sessions = reader.sessions(name)
    resp = pb.DescribeRunResponse(
        summary=run_summary(reader, name, sessions),
        mesh_shape=info["mesh_shape"],
        mesh_dim_names=info["mesh_dim_names"],
        torch_version=info["torch_version"],
        dtype=info["dtype"],
        seed=info["seed"],
        labels=info["labels"],
        steps=reader.steps(name),
        microbatches=reader.microbatch_count(name),
        conflicts=reader.conflicts(name),
        none_grad_sites=reader.none_grad_sites(name),
    )
    for s in sessions:
        closed = s["closed"] is not None
        resp.ranks.append(pb.RankInfo(
            rank=s["rank"],
            session_id=s["session_id"],
            mesh_coordinate=s["mesh_coordinate"],
            stages=s["stages"],
            host=s["host"],
            records_stored=s["records_stored"],
            records_sent=s["records_sent"] if closed else -1,
            records_dropped=s["records_dropped"] if closed else -1,
            closed=closed,
            dropped_by_reason=s["dropped_by_reason"],
            agent_version=s["agent_version"],
        ))
    for phase, sites, records, none_records in reader.phase_counts(name):
        resp.phases.append(pb.PhaseCount(
            # the stubs take an enum field as its class or name; protobuf takes its number too
            phase=phase,  # type: ignore[arg-type]
            sites=sites, records=records, none_records=none_records or 0))
    return resp
