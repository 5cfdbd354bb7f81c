"""`make audit`: the origin case end to end on CPU.

Starts the auditor daemon on a free port with a fresh database under the build folder, runs the
DeepSeek-V3 reference (4 ranks, FSDP2) and its pipeline-parallel twin (8 ranks, ZBV), compares
them with the shipped policy, prints the report, stops the daemon and exits with the compare's
exit code (0 = within policy, 1 = findings that breach it, 2 = usage or set-up error).

    python -m examples.audit --build build [--inject NAME] [--policy FILE]

More candidates against one reference (what the end-to-end test does): the first call runs the
reference into a fresh database; later calls with `--skip-ref` keep that database and add one
candidate each under its own name.

    python -m examples.audit --build B
    python -m examples.audit --build B --skip-ref --cand-name pp8_break --inject break-backward

`--also NAME:INJECT` (repeatable) adds more candidates to the same 8-rank job, one after another
under their own run names, each compared against the reference: most of an 8-rank CPU job is its
start-up, so many faults cost little more than one.

Drill-down (docs/drill-down.md): `--ops GLOBS` has both runs capture every operation of those
modules (NUMAUDIT_OPS), so the report names the operation that differs; `--drill` does it after
the fact: when the first divergence is a module's own, `auditor drill` writes the plan, both runs
run again with it (NUMAUDIT_PLAN, under NAME-drill) and are compared.

    python -m examples.audit --inject softmax-scale --drill
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POLICY = ROOT / "examples" / "policies" / "ds3_vs_pp.toml"
INJECTIONS = ("reshard-after-forward", "break-backward", "last-microbatch-only", "grad-scale",
              "swap-microbatches", "ulp-shared-expert", "drop-expert-tokens", "softmax-scale",
              "bf16-matmul")
"""`--inject` names; the faults themselves live in examples/dsv3_pp.py (INJECTIONS)."""
REF_RANKS, CAND_RANKS = 4, 8
JOB_TIMEOUT_S = 300
"""A training job taking longer than this is killed (a hang, not a slow machine)."""


def _say(msg: str) -> None:
    print(f"[audit] {msg}", flush=True)


class SetupError(RuntimeError):
    """Something `make audit` needs did not work (exit 2); the message says where to look."""


class Daemon:
    """`auditor serve` as a subprocess on a free port; `address` once it listens."""

    def __init__(self, db: Path, log: Path) -> None:
        self.port_file = db.with_suffix(".port")
        self.port_file.unlink(missing_ok=True)
        with open(log, "w") as out:  # the daemon writes its own copy of the file descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "numaudit.auditor", "serve", "--listen", "127.0.0.1:0",
                 "--db", str(db), "--port-file", str(self.port_file)],
                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
            )
        deadline = time.monotonic() + 60
        while not (self.port_file.exists() and self.port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SetupError(f"the auditor did not start; see {log}")
            time.sleep(0.05)
        self.address = f"127.0.0.1:{self.port_file.read_text().strip()}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.port_file.unlink(missing_ok=True)


def run_job(script: str, nproc: int, name: str, address: str, log: Path, extra=(),
            env_extra: dict[str, str] | None = None) -> float:
    """One torchrun job with the agent pointed at the daemon; returns its wall time."""
    # PYTHONFAULTHANDLER: a rank that dies of a signal (SIGABRT, SIGSEGV) prints every thread's
    # Python stack into the log, so the failure says which code was running, not just the signal.
    env = dict(os.environ, NUMAUDIT_ADDR=address, NUMAUDIT_RUN=name, OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", **(env_extra or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(ROOT / "examples" / script), "--name", name, *extra]
    started = time.monotonic()
    with open(log, "w") as out:
        try:
            rc = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                 timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            kept = _keep(log)
            raise SetupError(f"{script} did not finish in {JOB_TIMEOUT_S}s; see {kept}; the "
                             "lines that say why and its last lines:\n" + _tail(kept)) from None
    if rc != 0:
        kept = _keep(log)
        raise SetupError(f"{script} failed (exit {rc}); see {kept}; the lines that say why and "
                         "its last lines:\n" + _tail(kept))
    return time.monotonic() - started


FAILURE_MARKS = ("terminate called", "what():", "Traceback", "Error", "Signal ", "Aborted",
                 "Fatal Python error", "Thread 0x", "Current thread 0x", "  File ")
"""Words of the lines that say why a rank died (a C++ exception ending the process, a Python
traceback, the faulthandler's stacks of a rank killed by a signal, torchrun's report of the
signal); torchrun's summary at the end names only the rank."""


def _keep(log: Path) -> Path:
    """A failed job's log, copied beside it under a name of its own: a rerun of the job (a
    later test, the next `make audit`) writes the same log afresh, and the ranks' own words on
    why they died were lost with it."""
    kept = log.with_name(f"{log.stem}.failed-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}.log")
    try:
        shutil.copyfile(log, kept)
        return kept
    except OSError:
        return log


