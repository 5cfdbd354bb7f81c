"""`auditor`: the daemon and the commands that read what it stored.

    auditor serve --listen HOST:PORT --store PATH|postgresql://... [--sync full|normal]
                  [--port-file PATH] [--metrics-listen HOST:PORT]
                  [--max-streams N --max-inflight-mib N ...]
                  [--tokens FILE] [--tls-cert CERT --tls-key KEY [--tls-client-ca CA]]
    auditor runs, auditor show RUN: auditor/cli/runs.py

Clients of a daemon that requires tokens take the token from $NUMAUDIT_TOKEN (never an option:
the command line is visible to every user of the machine); --tls-* default to $NUMAUDIT_TLS_*.

Exit codes (DESIGN.md): 0 = ok, 1 = findings that breach the policy (compare), 2 = usage or input
error, always as one line on stderr. Output is rich on a terminal, plain text otherwise.

More commands (runs, show, compare, watch, ingest, checkpoint) attach to the `main` group:
`@main.command()` in their own module, imported by `auditor/cli/__init__.py`; `store_or_address`
gives them the run source the user named (with the token and the TLS settings of `tls_options`) and
`InputError` the exit-2 path.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sqlite3
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
import grpc

from numaudit.auditor.cli.about import print_version
from numaudit.auditor.daemon.admission import ServerLimits
from numaudit.auditor.daemon.tokens import (
    TokenFileError,
    Tokens,
    holds_plaintext,
    readable_by_others,
)
from numaudit.auditor.store import Reader, StoreError, UnknownRun, check_store_file, summary
from numaudit.auditor.store.location import describe, is_postgres_url, store_location
from numaudit.protos import numaudit_pb2 as pb
from numaudit.protos import numaudit_pb2_grpc
from numaudit.wire import limits
from numaudit.wire.channels import open_channel, tls_from_env, tls_from_env_files, token_from_env
from numaudit.wire.tls import ServerTLS, TLSConfig, TLSError

# Environment (arguments win over the environment):
ENV_DB = "NUMAUDIT_DB"            # store (file or postgresql:// URL) when --store/--db is not given
ENV_ADDR = "NUMAUDIT_ADDR"        # auditor address for runs/show when neither --db nor --address
DEFAULT_TIMEOUT_S = 10.0          # deadline of each call to a remote auditor

log = logging.getLogger("auditor")
# `auditor checkpoint` digests files through agents: their close line is news only when
# something was not stored (WARNING), never a line per side on success (agents.agent)
logging.getLogger("numaudit.agents.summary").setLevel(logging.WARNING)


class InputError(click.ClickException):
    """A usage or input error: one line on stderr, exit 2."""

    exit_code = 2


class RunNotFound(InputError):
    """A run name the store does not hold (exit 2); `with_nearest` adds the names it does."""


def with_nearest(source: StoreSource | AddressSource, names: Sequence[str],
                 message: str) -> InputError:
    """`message` ("run: no run named 'reff' in the store") with the nearest names the source
    holds for each of `names` it lacks ("did you mean 'ref'?"), or the runs it holds."""
    import difflib

    try:
        known = [r.run for r in source.list_runs().runs]
    except (InputError, grpc.RpcError, StoreError, sqlite3.Error):
        return RunNotFound(message)
    hints = []
    for name in dict.fromkeys(names):
        if name in known:
            continue
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        if close:
            hints.append(f"{name!r}: did you mean {' or '.join(map(repr, close))}?")
    if not hints:
        shown = ", ".join(map(repr, known[:10])) + (", ..." if len(known) > 10 else "")
        hints.append(f"the runs there: {shown}" if known else "it holds no run yet")
    return RunNotFound(f"{message}; {'; '.join(hints)}")


class StoreParam(click.ParamType):
    """A store location: a ``postgresql://`` URL stays a string, anything else is a file path."""

    name = "store"

    def convert(self, value: Any, param: Any, ctx: Any) -> Path | str:
        if isinstance(value, Path) or is_postgres_url(value):
            return value
        if not isinstance(value, str) or not value:
            self.fail(f"{value!r} is neither a file path nor a postgresql:// URL", param, ctx)
        return Path(value)


