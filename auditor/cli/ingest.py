"""`auditor ingest SPOOL...`: load spool files (agent spills, sidecar spools) into the store."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from numaudit.auditor.cli.main import ENV_ADDR, ENV_DB, InputError, client_tls, main, tls_options
from numaudit.auditor.daemon.replay import replay, replay_into_db
from numaudit.auditor.store import StoreError, check_store_file
from numaudit.wire.channels import token_from_env
from numaudit.wire.spool import spool_files


@main.command()
@click.argument("spools", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--db", type=click.Path(dir_okay=False, path_type=Path),
              help=f"Load into this store file (default ${ENV_DB}).")
@click.option("--address", metavar="HOST:PORT", help="Load through a running auditor.")
@click.option("--run", "run", metavar="NAME",
              help="Store the records under this run name instead of the spooled one (a job "
                   "whose run name was taken spooled them).")
@tls_options
def ingest(spools: tuple[Path, ...], db: Path | None, address: str | None, run: str | None,
           tls_ca: str | None, tls_cert: str | None, tls_key: str | None) -> None:
    """Replay spool files (or every *.spool under a directory) through the ingest path.

    Idempotent: batches the auditor already stored are counted as duplicates, so a spool may be
    loaded after a partly successful live delivery, or twice. An unreadable frame (torn by a crash
    mid-write, or corrupted) is skipped and the frames after it are still loaded. Exit 0 when
    every frame of every file loaded, 1 when a frame or a file was unreadable or a batch was
    refused, 2 on usage errors.
    """
    import os

    missing = [str(p) for p in spools if not p.exists()]
    if missing:
        raise InputError(f"no such spool file or directory: {missing[0]}")
    files = list(spool_files(list(spools)))
    if not files:
        raise InputError(f"no *.spool files under {', '.join(map(str, spools))}")
    if db is not None and address is not None:
        raise InputError("give either --db or --address, not both")
    if db is None and address is None:
        db = Path(os.environ[ENV_DB]) if os.environ.get(ENV_DB) else None
        address = os.environ.get(ENV_ADDR) if db is None else None
    if db is None and address is None:
        raise InputError("give --db PATH or --address HOST:PORT")
    if run is not None:
        from numaudit.wire.names import BadName, check_run_name

        try:
            check_run_name(run)
        except BadName as exc:
            raise InputError(str(exc)) from None
    if db is not None:
        try:
            check_store_file(db, create=True)
        except StoreError as exc:
            raise InputError(str(exc)) from None
        results = replay_into_db(files, db, run=run or "")
    else:
        assert address is not None  # checked above: db or address
        results = replay(files, address, token=token_from_env(),
                         tls=client_tls(tls_ca, tls_cert, tls_key), run=run or "")
    failed = False
    for r in results:
        line = (f"{r.path}: run {r.run or '?'} rank {r.rank}: {r.batches} batches, {r.records} "
                f"records: {r.stored} stored, {r.duplicates} already stored, "
                f"{r.conflicts} conflicts")
        if r.skipped_frames:
            line += (f"; {r.skipped_frames} unreadable frames ({r.skipped_bytes} bytes) "
                     "skipped")
        click.echo(line)
        for why in r.problems:
            click.echo(f"  unreadable: {why}", err=True)
        for why in r.rejected:
            click.echo(f"  refused: {why}", err=True)
        if r.error:
            click.echo(f"  not loaded: {r.error}", err=True)
        failed |= bool(r.rejected or r.error or r.skipped_frames)
    sys.exit(1 if failed else 0)