def _tail(log: Path, lines: int = 25, marked: int = 40) -> str:
    """The lines of a job's log that say why it failed (the first `marked` with a word of
    FAILURE_MARKS) and its end, so that a failure says why where it is reported (a CI log)."""
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(log unreadable: {exc})"
    why = [line for line in text[:-lines] if any(m in line for m in FAILURE_MARKS)][:marked]
    return "\n".join(why + (["..."] if why else []) + text[-lines:])


@dataclasses.dataclass
class Outcome:
    """What one `make audit` produced (the end-to-end test reads it)."""

    rc: int
    """The compare's exit code (0 within policy, 1 breach, 2 usage or set-up error)."""
    db: Path
    text_report: Path | None = None
    json_report: Path | None = None
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    """Seconds per phase: daemon, ref, cand, compare, total."""
    also: dict[str, Outcome] = dataclasses.field(default_factory=dict)
    """The `--also` candidates' outcomes, by run name (rc and reports; timings not split)."""
    drill: Outcome | None = None
    """With `--drill`: the comparison of both runs rerun with the drill-down plan."""


def compare(ref: str, cand: str, db: Path, policy: Path | None, text_report: Path,
            json_report: Path, extra: Sequence[str] = (), echo: bool = True) -> int:
    """`auditor compare` on the stored runs: JSON to a file, text to a file (and the terminal),
    from one comparison (`--json-output`).

    It reads the store file directly (`--db`): the daemon has stored and acked every record by
    the time the jobs exit. Without a policy file, `extra` should name a `--preset`.
    """
    proc = subprocess.run(
        [sys.executable, "-m", "numaudit.auditor", "compare", ref, cand, "--db", str(db),
         *(["--policy", str(policy)] if policy is not None else []), *extra,
         "--format", "text", "--json-output", str(json_report)],
        stdout=subprocess.PIPE, text=True, cwd=ROOT)
    text_report.write_text(proc.stdout)
    if echo:
        sys.stdout.write(proc.stdout)
        sys.stdout.flush()
    return proc.returncode


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="make audit", description=__doc__.splitlines()[0])
    p.add_argument("--build", type=Path, default=ROOT / "build",
                   help="folder for the database, the reports and the logs (default: build)")
    p.add_argument("--inject", choices=INJECTIONS, help="fault injected into the candidate")
    p.add_argument("--policy", type=Path, default=POLICY,
                   help=f"tolerance policy (default: {POLICY.relative_to(ROOT)})")
    p.add_argument("--ref-name", default="ref", help="run name of the reference")
    p.add_argument("--cand-name", default="pp8", help="run name of the candidate")
    p.add_argument("--skip-ref", action="store_true",
                   help="keep the database and its reference run; only add the candidate")
    p.add_argument("--bwd", action=argparse.BooleanOptionalAction, default=True,
                   help="both runs also capture the gradient at every captured module output "
                        "(phase bwd; on by default: it tells where backward goes wrong)")
    p.add_argument("--also", action="append", default=[], metavar="NAME:INJECT",
                   help="another candidate in the same job under run name NAME with fault INJECT "
                        "('none' for none), compared like the first; repeatable")
    p.add_argument("--compare-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `auditor compare` (repeatable)")
    p.add_argument("--ops", metavar="GLOBS",
                   help="both runs capture every operation of these module sites "
                        "(NUMAUDIT_OPS, comma-separated; docs/drill-down.md)")
    p.add_argument("--ops-only-for", action="append", default=[], metavar="INJECT",
                   help="with --ops: only the candidates with these faults capture operations "
                        "(the reference does); repeatable")
    p.add_argument("--drill", action="store_true",
                   help="when the first divergence is a module's own, rerun both runs with the "
                        "plan `auditor drill` writes and compare them (the operation is named)")
    return p.parse_args(argv)