STORE = StoreParam()


INTERNAL_ERROR_EXIT = 3
"""Exit status of a command that failed on a bug (0 within policy, 1 breach, 2 bad input)."""


class _Group(click.Group):
    """Prints every click error as one line and exits with its code (2 for usage errors)."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            # click's overloads (on standalone_mode) match no forwarded *args
            return super().main(  # type: ignore[call-overload]
                *args, standalone_mode=False, **kwargs)
        try:
            rv = super().main(*args, standalone_mode=False,  # type: ignore[call-overload]
                              **kwargs)
        except click.exceptions.NoArgsIsHelpError as exc:
            click.echo(exc.ctx.get_help() if exc.ctx else str(exc), err=True)
            sys.exit(2)
        except click.ClickException as exc:
            click.echo(f"auditor: error: {exc.format_message()}", err=True)
            sys.exit(exc.exit_code)
        except (click.Abort, KeyboardInterrupt):  # Ctrl-C (click turns it into Abort)
            click.echo("auditor: interrupted", err=True)
            sys.exit(130)
        except Exception as exc:  # a bug: never exit 1, which says "findings breach the policy"
            import traceback

            traceback.print_exc(file=sys.stderr)
            click.echo(f"auditor: internal error: {type(exc).__name__}: {exc} (a bug: please "
                       "report it with the traceback above)", err=True)
            sys.exit(INTERNAL_ERROR_EXIT)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=print_version,
              help="Print the numaudit version and the wire schema version, and exit.")
def main() -> None:
    """numaudit auditor: stores what rank agents send, and shows it."""


# -- Where runs come from: a store file or a running auditor --------------------------------------

class StoreSource:
    """Runs read straight from a store file (`.reader` for commands that need the records)."""

    def __init__(self, db: Path | str) -> None:
        self.label = describe(db)
        try:
            self.reader = Reader(db)
            self.reader.conn.execute("SELECT 1 FROM runs LIMIT 1").fetchall()
        except FileNotFoundError:
            raise InputError(f"db: no store at {db}") from None
        except StoreError as exc:  # NotAStore: another application's file, a FIFO, random bytes
            raise InputError(str(exc)) from None
        except sqlite3.Error as exc:
            raise InputError(f"db: {self.label} is not a numaudit store ({exc})") from None
        except Exception as exc:  # a PostgreSQL store whose server fails the query
            if not is_postgres_url(db):
                raise
            raise InputError(f"db: {self.label}: {type(exc).__name__}: {exc}") from None

    def list_runs(self) -> pb.ListRunsResponse:
        return summary.list_runs(self.reader)

    def describe_run(self, run: str) -> pb.DescribeRunResponse:
        try:
            return summary.describe_run(self.reader, run)
        except UnknownRun as exc:
            raise with_nearest(self, [run], str(exc)) from None

    def close(self) -> None:
        self.reader.close()


class AddressSource:
    """Runs asked of a running auditor; every call has a deadline (`timeout`)."""

    def __init__(self, address: str, timeout: float = DEFAULT_TIMEOUT_S, *,
                 tls: TLSConfig | None = None, token: str | None = None) -> None:
        self.label, self.timeout = address, timeout
        try:
            self.channel = open_channel(address, tls=tls, token=token)
        except TLSError as exc:
            raise InputError(str(exc)) from None
        self.stub = numaudit_pb2_grpc.AuditorStub(self.channel)

    def call(self, method: Any, request: Any) -> Any:
        """Calls a unary RPC; any failure becomes an InputError naming the address."""
        try:
            return method(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            code, details = exc.code(), (exc.details() or "").replace("\n", " ")
            if code == grpc.StatusCode.NOT_FOUND:
                raise RunNotFound(details) from None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise InputError(f"cannot reach the auditor at {self.label} "
                                 f"({code.name}: {details})") from None
            raise InputError(f"auditor at {self.label}: {code.name}: {details}") from None

    def list_runs(self) -> pb.ListRunsResponse:
        return self.call(self.stub.ListRuns, pb.ListRunsRequest())

    def describe_run(self, run: str) -> pb.DescribeRunResponse:
        try:
            return self.call(self.stub.DescribeRun, pb.DescribeRunRequest(run=run))
        except RunNotFound as exc:
            raise with_nearest(self, [run], exc.message) from None

    def close(self) -> None:
        self.channel.close()


def store_or_address(db: Path | str | None, address: str | None,
                     timeout: float = DEFAULT_TIMEOUT_S, *, tls: TLSConfig | None = None,
                     token: str | None = None) -> StoreSource | AddressSource:
    """The run source the user named: --db, else --address, else $NUMAUDIT_DB, $NUMAUDIT_ADDR.

    An address is dialed with `tls` (default: $NUMAUDIT_TLS_CA/CERT/KEY, plaintext when unset)
    and `token` (default: $NUMAUDIT_TOKEN).
    """
    if db is not None and address is not None:
        raise InputError("give either --db or --address, not both")
    if db is None and address is None:
        if os.environ.get(ENV_DB):
            db = store_location(os.environ[ENV_DB])
        elif os.environ.get(ENV_ADDR):
            address = os.environ[ENV_ADDR]
        else:
            raise InputError("give --store PATH|URL (or --db) or --address HOST:PORT")
    if db is not None:
        return StoreSource(db)
    try:
        tls = tls if tls is not None else tls_from_env()
    except TLSError as exc:
        raise InputError(str(exc)) from None
    assert address is not None  # given, or from $NUMAUDIT_ADDR (else InputError above)
    return AddressSource(address, timeout, tls=tls, token=token or token_from_env())


def source_options(fn: Any) -> Any:
    """--db / --address / --timeout, shared by every command that reads runs."""
    fn = click.option("--timeout", type=click.FloatRange(min=0.1), default=DEFAULT_TIMEOUT_S,
                      show_default=True, help="Deadline of each call to --address, seconds.")(fn)
    fn = click.option("--address", metavar="HOST:PORT", help="Ask a running auditor.")(fn)
    fn = click.option("--store", "--db", "db", type=STORE, metavar="PATH|URL",
                      help=f"Read a store: a SQLite file or a postgresql:// URL (default "
                           f"${ENV_DB}).")(fn)
    return fn


def tls_options(fn: Any) -> Any:
    """--tls-ca / --tls-cert / --tls-key for commands that dial --address; the command passes
    `client_tls(tls_ca, tls_cert, tls_key)` to `store_or_address`."""
    fn = click.option("--tls-key", type=click.Path(dir_okay=False), metavar="KEY",
                      help="PEM key of --tls-cert.")(fn)
    fn = click.option("--tls-cert", type=click.Path(dir_okay=False), metavar="CERT",
                      help="PEM client certificate, for a daemon that requires mutual TLS.")(fn)
    fn = click.option("--tls-ca", type=click.Path(dir_okay=False), metavar="CA",
                      help="Dial --address over TLS, trusting this PEM CA "
                           "(default $NUMAUDIT_TLS_CA; none of --tls-* = plaintext).")(fn)
    return fn


def client_tls(ca: str | None, cert: str | None, key: str | None) -> TLSConfig | None:
    """TLS from --tls-* options, each defaulting to its $NUMAUDIT_TLS_*; None = plaintext."""
    env = tls_from_env_files()
    try:
        return TLSConfig.from_files(ca or env[0], cert or env[1], key or env[2])
    except TLSError as exc:
        raise InputError(str(exc)) from None


# -- serve ---------------------------------------------------------------------------------------

@main.command()
@click.option("--listen", default=limits.DEFAULT_LISTEN, show_default=True, metavar="HOST:PORT",
              help="Address to bind; port 0 picks a free port. Plaintext: keep it on loopback, "
                   "or give unix:/PATH (a socket whose file permissions decide who connects).")
@click.option("--store", "--db", "db", type=STORE, envvar=ENV_DB, metavar="PATH|URL",
              default="numaudit.db", show_default=True,
              help="Store: a SQLite file (created if missing), or a postgresql:// URL (schema "
                   "created if missing; several daemons may serve one database as replicas).")
@click.option("--sync", type=click.Choice(["full", "normal"], case_sensitive=False), default="full",
              show_default=True, help="Durability of an acked batch: full survives an OS crash "
                                      "too (SQLite synchronous, PostgreSQL synchronous_commit).")
@click.option("--port-file", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the bound port here once listening (for --listen HOST:0).")
@click.option("--grace", type=click.FloatRange(min=0), default=limits.SHUTDOWN_GRACE_S,
              show_default=True, help="Seconds in-flight calls get on SIGTERM/SIGINT.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning"]), default="info",
              show_default=True)
@click.option("--tokens", "tokens_file", type=click.Path(dir_okay=False, path_type=Path),
              metavar="FILE", help="Token file (TOML, docs/security.md): every call needs a "
                                   "token scoped to its runs. Without it the daemon is open.")
@click.option("--tls-cert", metavar="CERT", help="Serve TLS with this PEM certificate chain.")
@click.option("--tls-key", metavar="KEY", help="PEM private key of --tls-cert.")
@click.option("--tls-client-ca", metavar="CA",
              help="Require client certificates signed by this PEM CA (mutual TLS).")
@click.option("--max-streams", type=click.IntRange(min=1), default=ServerLimits.max_ingest_streams,
              show_default=True, help="Ingest streams open at once (one per rank).")
@click.option("--max-watches", type=click.IntRange(min=0), default=ServerLimits.max_watches,
              show_default=True, help="Watch streams open at once.")
@click.option("--max-watches-per-caller", type=click.IntRange(min=0),
              default=ServerLimits.max_watches_per_caller, show_default=True,
              help="Watch streams per token (per host without tokens).")
@click.option("--max-compares", type=click.IntRange(min=1), default=ServerLimits.max_compares,
              show_default=True, help="Compare calls running or queued at once.")
@click.option("--max-inflight-mib", type=click.IntRange(min=64),
              default=ServerLimits.max_inflight_bytes >> 20, show_default=True,
              help="MiB of memory batches may take from receipt to commit, all streams "
                   "together (each wire byte counted 4 times).")
@click.option("--idle-timeout", type=click.FloatRange(min=0), default=ServerLimits.idle_stream_s,
              show_default=True, help="End an Ingest stream idle this many seconds (0 = never).")
@click.option("--compare-budget", type=click.FloatRange(min=0.01),
              default=ServerLimits.compare_budget_s, show_default=True,
              help="Seconds a comparison may run before it is stopped (DEADLINE_EXCEEDED).")
@click.option("--metrics-listen", metavar="HOST:PORT",
              help="Serve Prometheus metrics (docs/metrics.md) over plain HTTP at "
                   "http://HOST:PORT/metrics; port 0 picks one (written to PORT_FILE.metrics).")
def serve(listen: str, db: Path | str, sync: str, port_file: Path | None, grace: float,
          log_level: str, tokens_file: Path | None, tls_cert: str | None, tls_key: str | None,
          tls_client_ca: str | None, max_streams: int, max_watches: int,
          max_watches_per_caller: int, max_compares: int, max_inflight_mib: int,
          idle_timeout: float, compare_budget: float, metrics_listen: str | None) -> None:
    """Run the auditor daemon until SIGTERM or SIGINT."""
    server_limits = ServerLimits(
        max_ingest_streams=max_streams, max_watches=max_watches,
        max_watches_per_caller=max_watches_per_caller, max_compares=max_compares,
        max_inflight_bytes=max_inflight_mib << 20, idle_stream_s=idle_timeout,
        compare_budget_s=compare_budget)
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not is_postgres_url(db):
        try:
            check_store_file(db, create=True)
        except StoreError as exc:
            raise InputError(str(exc)) from None
    if bool(tls_cert) != bool(tls_key):
        raise InputError("tls-cert/tls-key: give both to serve TLS")
    if tls_client_ca and not tls_cert:
        raise InputError("tls-client-ca: mutual TLS needs --tls-cert and --tls-key too")
    tls = ServerTLS(tls_cert, tls_key, tls_client_ca) if tls_cert and tls_key else None
    busy = port_in_use(listen)
    if busy:  # said before the store is created, and before gRPC logs its own line
        raise InputError(busy)
    tokens = None
    if tokens_file is not None:
        try:
            tokens = Tokens.load(tokens_file)
        except TokenFileError as exc:
            raise InputError(str(exc)) from None
        if holds_plaintext(tokens_file) and readable_by_others(tokens_file):
            log.warning("tokens: %s holds plaintext tokens and is readable by other users "
                        "(chmod 600 it, or give sha256 digests instead)", tokens_file)
    created = not is_postgres_url(db) and not Path(db).exists()
    try:
        asyncio.run(_serve(listen, db, sync, port_file, grace, tokens, tls, server_limits,
                           metrics_listen))
    except (TLSError, StoreError, RuntimeError, OSError, ValueError, sqlite3.Error) as exc:
        if created:  # a daemon that never served leaves no store behind
            for suffix in ("", "-wal", "-shm", "-journal"):
                Path(f"{db}{suffix}").unlink(missing_ok=True)
        if isinstance(exc, (TLSError, StoreError)):  # StoreError: NotAStore, an unreachable db
            raise InputError(str(exc)) from None
        raise InputError(f"cannot serve on {listen} with db={describe(db)}: {exc}") from None


def port_in_use(listen: str) -> str:
    """The error to give when the TCP address `listen` is taken by another process ("" when it
    is free, port 0, a unix socket, or a name this check cannot resolve: gRPC then decides).
    Bound with SO_REUSEADDR as gRPC binds, so a port in TIME_WAIT counts as free."""
    import errno
    import socket

    if listen.startswith("unix:"):
        return ""
    host, _, port = listen.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return ""
    bind_host = host.strip("[]") or None
    try:
        infos = socket.getaddrinfo(bind_host, int(port), type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError):
        return ""
    for family, kind, proto, _, address in infos:
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return (f"listen: {listen}: address already in use (another auditor or another "
                        f"program listens there: stop it, or give another port; "
                        f"--listen {bind_host or '0.0.0.0'}:0 picks a free one)")
        finally:
            sock.close()
    return ""


async def _serve(listen: str, db: Path | str, sync: str, port_file: Path | None, grace: float,
                 tokens: Tokens | None, tls: ServerTLS | None,
                 server_limits: ServerLimits | None = None,
                 metrics_listen: str | None = None) -> None:
    from numaudit.auditor.daemon.memory import return_freed_memory
    from numaudit.auditor.daemon.metrics import DaemonMetrics
    from numaudit.auditor.daemon.server import (
        serve as serve_daemon,  # grpc.aio only for this command
    )

    return_freed_memory()  # the daemon's RSS then follows its in-flight budget
    metrics = DaemonMetrics()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with serve_daemon(listen, db, synchronous=sync, grace=grace, tokens=tokens,
                            tls=tls, server_limits=server_limits, metrics=metrics,
                            metrics_listen=metrics_listen) as address:
        if port_file is not None and metrics.address:  # before the port file: it means "ready"
            _write_port(port_file.with_name(port_file.name + ".metrics"), metrics.address)
        if port_file is not None:
            _write_port(port_file, address)
        if metrics.address:
            click.echo(f"numaudit auditor metrics on http://{metrics.address}/metrics", err=True)
        click.echo(f"numaudit auditor listening on {address} db={describe(db)}", err=True)
        await stop.wait()
        log.info("signal received, shutting down")


def _write_port(path: Path, address: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{address.rsplit(':', 1)[1]}\n")
    tmp.replace(path)  # readers never see a half-written file
