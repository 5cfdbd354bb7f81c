"""`auditor checkpoint REF CAND`: do two checkpoints hold the same model, whatever their sharding?

Each side is a torch.distributed.checkpoint directory, a .safetensors file (or a directory of
them), or ``run:NAME``: a run in the store whose state a live agent captured
(`agent.capture_state_dict`). Files are digested into a store (a temporary one unless --db
is given) through an in-process daemon, then compared by the same engine, policies and
renderers as `auditor compare`, on phase ``state`` of one step.
"""

from __future__ import annotations

import socket
import tempfile
import uuid
from pathlib import Path

import click

from numaudit.auditor.cli.checkpoint_report import (
    measure_differences,
    prefix_map,
    suggestion_from_report,
)
from numaudit.auditor.cli.compare import (
    _load_policy,
    _policy_options,
    check_outputs,
    render_report,
    write_outputs,
)
from numaudit.auditor.cli.main import ENV_DB, InputError, main
from numaudit.auditor.report.text import TEXT_ROWS_PER_GROUP

RUN_PREFIX = "run:"

_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30,
          "gib": 1 << 30, "kb": 1000, "mb": 10 ** 6, "gb": 10 ** 9}


def _size(text: str) -> int:
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value <= 0:
        raise InputError(f"max-memory: {text!r} is not a size (e.g. 256MiB, 1GiB, 65536)")
    return int(value * _UNITS[unit])


@main.command()
@click.argument("ref")
@click.argument("cand")
@_policy_options
@click.option("--map", "map_file", type=click.Path(dir_okay=False, path_type=Path),
              help="TOML map of CAND's names to REF's, and transposed tensors (a converted "
                   "checkpoint; docs/checkpoints.md).")
@click.option("--step", type=int, default=0, show_default=True,
              help="Step the checkpoints are keyed by (a run: side's capture_state_dict step).")
@click.option("--store", "--db", "db", type=click.Path(dir_okay=False, path_type=Path),
              help=f"Store holding run: sides, and keeping the files' digests as runs "
                   f"(default ${ENV_DB} for run: sides; else a temporary store).")
@click.option("--max-memory", default="256MiB", show_default=True,
              help="Checkpoint bytes held at once while reading (tensors of any size are read "
                   "in boxes below it).")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "junit", "html"]),
              default="text", show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the report here instead of stdout.")
