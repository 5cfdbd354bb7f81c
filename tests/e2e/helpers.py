"""Processes for end-to-end tests: `auditor serve` and torchrun, started as a user would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class Daemon:
    """`python -m numaudit.auditor serve` on a free port; stop() sends SIGTERM and returns the exit
    code."""

    def __init__(self, tmp: Path, name: str = "audit") -> None:
        self.db = tmp / f"{name}.db"
        self.port_file = tmp / f"{name}.port"
        self.log = tmp / f"{name}.log"
        with open(self.log, "w") as out:  # the daemon writes its own copy of the descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "numaudit.auditor", "serve", "--listen", "127.0.0.1:0",
                 "--db", str(self.db), "--port-file", str(self.port_file)],
                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
            )
        deadline = time.monotonic() + 30
        while not (self.port_file.exists() and self.port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"auditor did not start:\n{self.log.read_text()}")
            time.sleep(0.05)
        self.address = f"127.0.0.1:{self.port_file.read_text().strip()}"

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


SHELL_SETTINGS = ("NUMAUDIT_RUN", "NUMAUDIT_RENAME_IF_TAKEN", "NUMAUDIT_PAYLOAD_MAX_BYTES",
                  "NUMAUDIT_BATCH_DIM")
"""Variables a developer's shell may hold that would rename a test job's runs or change what its
agents capture: a test job's environment never inherits them."""


def job_env(daemon: Daemon, phases: str = "fwd,bwd,grad,loss") -> dict[str, str]:
    """The environment of a test job whose agents stream to `daemon`: the phases they capture,
    one thread per rank, the checkout importable, none of `SHELL_SETTINGS`."""
    env = dict(os.environ, NUMAUDIT_ADDR=daemon.address, NUMAUDIT_PHASES=phases,
               OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for var in SHELL_SETTINGS:
        env.pop(var, None)
    return env


def torchrun(script: str, nproc: int, *args: str, env: dict | None = None,
             timeout: float = 180) -> subprocess.CompletedProcess:
    """Run an example under torchrun (gloo, CPU); fails the test with its output on error."""
    # PYTHONFAULTHANDLER: a rank killed by a signal leaves its threads' Python stacks in stderr.
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                    PYTHONFAULTHANDLER="1", **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(ROOT / "examples" / script), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{script} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-4000:]}")
    return proc


def run_cases(run_one) -> None:
    """The main of a job script of cases (tests/e2e/parallel_job.py, seq_job.py): each argument
    CASE:RUN runs `run_one(case, run)`, one after another in one process group (gloo, when
    torchrun started several ranks), all ranks meeting at a barrier after each."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    for arg in sys.argv[1:]:
        case, run = arg.split(":", 1)
        run_one(case, run)
        if dist.is_initialized():
            dist.barrier()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ok(cmd: list[str], env: dict, timeout: float = 240) -> None:
    """Run a job script (a torchrun job or one process); fails the test with its output."""
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def compare_json(db: Path, ref: str, cand: str, *extra: str, preset: str = "fp32"
                 ) -> tuple[int, dict]:
    """`auditor compare REF CAND --format json` as a user runs it: (exit code, report)."""
    import json

    proc = subprocess.run([sys.executable, "-m", "numaudit.auditor", "compare", ref, cand, "--db",
                           str(db), "--preset", preset, "--format", "json", *extra], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def checkpoint_json(ref: str | Path, cand: str | Path, *extra: str, preset: str = "bitwise"
                    ) -> tuple[int, dict]:
    """`auditor checkpoint REF CAND --format json`: (exit code, report). Run through the CLI's
    own click entry point in this process (a subprocess spends ~3 s importing torch; the
    subprocess path is tested in tests/auditor/checkpoint); not thread-safe."""
    import json

    from click.testing import CliRunner

    from numaudit.auditor.cli import main

    res = CliRunner().invoke(main, ["checkpoint", str(ref), str(cand), "--preset", preset,
                                    "--format", "json", *extra])
    assert res.exit_code in (0, 1), f"exit {res.exit_code}: {res.stderr[-3000:]} {res.exception!r}"
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return res.exit_code, json.loads(res.stdout)


def saved_entries(directory: Path) -> set[str]:
    """Every entry of a DCP save, named as DCP names it, read from its `.metadata`."""
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(directory)).read_metadata().state_dict_metadata)
