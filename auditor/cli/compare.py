"""`auditor compare` and `auditor watch` (registered on `auditor.cli.main`).

    auditor compare REF CAND [--policy FILE] [--preset NAME] [--format text|json|junit|html]
                             [-o FILE] [--json-output FILE] [--html-output FILE]
                             [-v/--verbose] [--all] [--limit N] [--steps K:M]
                             [--noise RUN ... | --noise-bands FILE] [--noise-slack X]
                             [--store PATH|URL | --address HOST:PORT]
    auditor watch REF CAND [--policy FILE] [--preset NAME] [--format text|json] [--all]
                           [--poll S] [--timeout S] [--wait [--wait-timeout S]] [--escalate]
                           [--noise RUN ... | --noise-bands FILE] [--noise-slack X]
                           [--store PATH|URL | --address HOST:PORT]

Exit codes: 0 = every finding within policy, 1 = some finding breaches it, 2 = usage or input
error (one line on stderr). With --address the daemon compares (the Compare RPC) and the report
is rendered here from its JSON, so both sources print the same report.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import grpc

from numaudit.auditor.cli.calibrate import noise_options, noise_spec
from numaudit.auditor.cli.main import (
    ENV_ADDR,
    ENV_DB,
    STORE,
    InputError,
    RunNotFound,
    StoreSource,
    client_tls,
    main,
    store_or_address,
    tls_options,
    with_nearest,
)
from numaudit.auditor.cli.wait import DEFAULT_WAIT_TIMEOUT_S, wait_for_runs
from numaudit.auditor.compare.policy.load import (
    PRESETS,
    Policy,
    PolicyError,
    load_policy,
    preset_policy,
)
from numaudit.auditor.store import UnknownRun
from numaudit.protos import numaudit_pb2 as pb

# The engine (numpy) is imported by the commands that use it, so `auditor serve` starts fast.
TEXT_ROWS_PER_GROUP = 50
"""Default of --limit (auditor.report.text.TEXT_ROWS_PER_GROUP)."""

COMPARE_TIMEOUT_S = 600.0
"""Deadline of a Compare RPC (a million keys take seconds; the daemon may be busy)."""
WATCH_POLL_S = 1.0


def _sources(fn: Any) -> Any:
    fn = click.option("--timeout", type=click.FloatRange(min=0.1), default=COMPARE_TIMEOUT_S,
                      show_default=True, help="Deadline of the call to --address, seconds.")(fn)
    fn = click.option("--address", metavar="HOST:PORT",
                      help=f"Ask a running auditor (default ${ENV_ADDR}).")(fn)
    fn = click.option("--store", "--db", "db", type=STORE, metavar="PATH|URL",
                      help=f"Read a store: a SQLite file or a postgresql:// URL (default "
                           f"${ENV_DB}).")(fn)
    return fn


def _policy_options(fn: Any) -> Any:
    fn = click.option("--preset", type=click.Choice(list(PRESETS)),
                      help="Tolerance preset (overrides the policy file's own).")(fn)
    fn = click.option("--policy", "policy_file", type=click.Path(dir_okay=False, path_type=Path),
                      help="Policy file (TOML, docs/policy.md).")(fn)
    return fn


def _load_policy(policy_file: Path | None, preset: str | None) -> tuple[Policy, str]:
    """The policy and its text (sent to a daemon as is)."""
    try:
        if policy_file is None:
            return preset_policy(preset), ""
        return load_policy(policy_file, preset), policy_file.read_text()
    except PolicyError as exc:
        raise InputError(f"policy: {exc}") from None


def _source(db: Path | None, address: str | None, timeout: float, tls_ca: str | None,
            tls_cert: str | None, tls_key: str | None) -> Any:
    tls = client_tls(tls_ca, tls_cert, tls_key) if db is None else None
    return store_or_address(db, address, timeout, tls=tls)


def _width() -> int:
    return shutil.get_terminal_size((100, 24)).columns


@main.command()
@click.argument("ref")
@click.argument("cand")
@_policy_options
@click.option("--format", "fmt", type=click.Choice(["text", "json", "junit", "html"]),
              default="text", show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the report here instead of stdout.")
@click.option("--json-output", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the JSON report to this file, whatever --format (one comparison "
                   "for a log and an artifact).")
@click.option("--html-output", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the HTML report (docs/report-html.md) to this file, whatever "
                   "--format.")
@click.option("-v", "--verbose", is_flag=True,
              help="Text: after the findings grouped by cause, list every breaching finding.")
@click.option("--all", "show_all", is_flag=True, help="Text: list every finding, passing ones "
                                                      "too (instead of the groups).")
@click.option("--limit", type=click.IntRange(min=0), default=TEXT_ROWS_PER_GROUP,
              show_default=True, help="Text, with --verbose or --all: findings listed per "
                                      "phase and stage (0 = all).")
@click.option("--steps", metavar="K:|K:M|K", help="Compare only steps K..M-1 of both runs (K: = "
              "from K on: a run resumed at step K against the uninterrupted one).")
@noise_options
@_sources
@tls_options
def compare(ref: str, cand: str, policy_file: Path | None, preset: str | None, fmt: str,
            output: Path | None, json_output: Path | None, html_output: Path | None,
            verbose: bool, show_all: bool, limit: int, steps: str | None,
            noise: tuple[str, ...], noise_bands: Path | None, noise_slack: float | None,
            db: Path | None, address: str | None, timeout: float, tls_ca: str | None,
            tls_cert: str | None, tls_key: str | None) -> int:
    """Compare run CAND against the reference run REF; exit 1 when findings breach the policy."""
    policy, policy_text = _load_policy(policy_file, preset)
    check_outputs(output, json_output, html_output)
    remote_json: str | None = None
    from numaudit.auditor.compare.engine import compare_runs
    from numaudit.auditor.compare.read.columns import KeyRangeError
    from numaudit.auditor.compare.read.selection import KeySelection
    from numaudit.auditor.report.html import render_html
    from numaudit.auditor.report.junit import render_junit
    from numaudit.auditor.report.text import render_text

    select = None
    if steps is not None:
        try:
            select = KeySelection.parse_steps(steps)
        except ValueError as exc:
            raise InputError(str(exc)) from None
    source = _source(db, address, timeout, tls_ca, tls_cert, tls_key)
    try:
        spec = noise_spec(noise, noise_bands, noise_slack, isinstance(source, StoreSource), ref)
        if isinstance(source, StoreSource):
            try:
                report = compare_runs(source.reader, ref, cand, policy, select=select,
                                      noise=spec)
            except UnknownRun as exc:
                raise with_nearest(source, (ref, cand, *noise), str(exc)) from None
            except KeyRangeError as exc:
                raise InputError(str(exc)) from None
            exit_code = report.exit_code
            text, html_text = render_report(report, fmt, output, show_all, limit,
                                            html=html_output is not None, verbose=verbose)
        elif select is not None:
            raise InputError("steps: needs the store (--db); the daemon's Compare has no "
                             "step selection")
        else:
            req = pb.CompareRequest(ref=ref, cand=cand, policy_toml=policy_text,
                                    preset=preset or "")
            try:
                resp = source.call(source.stub.Compare, req)
            except RunNotFound as exc:
                raise with_nearest(source, (ref, cand), exc.message) from None
            exit_code = resp.exit_code
            doc = json.loads(resp.report_json)
            report = None
            remote_json = resp.report_json if resp.report_json.endswith("\n") \
                else resp.report_json + "\n"
            html_text = render_html(doc, doc["findings"]) \
                if fmt == "html" or html_output is not None else None
            if fmt == "json":
                text = remote_json
            elif fmt == "html":
                text = html_text
            elif fmt == "junit":
                text = render_junit(doc, doc["findings"])
            else:
                text = render_text(doc, doc["findings"], width=_text_width(output),
                                   show_all=show_all, limit=limit, verbose=verbose,
                                   color=output is None and sys.stdout.isatty())
                if doc.get("findings_included", "all") != "all":
                    text += (f"(the daemon's report omitted findings: "
                             f"{doc.get('findings_omitted', {})})\n")
    finally:
        source.close()
    write_outputs(output, json_output, html_output, text, html_text, report, remote_json)
    return exit_code


def check_outputs(output: Path | None, json_output: Path | None,
                  html_output: Path | None) -> None:
    """InputError for an output file in a missing directory, or one file named twice."""
    outputs = (("output", output), ("json-output", json_output), ("html-output", html_output))
    for name, path in outputs:
        if path is not None and not path.parent.is_dir():
            raise InputError(f"{name}: directory {path.parent} does not exist")
    seen: dict[Path, str] = {}
    for name, path in outputs:
        if path is not None and seen.setdefault(path.resolve(), name) != name:
            raise InputError(f"{name}: {path} is also the --{seen[path.resolve()]} file")


def render_report(report: Any, fmt: str, output: Path | None, show_all: bool, limit: int, *,
                  html: bool, verbose: bool = False) -> tuple[str | None, str | None]:
    """(text for --format, HTML text when `html` or the format is html) of a local report; the
    text is None for json (written from the report itself)."""
    from numaudit.auditor.report.html import to_html
    from numaudit.auditor.report.junit import to_junit
    from numaudit.auditor.report.text import to_text

    html_text = to_html(report) if fmt == "html" or html else None
    if fmt == "json":
        return None, html_text
    if fmt == "html":
        return html_text, html_text
    if fmt == "junit":
        return to_junit(report), html_text
    return to_text(report, width=_text_width(output), show_all=show_all, limit=limit,
                   color=output is None and sys.stdout.isatty(), verbose=verbose), html_text


def write_outputs(output: Path | None, json_output: Path | None, html_output: Path | None,
                  text: str | None, html_text: str | None, report: Any,
                  remote_json: str | None = None) -> None:
    """Write the report (stdout or --output), and the --json-output and --html-output files."""
    _write(output, text, report)
    if json_output is not None:
        _write(json_output, remote_json, report)
    if html_output is not None:
        _write(html_output, html_text, report)


def _text_width(output: Path | None) -> int:
    return _width() if output is None and sys.stdout.isatty() else 120


def _write(output: Path | None, text: str | None, report: Any) -> None:
    """Write a rendered report (or stream the JSON one) to the output file or stdout."""
    from numaudit.auditor.report.json_report import write_json

    try:
        if output is None:
            if text is None:
                write_json(report, sys.stdout)
            else:
                sys.stdout.write(text)
            sys.stdout.flush()
            return
        tmp = output.with_name(output.name + ".tmp")
        with open(tmp, "w") as fh:
            if text is None:
                write_json(report, fh)
            else:
                fh.write(text)
        tmp.replace(output)
    except OSError as exc:
        raise InputError(f"output: cannot write {output or 'stdout'} ({exc.strerror or exc})") \
            from None


# -- watch ---------------------------------------------------------------------------------------

def _local_events(reader: Any, ref: str, cand: str, policy: Policy, poll: float,
                  timeout: float, noise: Any = None) -> Iterator[Any]:
    """The same loop as the Watch RPC, against a store file (yields
    auditor.compare.live.LiveEvent)."""
    from numaudit.auditor.compare.live import LiveComparison, LiveEvent

    live = LiveComparison(reader, ref, cand, policy, noise=noise)
    yield LiveEvent(status=f"watching {ref} vs {cand}")
    last_news = time.monotonic()
    while True:
        started = time.monotonic()
        events = live.poll()
        yield from events
        if any(ev.finding is not None for ev in events):
            last_news = time.monotonic()
        if live.finished:
            yield from live.flush()
            yield LiveEvent(status=f"done: both runs finished, {live.emitted} keys compared")
            return
        if timeout and time.monotonic() - last_news > timeout:
            yield from live.flush()
            yield LiveEvent(status=f"timed out: no new keys for {timeout:g}s, "
                                   f"{live.emitted} keys compared")
            return
        time.sleep(max(poll, 2 * (time.monotonic() - started)))


def _remote_events(source: Any, ref: str, cand: str, policy_text: str, preset: str | None,
                   poll: float, timeout: float, escalate: bool = False
                   ) -> Iterator[tuple[dict | None, bool, str, dict | None]]:
    req = pb.WatchRequest(ref=ref, cand=cand, policy_toml=policy_text, preset=preset or "",
                          poll_interval_s=poll, timeout_s=timeout, escalate=escalate)
    deadline = timeout * 4 + 60 if timeout else 24 * 3600.0
    try:
        for ev in source.stub.Watch(req, timeout=deadline):
            yield (json.loads(ev.finding_json) if ev.finding_json else None,
                   ev.first_divergence, ev.status,
                   json.loads(ev.drill_json) if ev.drill_json else None)
    except grpc.RpcError as exc:
        code, details = exc.code(), (exc.details() or "").replace("\n", " ")
        if code == grpc.StatusCode.NOT_FOUND:
            raise with_nearest(source, (ref, cand), details) from None
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise InputError(f"cannot reach the auditor at {source.label} ({code.name}: "
                             f"{details})") from None
        raise InputError(f"auditor at {source.label}: {code.name}: {details}") from None


@main.command()
@click.argument("ref")
@click.argument("cand")
@_policy_options
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text",
              show_default=True, help="json: one JSON object per line.")
@click.option("--all", "show_all", is_flag=True, help="Print passing findings too.")
@click.option("--poll", type=click.FloatRange(min=0.05), default=WATCH_POLL_S, show_default=True,
              help="Seconds between reads of the store.")
@click.option("--idle-timeout", "idle", type=click.FloatRange(min=0), default=0,
              show_default=True, help="Stop after this many seconds without new keys (0 = wait "
                                      "until both runs finish).")
@click.option("--wait", is_flag=True, help="Wait for runs not registered yet instead of "
                                           "refusing them (see --wait-timeout).")
@click.option("--wait-timeout", type=click.FloatRange(min=0), default=DEFAULT_WAIT_TIMEOUT_S,
              show_default=True, help="With --wait: seconds to wait for both runs to register.")
@click.option("--escalate", is_flag=True, help="When a module introduces a divergence, ask both "
              "runs' agents (through the daemon: needs --address and the escalate scope) to "
              "capture its operations at the next step, and print the operation that differs "
              "(docs/drill-down.md).")
@noise_options
@_sources
@tls_options
def watch(ref: str, cand: str, policy_file: Path | None, preset: str | None, fmt: str,
          show_all: bool, poll: float, idle: float, wait: bool, wait_timeout: float,
          escalate: bool,
          noise: tuple[str, ...], noise_bands: Path | None, noise_slack: float | None,
          db: Path | None, address: str | None, timeout: float, tls_ca: str | None,
          tls_cert: str | None, tls_key: str | None) -> int:
    """Compare REF and CAND while they run: findings as soon as keys are final in both; at the
    end, the summary and first divergence `auditor compare` prints (its exit code too)."""
    from numaudit.auditor.compare.read.columns import KeyRangeError

    policy, policy_text = _load_policy(policy_file, preset)
    source = _source(db, address, timeout, tls_ca, tls_cert, tls_key)
    try:
        spec = noise_spec(noise, noise_bands, noise_slack, isinstance(source, StoreSource), ref)
        if escalate and isinstance(source, StoreSource):
            raise InputError("escalate: needs --address: the daemon holds the runs' streams "
                             "that carry the directives (a store file cannot reach the agents)")
    except InputError:
        source.close()
        raise
    breaches = 0
    try:
        if wait:
            wait_for_runs(source, (ref, cand), timeout=wait_timeout, poll=poll,
                          status=lambda s: _print_event(None, False, s, fmt, show_all))
        if isinstance(source, StoreSource):
            try:
                stream = ((ev.finding.as_dict() if ev.finding else None, ev.first_divergence,
                           ev.status)
                          for ev in _local_events(source.reader, ref, cand, policy, poll, idle,
                                                  spec))
                for doc, first, status in stream:
                    breaches += _print_event(doc, first, status, fmt, show_all)
            except UnknownRun as exc:
                raise with_nearest(source, (ref, cand), str(exc)) from None
            except KeyRangeError as exc:
                raise InputError(str(exc)) from None
        else:
            for doc, first, status, drill in _remote_events(source, ref, cand, policy_text,
                                                            preset, poll, idle, escalate):
                if drill is not None:
                    _print_drill_event(drill, status, fmt)
                    continue
                breaches += _print_event(doc, first, status, fmt, show_all)
    except KeyboardInterrupt:
        click.echo("auditor: watch interrupted", err=True)
        source.close()
        return 1 if breaches else 130
    try:
        code = _final_summary(source, ref, cand, policy, policy_text, preset, fmt, spec)
    finally:
        source.close()
    return code if code is not None else (1 if breaches else 0)


def _final_summary(source: Any, ref: str, cand: str, policy: Policy, policy_text: str,
                   preset: str | None, fmt: str, noise: Any = None) -> int | None:
    """The end of a watch: the comparison of what the store holds now, its summary line,
    first divergence and findings grouped by cause as `auditor compare` prints them (text), or
    one ``{"event": "summary", ...}`` line (json). Returns its exit code (None when the
    comparison could not be made: the watch's own count decides)."""
    from numaudit.auditor.report.text import render_text

    try:
        if isinstance(source, StoreSource):
            from numaudit.auditor.compare.engine import compare_runs

            doc = compare_runs(source.reader, ref, cand, policy, noise=noise).header_dict()
        else:
            req = pb.CompareRequest(ref=ref, cand=cand, policy_toml=policy_text,
                                    preset=preset or "")
            doc = json.loads(source.call(source.stub.Compare, req).report_json)
    except (InputError, UnknownRun) as exc:
        click.echo(f"[watch] no final summary: {exc}", err=True)
        return None
    if fmt == "json":
        click.echo(json.dumps({"event": "summary", "summary": doc["summary"],
                               "first_divergence": doc["first_divergence"],
                               "groups": doc.get("groups", [])}, allow_nan=False))
    else:
        text = render_text(doc, [], width=_text_width(None),
                           color=sys.stdout.isatty())
        click.echo("\n" + text.rstrip("\n"))
    return int(doc["summary"]["exit_code"])


def _print_event(doc: dict | None, first: bool, status: str, fmt: str, show_all: bool) -> int:
    """Print one event; returns 1 for a breaching finding (counted once, not on announcement)."""
    from numaudit.auditor.compare.measure.findings import headline

    if fmt == "json":
        kind = "status" if doc is None else ("first_divergence" if first else "finding")
        payload: dict = {"event": kind}
        if doc is None:
            payload["status"] = status
        else:
            payload["finding"] = doc
        if doc is None or first or show_all or doc["breach"]:
            click.echo(json.dumps(payload, allow_nan=False))
        return int(doc is not None and not first and doc["breach"])
    if doc is None:
        click.echo(f"[watch] {status}", err=True)
        return 0
    if first:
        click.echo("FIRST DIVERGENCE: " + headline(doc))
        if doc.get("cause"):
            click.echo(f"  {doc['cause']['kind']}: {doc['cause']['reason']}")
        return 0
    if doc["breach"] or show_all:
        click.echo(headline(doc))
    return int(doc["breach"])


def _print_drill_event(drill: dict, status: str, fmt: str) -> None:
    """An escalation's event: a directive sent (status), or the op-level findings of a
    module's step (`auditor.compare.ops.escalation`), printed on stdout."""
    if fmt == "json":
        kind = "drill" if "drill" in drill else "directive"
        click.echo(json.dumps({"event": kind, kind: drill[kind], "status": status},
                              allow_nan=False))
        return
    if "directive" in drill:
        click.echo(f"[watch] {status}", err=True)
        return
    r = drill["drill"]
    for w in r.get("warnings", []):
        click.echo(f"[watch] drill {r['site']} @ step {r['step']}: {w}", err=True)
    if not r["calls"]:
        return
    click.echo(f"DRILL {r['site']} @ step {r['step']}: {r['differ']} of {r['calls']} module "
               "calls differ operation by operation")
    for f in r["findings"][:1] if r["differ"] else ():
        where = f"{f['phase']} {f['module']} microbatch {f['microbatch']}"
        click.echo(f"  OPERATION: {f['kind']} at {f['op']} ({where}): {f['reason']}")
