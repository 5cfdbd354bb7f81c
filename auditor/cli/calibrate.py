"""`auditor calibrate` and the noise options of `compare` and `watch` (docs/noise.md).

    auditor calibrate REF REF2 [REF3 ...] -o FILE [--policy FILE] [--preset NAME] [--steps K:M]
                      [--store PATH|URL]
    auditor compare REF CAND --noise REF2 [--noise REF3 ...] [--noise-slack X]
    auditor compare REF CAND --noise-bands FILE [--noise-slack X]

calibrate measures the noise bands among reruns of one reference configuration (every pair of
the runs given) and saves them; compare and watch judge a candidate against bands measured on
the spot (--noise) or saved before (--noise-bands). Both read the store: the daemon's Compare
and Watch RPCs have no bands. Exit codes: 0 (calibrate: saved), 1 (compare: breaches), 2 (usage
or input error).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from numaudit.auditor.cli.main import ENV_DB, STORE, InputError, StoreSource, main, with_nearest
from numaudit.auditor.compare.policy.load import PRESETS, PolicyError, load_policy, preset_policy
from numaudit.auditor.store import UnknownRun


def noise_options(fn: Any) -> Any:
    """--noise RUN (repeatable), --noise-bands FILE, --noise-slack X."""
    fn = click.option("--noise-slack", type=click.FloatRange(min=1.0), default=None,
                      help="With --noise or --noise-bands: a key is within the reference's "
                           "noise up to this many times the largest distance among its runs "
                           "(default 4; docs/noise.md).")(fn)
    fn = click.option("--noise-bands", "noise_bands", type=click.Path(dir_okay=False,
                                                                      path_type=Path),
                      help="Judge the candidate against noise bands saved by `auditor "
                           "calibrate`.")(fn)
    fn = click.option("--noise", "noise", multiple=True, metavar="RUN",
                      help="A rerun of REF with the same configuration (repeat for more): "
                           "differences among them are the reference's own noise, and the "
                           "candidate is judged against it, per key and rank piece.")(fn)
    return fn


def noise_spec(noise: tuple[str, ...], bands_file: Path | None, slack: float | None,
               local: bool, ref: str = "") -> Any:
    """The `auditor.compare.noise.judge.NoiseSpec` the options ask for (None without them)."""
    if ref and ref in noise:
        raise InputError(f"noise: {ref!r} is the reference itself; give its reruns")
    if not noise and bands_file is None:
        if slack is not None:
            raise InputError("noise-slack: needs --noise RUN or --noise-bands FILE")
        return None
    if noise and bands_file is not None:
        raise InputError("noise-bands: give reruns (--noise) or a bands file, not both")
    if not local:
        raise InputError("noise: needs the store (--db); the daemon's Compare and Watch have "
                         "no noise bands")
    from numaudit.auditor.compare.noise.bands_file import BandsError, load_bands
    from numaudit.auditor.compare.noise.judge import DEFAULT_SLACK, NoiseSpec

    spec = NoiseSpec(reruns=tuple(dict.fromkeys(noise)),
                     slack=DEFAULT_SLACK if slack is None else slack)
    if bands_file is not None:
        try:
            spec.bands = load_bands(bands_file)
        except BandsError as exc:
            raise InputError(f"noise-bands: {exc}") from None
        spec.source = str(bands_file)
    return spec


@main.command()
@click.argument("runs", nargs=-1, required=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Write the bands here (an .npz archive, docs/noise.md).")
@click.option("--preset", type=click.Choice(list(PRESETS)),
              help="Tolerance preset whose elementwise test counts the bands' share of "
                   "failing elements.")
@click.option("--policy", "policy_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Policy file (TOML, docs/policy.md): its renames and payload budget.")
@click.option("--steps", metavar="K:|K:M|K", help="Measure only steps K..M-1.")
@click.option("--store", "--db", "db", type=STORE, metavar="PATH|URL",
              help=f"Read a store: a SQLite file or a postgresql:// URL (default ${ENV_DB}).")
def calibrate(runs: tuple[str, ...], output: Path, preset: str | None,
              policy_file: Path | None, steps: str | None, db: Path | str | None) -> int:
    """Measure the noise bands among RUNS (a reference and its reruns with the same
    configuration: every pair of them) and save them for `compare --noise-bands`."""
    import os

    from numaudit.auditor.compare.measure.comparison import CompareError
    from numaudit.auditor.compare.noise.bands_file import describe_file, save_bands
    from numaudit.auditor.compare.noise.calibrate import measure_bands
    from numaudit.auditor.compare.read.selection import KeySelection
    from numaudit.auditor.store.location import store_location

    if len(set(runs)) < 2:
        raise InputError("runs: give the reference and at least one rerun (two runs or more)")
    if not output.parent.is_dir():
        raise InputError(f"output: directory {output.parent} does not exist")
    try:
        policy = preset_policy(preset) if policy_file is None else load_policy(policy_file,
                                                                               preset)
    except PolicyError as exc:
        raise InputError(f"policy: {exc}") from None
    select = None
    if steps is not None:
        try:
            select = KeySelection.parse_steps(steps)
        except ValueError as exc:
            raise InputError(str(exc)) from None
    if db is None:
        if not os.environ.get(ENV_DB):
            raise InputError("calibrate reads a store: give --store PATH|URL (or --db)")
        db = store_location(os.environ[ENV_DB])
    source = StoreSource(db)
    try:
        try:
            bands = measure_bands(source.reader, list(runs), policy, select=select,
                                  progress=lambda line: click.echo(f"[calibrate] {line}",
                                                                   err=True))
        except UnknownRun as exc:
            raise with_nearest(source, runs, str(exc)) from None
        except CompareError as exc:
            raise InputError(str(exc)) from None
    finally:
        source.close()
    try:
        save_bands(bands, output)
    except OSError as exc:
        raise InputError(f"output: cannot write {output} ({exc.strerror or exc})") from None
    click.echo(f"{output}: {describe_file(bands)}")
    text = (bands.meta.get("nondeterminism") or {}).get("text")
    if text:
        click.echo(text[0].upper() + text[1:])
    sys.stdout.flush()
    return 0
