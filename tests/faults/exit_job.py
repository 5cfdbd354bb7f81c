"""A training process that ends without calling `agent.close()`: by an exception out of
`agent.step`, by SIGTERM (torchrun stopping the job), or by simply returning.

    python -m tests.faults.exit_job --how HOW --records N

HOW: raise, sigterm, exit, or
- `sigterm-blocked-midstep`: SIGTERM comes while the main thread is blocked in a C call that
  does not return for it (SIGTERM is blocked in the main thread, so another thread takes it:
  what a rank waiting in a collective sees), inside the next step's microbatch, with UNSENT
  more captures not handed to the sender yet;
- `sigterm-user`, `sigterm-user-blocked`: the same two with the script's own SIGTERM handler
  (installed before `attach`), which prints "user handler ran" and exits 3; the blocked main
  thread returns to Python once the watcher has closed the agent;
- `sigterm-user-after-blocked`: that handler installed after `attach`, replacing the agent's;
  the main thread is blocked reading stdin until the test writes a line (after the watcher's
  grace);
- `fork`: a forked child (a DataLoader worker) is sent SIGTERM and dies of it; the job then
  prints whether its own agent is still open and ends normally.

Address, run, spool and flush timeout come from NUMAUDIT_* variables, as under torchrun. Prints
"ready" once its records are captured (the SIGTERM test waits for it), then ends as told.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

import torch

import numaudit

UNSENT = 10


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--how", required=True,
                   choices=("raise", "sigterm", "sigterm-blocked-midstep", "sigterm-user",
                            "sigterm-user-blocked", "sigterm-user-after-blocked", "fork", "exit"))
    p.add_argument("--records", type=int, default=30)
    args = p.parse_args()
    if args.how in ("sigterm-user", "sigterm-user-blocked"):
        signal.signal(signal.SIGTERM, _user_handler)
    agent = numaudit.attach(None, batch_records=8)
    if args.how == "sigterm-user-after-blocked":  # replaces the agent's handler
        signal.signal(signal.SIGTERM, _user_handler)
    with agent.step(0):
        with agent.microbatch(0):
            for i in range(args.records):
                agent.capture(torch.full((4,), float(i)), site=f"t{i}", phase="input")
        if args.how == "raise":
            raise RuntimeError("training failed")  # out of agent.step, then out of the script
    if args.how == "sigterm-blocked-midstep":
        with agent.step(1):
            with agent.microbatch(0):
                for i in range(UNSENT):  # not handed to the sender before the SIGTERM
                    agent.capture(torch.full((4,), float(i)), site=f"u{i}", phase="input")
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
                print("ready", flush=True)
                time.sleep(120)  # killed long before
    if args.how.endswith("-blocked"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    if args.how == "fork":
        child = os.fork()
        if child == 0:
            time.sleep(60)  # killed long before
            os._exit(0)
        time.sleep(0.2)
        os.kill(child, signal.SIGTERM)
        _, status = os.waitpid(child, 0)
        time.sleep(2.0)  # past the watcher's grace: it would have closed the agent by now
        print(f"child {os.waitstatus_to_exitcode(status)} parent_open {not agent._closed}",
              flush=True)
        return
    print("ready", flush=True)
    if args.how == "sigterm-user-blocked":
        # Blocked in a C call (a lock) until the watcher has closed the agent; the handlers
        # run when the main thread is back in Python.
        closed = threading.Event()
        threading.Thread(target=_when_closed, args=(agent, closed), daemon=True).start()
        closed.wait()
    if args.how == "sigterm-user-after-blocked":
        # Blocked in a C call (a read of stdin) until the test writes a line, after the
        # watcher's grace; then the script's handler runs.
        sys.stdin.readline()
    if args.how.startswith("sigterm"):
        time.sleep(120)  # killed long before


def _when_closed(agent, closed: threading.Event) -> None:
    while not agent._closed:
        time.sleep(0.05)
    with agent._close_lock:  # held until the close is over
        closed.set()


def _user_handler(signum, frame):
    print("user handler ran", flush=True)
    sys.exit(3)


if __name__ == "__main__":
    sys.exit(main())
