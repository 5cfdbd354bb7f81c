"""`auditor runs` and `auditor show RUN` (registered on `auditor.cli.main`): what a store or a
running auditor holds, as a table or JSON.

    auditor runs  [--store PATH|URL | --address HOST:PORT [--tls-ca CA --tls-cert C --tls-key K]]
                  [--format text|json]
    auditor show RUN [--store PATH|URL | --address HOST:PORT [--tls-...]] [--format text|json]
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from numaudit.auditor.cli.main import (
    client_tls,
    main,
    source_options,
    store_or_address,
    tls_options,
)
from numaudit.auditor.compare.read.ranges import format_ranges
from numaudit.protos import numaudit_pb2 as pb

format_option = click.option("--format", "fmt", type=click.Choice(["text", "json"]),
                             default="text", show_default=True)


# -- runs and show -------------------------------------------------------------------------------

@main.command()
@source_options
@tls_options
@format_option
def runs(db: Path | None, address: str | None, timeout: float, tls_ca: str | None,
         tls_cert: str | None, tls_key: str | None, fmt: str) -> None:
    """List the runs in the store (with a token: the runs it may read)."""
    source = store_or_address(db, address, timeout, tls=client_tls(tls_ca, tls_cert, tls_key))
    try:
        resp = source.list_runs()
    finally:
        source.close()
    if fmt == "json":
        click.echo(json.dumps([_summary_dict(r) for r in resp.runs], indent=2))
        return
    if not resp.runs:
        click.echo(f"no runs in {source.label}")
        return
    rows = [(r.run, r.world_size, r.ranks_registered, r.ranks_closed, r.records,
             _when(r.created_unix)) for r in resp.runs]
    _print_table(("run", "world size", "ranks", "closed", "records", "created"), rows)


@main.command()
@click.argument("run")
@source_options
@tls_options
@format_option
def show(run: str, db: Path | None, address: str | None, timeout: float, tls_ca: str | None,
         tls_cert: str | None, tls_key: str | None, fmt: str) -> None:
    """Show what the store holds for RUN: ranks, mesh, steps, sites per phase, None grads, drops."""
    source = store_or_address(db, address, timeout, tls=client_tls(tls_ca, tls_cert, tls_key))
    try:
        resp = source.describe_run(run)
    finally:
        source.close()
    info = describe_dict(resp)
    if fmt == "json":
        click.echo(json.dumps(info, indent=2))
        return
    _print_describe(info)


def _phase_name(phase: int) -> str:
    return pb.Phase.Name(phase).removeprefix("PHASE_").lower() if phase in pb.Phase.values() \
        else str(phase)


def _summary_dict(s: pb.RunSummary) -> dict:
    return dict(run=s.run, world_size=s.world_size, ranks_registered=s.ranks_registered,
                ranks_closed=s.ranks_closed, records=s.records, created_unix=s.created_unix)


def describe_dict(resp: pb.DescribeRunResponse) -> dict:
    """The JSON form of `auditor show` (sent/dropped are null while a rank is still open)."""
    ranks = [dict(rank=r.rank, session_id=r.session_id, mesh_coordinate=list(r.mesh_coordinate),
                  stages=list(r.stages), host=r.host, agent_version=r.agent_version,
                  stored=r.records_stored,
                  sent=r.records_sent if r.closed else None,
                  dropped=r.records_dropped if r.closed else None, closed=r.closed,
                  dropped_by_reason=dict(sorted(r.dropped_by_reason.items())))
             for r in resp.ranks]
    return dict(
        **_summary_dict(resp.summary),
        mesh=dict(shape=list(resp.mesh_shape), dim_names=list(resp.mesh_dim_names)),
        torch_version=resp.torch_version, dtype=resp.dtype, seed=resp.seed,
        labels=dict(sorted(resp.labels.items())),
        ranks=ranks,
        steps=list(resp.steps),
        microbatches=resp.microbatches,
        phases=[dict(phase=_phase_name(p.phase), sites=p.sites, records=p.records,
                     none_records=p.none_records) for p in resp.phases],
        grad_none=dict(records=sum(p.none_records for p in resp.phases),
                       sites=list(resp.none_grad_sites)),
        dropped=sum(r["dropped"] or 0 for r in ranks),
        conflicts=resp.conflicts,
    )


def _when(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix))




def _print_describe(d: dict) -> None:
    mesh = d["mesh"]
    if mesh["shape"]:
        names = mesh["dim_names"] or [f"dim{i}" for i in range(len(mesh["shape"]))]
        mesh_text = " x ".join(f"{n}={s}" for n, s in zip(names, mesh["shape"]))
    else:
        mesh_text = "none"
    lines = [
        f"run {d['run']}: world size {d['world_size']}, {d['ranks_registered']} ranks registered, "
        f"{d['ranks_closed']} closed, {d['records']} records (created {_when(d['created_unix'])})",
        f"mesh: {mesh_text}",
        f"torch {d['torch_version'] or '?'}, dtype {d['dtype'] or '?'}, seed {d['seed']}"
        + ("".join(f", {k}={v}" for k, v in d["labels"].items())),
        f"steps: {format_ranges(d['steps'], 'none')} ({len(d['steps'])}); "
        f"microbatches: {d['microbatches']}",
    ]
    click.echo("\n".join(lines) + "\n")
    _print_table(
        ("rank", "mesh coordinate", "stages", "host", "agent", "stored", "sent", "dropped"),
        [(r["rank"], ",".join(map(str, r["mesh_coordinate"])) or "-",
          ",".join(map(str, r["stages"])) or "-", r["host"] or "-", r["agent_version"] or "?",
          r["stored"], "open" if r["sent"] is None else r["sent"],
          "open" if r["dropped"] is None else r["dropped"])
         for r in d["ranks"]],
    )
    click.echo("")
    _print_table(("phase", "sites", "records", "grad is None"),
                 [(p["phase"], p["sites"], p["records"], p["none_records"]) for p in d["phases"]])
    gn = d["grad_none"]
    tail = [
        f"\ngrad is None: {gn['records']} records at {len(gn['sites'])} sites"
        + (": " + ", ".join(gn["sites"]) if gn["sites"] else ""),
        f"drops reported by agents: {d['dropped']}"
        + "".join(f"\n  rank {r['rank']}: " + ", ".join(f"{k}={v}" for k, v in
                                                       r["dropped_by_reason"].items())
                  for r in d["ranks"] if r["dropped_by_reason"]),
        f"conflicts: {d['conflicts']}",
    ]
    click.echo("\n".join(tail))


def _print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A rich table on a terminal; aligned plain text otherwise (pipes, files, tests)."""
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table(*headers)
        for row in rows:
            table.add_row(*(str(c) for c in row))
        Console().print(table)
        return
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for r in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
