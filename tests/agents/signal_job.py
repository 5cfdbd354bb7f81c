"""A script with an asyncio event loop that handles SIGUSR1, set up before `numaudit.attach`:
asyncio reads its signals from Python's wakeup fd, which the agent then points at its own
SIGTERM watcher (agents/shutdown.py), forwarding every byte. Prints "asyncio handler ran" once
the loop's handler has run after a SIGUSR1, or "asyncio handler did not run" after 10 s.

    NUMAUDIT_ADDR=... NUMAUDIT_RUN=... python -m tests.agents.signal_job
"""

from __future__ import annotations

import asyncio
import os
import signal

import numaudit


def main() -> None:
    loop = asyncio.new_event_loop()
    ran = asyncio.Event()
    loop.add_signal_handler(signal.SIGUSR1, ran.set)  # sets Python's wakeup fd to asyncio's
    agent = numaudit.attach(None)
    os.kill(os.getpid(), signal.SIGUSR1)

    async def wait() -> bool:
        try:
            await asyncio.wait_for(ran.wait(), 10.0)
            return True
        except TimeoutError:
            return False

    ok = loop.run_until_complete(wait())
    print("asyncio handler ran" if ok else "asyncio handler did not run", flush=True)
    loop.close()
    agent.close(timeout=0.5)


if __name__ == "__main__":
    main()
