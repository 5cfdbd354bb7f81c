"""`make audit`: the origin case end to end on CPU.

Starts the auditor daemon on a free port with a fresh database under the build folder, runs the
DeepSeek-V3 reference (4 ranks, FSDP2) and its pipeline-parallel twin (8 ranks, ZBV), compares
them with the shipped policy, prints the report, stops the daemon and exits with the compare's
exit code (0 = within policy, 1 = findings that breach it, 2 = usage or set-up error).

    python -m examples.audit --build build [--inject NAME] [--policy FILE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POLICY = ROOT / "examples" / "policies" / "ds3_vs_pp.toml"
INJECTIONS = ("break-backward", "last-microbatch-only", "grad-scale", "swap-microbatches",
              "ulp-shared-expert")


def _say(msg: str) -> None:
    print(f"[audit] {msg}", flush=True)


class Daemon:
    """`auditor serve` as a subprocess on a free port."""

    def __init__(self, db: Path, log: Path) -> None:
        self.port_file = db.with_suffix(".port")
        self.port_file.unlink(missing_ok=True)
        self._log = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "auditor", "serve", "--listen", "127.0.0.1:0", "--db", str(db),
             "--port-file", str(self.port_file)],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT,
        )
        deadline = time.monotonic() + 30
        while not (self.port_file.exists() and self.port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the auditor did not start; see {log}")
            time.sleep(0.05)
        self.address = f"127.0.0.1:{self.port_file.read_text().strip()}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def run_job(script: str, nproc: int, name: str, address: str, log: Path, extra=()) -> float:
    """One torchrun job with the agent pointed at the daemon; returns its wall time."""
    env = dict(os.environ, NUMAUDIT_ADDR=address, NUMAUDIT_RUN=name, OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(ROOT / "examples" / script), "--name", name, *extra]
    started = time.monotonic()
    with open(log, "w") as out:
        rc = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if rc != 0:
        raise RuntimeError(f"{script} failed (exit {rc}); see {log}")
    return time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make audit", description=__doc__.splitlines()[0])
    p.add_argument("--build", type=Path, default=ROOT / "build")
    p.add_argument("--inject", choices=INJECTIONS, help="fault injected into the candidate")
    p.add_argument("--policy", type=Path, default=POLICY)
    p.add_argument("--ref", default="ref")
    p.add_argument("--cand", default="pp8")
    args = p.parse_args(argv)
    if not args.policy.exists():
        print(f"make audit: policy file not found: {args.policy}", file=sys.stderr)
        return 2

    build: Path = args.build.resolve()
    build.mkdir(parents=True, exist_ok=True)
    db = build / "audit.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    logs = build / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir()

    total = time.monotonic()
    started = time.monotonic()
    daemon = Daemon(db, logs / "auditor.log")
    _say(f"auditor listening on {daemon.address} (db {db}) in {time.monotonic() - started:.1f}s")
    try:
        _say("reference: DeepSeek-V3, 4 ranks, FSDP2, 16 microbatches ...")
        t = run_job("dsv3_spmd.py", 4, args.ref, daemon.address, logs / "ref.log")
        _say(f"reference done in {t:.1f}s")
        inject = ["--inject", args.inject] if args.inject else []
        label = f" (injected: {args.inject})" if args.inject else ""
        _say(f"candidate: DeepSeek-V3, 8 ranks = 2 pipeline x 4 FSDP2, ZBV{label} ...")
        t = run_job("dsv3_pp.py", 8, args.cand, daemon.address, logs / "cand.log", inject)
        _say(f"candidate done in {t:.1f}s")
    except RuntimeError as exc:
        daemon.stop()
        print(f"make audit: {exc}", file=sys.stderr)
        return 2

    started = time.monotonic()
    compare = [sys.executable, "-m", "auditor", "compare", args.ref, args.cand,
               "--address", daemon.address, "--policy", str(args.policy)]
    json_report = build / "report.json"
    text_report = build / "report.txt"
    subprocess.call(compare + ["--format", "json", "-o", str(json_report)], cwd=ROOT)
    subprocess.call(compare + ["--format", "text", "-o", str(text_report)], cwd=ROOT)
    rc = subprocess.call(compare, cwd=ROOT)
    _say(f"compare done in {time.monotonic() - started:.1f}s (exit {rc})")
    daemon.stop()
    _say(f"total {time.monotonic() - total:.1f}s; database {db}; reports {text_report}, "
         f"{json_report}; logs {logs}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