@click.option("--json-output", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the JSON report to this file.")
@click.option("--html-output", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the HTML report to this file.")
@click.option("-v", "--verbose", is_flag=True,
              help="Text: after the findings grouped by cause, list every breaching finding.")
@click.option("--all", "show_all", is_flag=True, help="Text: list passing findings too.")
@click.option("--limit", type=click.IntRange(min=0), default=TEXT_ROWS_PER_GROUP,
              show_default=True, help="Text: findings listed per group (0 = all).")
def checkpoint(ref: str, cand: str, policy_file: Path | None, preset: str | None,
               map_file: Path | None, step: int, db: Path | None, max_memory: str, fmt: str,
               output: Path | None, json_output: Path | None, html_output: Path | None,
               verbose: bool, show_all: bool, limit: int) -> int:
    """Compare checkpoint CAND against REF (DCP directory, .safetensors, or run:NAME).

    Exit 0 when every entry agrees within the policy, 1 when findings breach it, 2 when a
    checkpoint cannot be read or an option is wrong.
    """
    import os

    from numaudit.auditor.checkpoint.formats import open_source
    from numaudit.auditor.checkpoint.mapping import load_map
    from numaudit.auditor.checkpoint.optim_names import name_optimizer_indices
    from numaudit.auditor.checkpoint.sources import CheckpointError, Source

    # a reshard or a conversion does no arithmetic: bitwise unless told otherwise
    policy, _ = _load_policy(policy_file, preset or (None if policy_file else "bitwise"))
    check_outputs(output, json_output, html_output)
    cap = _size(max_memory)
    if db is None and os.environ.get(ENV_DB) and (ref.startswith(RUN_PREFIX)
                                                  or cand.startswith(RUN_PREFIX)):
        db = Path(os.environ[ENV_DB])
    try:
        name_map = load_map(map_file) if map_file is not None else None
        sides: dict[str, Source | str] = {}  # a stored run's name, or files
        for side, spec in (("ref", ref), ("cand", cand)):
            if spec.startswith(RUN_PREFIX):
                if db is None:
                    raise InputError(f"{side}: {spec} names a stored run: give --db")
                if name_map is not None and side == "cand":
                    raise InputError("map: applies to a CAND read from files, not to a run")
                sides[side] = spec[len(RUN_PREFIX):]
            else:
                sides[side] = open_source(spec)
        notes = name_optimizer_indices(sides, renamed_side_may_map=name_map is None)
    except CheckpointError as exc:
        raise InputError(str(exc)) from None
    for note in notes:
        click.echo(note, err=True)
    if db is not None and not db.parent.is_dir():
        raise InputError(f"db: directory {db.parent} does not exist")
    with tempfile.TemporaryDirectory(prefix="numaudit-ckpt-") as tmp:
        named: list[str] = []
        if name_map is None:  # names one side nests under a prefix ("model."): the map
            try:
                name_map, named = prefix_map(sides, Path(tmp))
            except CheckpointError as exc:
                _close(sides)
                raise InputError(str(exc)) from None
            for note in named:
                click.echo(note, err=True)
            notes = notes + named
        store = db if db is not None else Path(tmp) / "checkpoint.db"
        try:
            runs = _digest_files(sides, store, step, cap, name_map, keep=db is not None)
        except CheckpointError as exc:
            _close(sides)
            raise InputError(str(exc)) from None
        except BaseException:
            _close(sides)
            raise
        reader = _reader(store)
        try:  # rendered while the store is open: causes read digests
            report = _compare(reader, runs, step, policy)
            report.warnings.extend(notes)
            if name_map is None and not named:
                report.warnings.extend(suggestion_from_report(report))
            try:  # how much and where, read back from the files (a bitwise breach)
                measure_differences(report, sides, name_map, cap)
            except CheckpointError as exc:
                report.warnings.append(f"differences not measured from the files: {exc}")
            text, html_text = render_report(report, fmt, output, show_all, limit,
                                            html=html_output is not None, verbose=verbose)
            write_outputs(output, json_output, html_output, text, html_text, report)
        finally:
            reader.close()
            _close(sides)
    return report.exit_code


def _close(sides: dict) -> None:
    for s in sides.values():
        if not isinstance(s, str):
            s.close()


def _digest_files(sides: dict, store: Path, step: int, cap: int, name_map, *,
                  keep: bool) -> dict[str, str]:
    """Run name of each side: file sides digested into `store` first."""
    from numaudit.auditor.checkpoint.digest import digest_checkpoint
    from numaudit.auditor.daemon.server import BackgroundServer

    runs = {side: s for side, s in sides.items() if isinstance(s, str)}
    files = {side: s for side, s in sides.items() if not isinstance(s, str)}
    if not files:
        return runs
    with tempfile.TemporaryDirectory(prefix="numaudit-ckpt-") as private, \
            BackgroundServer(_private_listen(Path(private)), store, synchronous="NORMAL",
                             grace=1.0) as server:
        for side, source in files.items():
            run = f"checkpoint-{side}-{uuid.uuid4().hex[:8]}" if keep else side
            where = source.path
            stats = digest_checkpoint(
                source, address=server.address, run=run, step=step, max_memory=cap,
                name_map=name_map if side == "cand" else None,
                labels={"checkpoint": _label(str(where)), "checkpoint_format": source.format})
            click.echo(f"{side}: {where} ({source.format}): {stats.tensors} tensors, "
                       f"{stats.values} values, {stats.bytes_read / 1e6:.1f} MB read in "
                       f"{stats.seconds:.2f} s ({stats.gb_per_s:.2f} GB/s)"
                       + (f"; stored as run {run}" if keep else ""), err=True)
            for note in stats.notes:
                click.echo(f"  {note}", err=True)
            runs[side] = run
    return runs


def _label(text: str, most: int = 1000) -> str:
    """`text` as a run label (the daemon takes 1024 characters): its end, where they differ."""
    return text if len(text) <= most else "…" + text[-(most - 1):]


def _private_listen(directory: Path) -> str:
    """Where the in-process daemon listens: a unix socket in `directory` (created 0700, so no
    other user can connect and add records to the runs being compared), else loopback TCP."""
    sock = directory / "auditor.sock"
    if hasattr(socket, "AF_UNIX") and len(str(sock)) < 100:
        return f"unix:{sock}"
    return "127.0.0.1:0"


def _reader(store: Path):
    from numaudit.auditor.store import Reader, StoreError

    try:
        return Reader(store)
    except (StoreError, FileNotFoundError) as exc:
        raise InputError(f"db: {exc}") from None


def _compare(reader, runs: dict[str, str], step: int, policy):
    from numaudit.auditor.compare.engine import compare_runs
    from numaudit.auditor.compare.read.columns import KeyRangeError
    from numaudit.auditor.compare.read.selection import KeySelection
    from numaudit.auditor.store import UnknownRun

    select = KeySelection(step, step + 1, KeySelection.of_phases("state").phases, asked=False)
    try:
        return compare_runs(reader, runs["ref"], runs["cand"], policy, select=select)
    except (UnknownRun, KeyRangeError) as exc:
        raise InputError(str(exc)) from None
