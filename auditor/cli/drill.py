"""`auditor drill` (registered on `auditor.cli.main`): the rerun that finds the operation.

    auditor drill REF CAND [--policy FILE] [--preset NAME] [-o plan.toml]
                           [--store PATH|URL | --address HOST:PORT]

Compares the runs as `auditor compare` does; when the first divergence is introduced by a
module, writes the drill-down plan (wire/plan.py): that module's operations (and its parent's)
at that step, the raw bytes of its outputs. Rerun both runs with ``NUMAUDIT_PLAN=plan.toml``
and compare them: the report names the operation (docs/drill-down.md).

Exit codes: 0 = a plan written (or printed), 1 = nothing to drill into (the report's first
divergence is not a module's own: the message says why), 2 = usage or input error.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from numaudit.auditor.cli.compare import _load_policy, _policy_options, _source, _sources
from numaudit.auditor.cli.main import (
    InputError,
    RunNotFound,
    StoreSource,
    main,
    tls_options,
    with_nearest,
)
from numaudit.auditor.store import UnknownRun
from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire.plan import Plan, format_plan


def _report_doc(source, ref: str, cand: str, policy, policy_text: str,
                preset: str | None) -> dict:
    """The JSON report's head, from the store or from the daemon."""
    if isinstance(source, StoreSource):
        from numaudit.auditor.compare.engine import compare_runs
        from numaudit.auditor.compare.read.columns import KeyRangeError

        try:
            return compare_runs(source.reader, ref, cand, policy).header_dict()
        except UnknownRun as exc:
            raise with_nearest(source, (ref, cand), str(exc)) from None
        except KeyRangeError as exc:
            raise InputError(str(exc)) from None
    req = pb.CompareRequest(ref=ref, cand=cand, policy_toml=policy_text, preset=preset or "")
    try:
        return json.loads(source.call(source.stub.Compare, req).report_json)
    except RunNotFound as exc:
        raise with_nearest(source, (ref, cand), exc.message) from None


def _nothing_to_drill(doc: dict) -> str:
    first = doc.get("first_divergence")
    if first is None:
        return "the runs do not diverge: nothing to drill into"
    key = first["key"]
    cause = first.get("cause") or {}
    parent = key["site"].rsplit(".", 1)[0] if "." in key["site"] else key["site"]
    if doc.get("ops") and key["site"] in (doc["ops"].get("modules") or ()) or \
            parent in ((doc.get("ops") or {}).get("modules") or ()):
        return (f"the operations of {key['site']} (or of its parent) are already captured and "
                "compared in this report: `auditor compare` prints them (its Operations "
                "section)")
    if key["phase"] not in ("fwd", "bwd"):
        return (f"the first divergence is phase {key['phase']} ({key['site']}), not a module's "
                "activation or activation gradient: no module's operations to capture")
    return (f"the first divergence ({key['site']}) is {cause.get('kind', 'not judged')}, not "
            "introduced by its module: drill where the report's cause points instead")


@main.command()
@click.argument("ref")
@click.argument("cand")
@_policy_options
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the plan here (default: print it).")
@_sources
@tls_options
def drill(ref: str, cand: str, policy_file: Path | None, preset: str | None,
          output: Path | None, db: Path | None, address: str | None, timeout: float,
          tls_ca: str | None, tls_cert: str | None, tls_key: str | None) -> int:
    """Write the rerun plan that finds the operation inside the module where CAND first
    parts from REF (agents read it with NUMAUDIT_PLAN=FILE)."""
    policy, policy_text = _load_policy(policy_file, preset)
    source = _source(db, address, timeout, tls_ca, tls_cert, tls_key)
    try:
        doc = _report_doc(source, ref, cand, policy, policy_text, preset)
    finally:
        source.close()
    d = doc.get("drill")
    if not d:
        click.echo(f"auditor drill: {_nothing_to_drill(doc)}", err=True)
        return 1
    first = doc["first_divergence"]
    reason = f"{_headline(first)}; {first['cause']['kind']}: {first['cause']['reason']}"
    plan = Plan(ops=tuple(d["ops"]), steps=(int(d["step"]),), payload=tuple(d["payload"]),
                reason=reason[:1000], runs={"ref": ref, "cand": cand})
    text = format_plan(plan)
    if output is None:
        click.echo(text, nl=False)
    else:
        try:
            output.write_text(text)
        except OSError as exc:
            raise InputError(f"output: cannot write {output} ({exc.strerror or exc})") from None
        click.echo(f"plan written to {output}: rerun both runs (under new run names) with "
                   f"NUMAUDIT_PLAN={output} (or {d['env']}); comparing those names the "
                   f"operation inside {d['site']}", err=True)
    return 0


def _headline(first: dict) -> str:
    from numaudit.auditor.compare.measure.findings import headline

    return headline(first)