def audit(args: argparse.Namespace) -> Outcome:
    """Daemon, reference, candidate, compare; the daemon is stopped whatever happens."""
    build: Path = args.build.resolve()
    build.mkdir(parents=True, exist_ok=True)
    db = build / "audit.db"
    logs = build / "logs"
    logs.mkdir(exist_ok=True)
    outcome = Outcome(rc=2, db=db)
    if args.skip_ref:
        _check_kept_database(db, args.ref_name,
                             [args.cand_name] + [a.partition(":")[0] for a in args.also])
    else:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{db}{suffix}").unlink(missing_ok=True)

    total = time.monotonic()
    started = time.monotonic()
    daemon = Daemon(db, logs / "auditor.log")
    outcome.timings["daemon"] = time.monotonic() - started
    _say(f"auditor listening on {daemon.address} (database {db}) "
         f"in {outcome.timings['daemon']:.1f}s")
    capture = ["--bwd"] if args.bwd else []
    ops = {"NUMAUDIT_OPS": args.ops} if args.ops else {}
    try:
        if not args.skip_ref:
            _say(f"reference '{args.ref_name}': DeepSeek-V3, {REF_RANKS} ranks, FSDP2, "
                 "16 microbatches per rank ...")
            outcome.timings["ref"] = run_job("dsv3_spmd.py", REF_RANKS, args.ref_name,
                                             daemon.address, logs / f"{args.ref_name}.log",
                                             capture, ops)
            _say(f"reference done in {outcome.timings['ref']:.1f}s")
        inject = capture + (["--inject", args.inject] if args.inject else [])
        for also in args.also:
            inject += ["--also", also]
        for only in args.ops_only_for:
            inject += ["--ops-only-for", only]
        label = f", injected fault: {args.inject}" if args.inject else ""
        _say(f"candidate '{args.cand_name}': DeepSeek-V3, {CAND_RANKS} ranks = 2 pipeline x 4 "
             f"FSDP2, ZBV schedule{label} ...")
        outcome.timings["cand"] = run_job("dsv3_pp.py", CAND_RANKS, args.cand_name,
                                          daemon.address, logs / f"{args.cand_name}.log", inject,
                                          ops)
        _say(f"candidate done in {outcome.timings['cand']:.1f}s")

        started = time.monotonic()
        _say(f"auditor compare {args.ref_name} {args.cand_name} --policy {_short(args.policy)}")
        outcome.text_report = build / f"report-{args.cand_name}.txt"
        outcome.json_report = build / f"report-{args.cand_name}.json"
        outcome.rc = compare(args.ref_name, args.cand_name, db, args.policy,
                             outcome.text_report, outcome.json_report, args.compare_arg)
        for also in args.also:
            name = also.partition(":")[0]
            other = outcome.also[name] = Outcome(rc=2, db=db)
            other.text_report = build / f"report-{name}.txt"
            other.json_report = build / f"report-{name}.json"
            other.rc = compare(args.ref_name, name, db, args.policy, other.text_report,
                               other.json_report, args.compare_arg, echo=False)
        outcome.timings["compare"] = time.monotonic() - started
        if args.drill and outcome.rc == 1:
            outcome.drill = drill(args, build, db, daemon.address, capture)
    finally:
        daemon.stop()
    outcome.timings["total"] = time.monotonic() - total
    _say(f"compare done in {outcome.timings['compare']:.1f}s (exit {outcome.rc})")
    _say(f"total {outcome.timings['total']:.1f}s")
    _say(f"database: {db}")
    _say(f"reports:  {outcome.text_report}")
    _say(f"          {outcome.json_report}")
    _say(f"logs:     {logs}")
    return outcome


def drill(args: argparse.Namespace, build: Path, db: Path, address: str,
          capture: list[str]) -> Outcome | None:
    """`--drill`: `auditor drill` writes the plan; both runs run again with it under
    NAME-drill; their comparison names the operation. None when there is nothing to drill."""
    plan = build / "drill-plan.toml"
    proc = subprocess.run([sys.executable, "-m", "numaudit.auditor", "drill", args.ref_name,
                           args.cand_name, "--db", str(db), "--policy", str(args.policy),
                           "-o", str(plan)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        _say(f"no drill-down: {proc.stderr.strip()}")
        return None
    _say(f"drill-down plan {plan}: {proc.stderr.strip()}")
    env = {"NUMAUDIT_PLAN": str(plan)}
    ref, cand = f"{args.ref_name}-drill", f"{args.cand_name}-drill"
    logs = build / "logs"
    _say(f"reference '{ref}' with the plan ...")
    run_job("dsv3_spmd.py", REF_RANKS, ref, address, logs / f"{ref}.log", capture, env)
    _say(f"candidate '{cand}' with the plan ...")
    run_job("dsv3_pp.py", CAND_RANKS, cand, address, logs / f"{cand}.log",
            capture + (["--inject", args.inject] if args.inject else []), env)
    _say(f"auditor compare {ref} {cand} --policy {_short(args.policy)}")
    out = Outcome(rc=2, db=db, text_report=build / f"report-{cand}.txt",
                  json_report=build / f"report-{cand}.json")
    out.rc = compare(ref, cand, db, args.policy, out.text_report, out.json_report,
                     args.compare_arg)
    return out


def _check_kept_database(db: Path, ref: str, cands: list[str]) -> None:
    """--skip-ref: the database must hold the reference and not yet the candidates."""
    from numaudit.auditor.store import Reader

    if not db.exists():
        raise SetupError(f"--skip-ref: no database at {db} (run once without --skip-ref)")
    reader = Reader(db)
    try:
        names = set(reader.run_names())
    finally:
        reader.close()
    if ref not in names:
        raise SetupError(f"--skip-ref: {db} holds no run '{ref}'")
    for cand in cands:
        if cand in names:
            raise SetupError(f"--skip-ref: {db} already holds a run '{cand}'; choose another "
                             "--cand-name")


def _short(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.policy.exists():
        print(f"make audit: policy file not found: {args.policy}", file=sys.stderr)
        return 2
    try:
        return audit(args).rc
    except SetupError as exc:
        print(f"make audit: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
