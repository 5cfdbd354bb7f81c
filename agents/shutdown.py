"""Closing the agents a process did not close: at interpreter exit and on SIGTERM.

torchrun stops a job with SIGTERM (and SIGKILL after its grace period), and a training script
that fails seldom reaches `agent.close()`. So the first `attach` from the main thread installs:

- an `atexit` hook that closes every open agent (delivering or spilling its queue);
- a SIGTERM handler that does the same and then lets the process die of SIGTERM as it would
  have (or calls the Python handler that was there before);
- a watcher thread for the SIGTERM that the handler cannot see in time.

Why the watcher: Python runs a signal handler in the main thread, between bytecodes. A main
thread blocked in a C call (a collective waiting for a dead peer, a long kernel, a sleep the
signal arrived just before) runs it only when the call returns: the rank would neither flush
nor die, and torchrun would kill it after its grace period, queue lost. What the watcher does:

- Python's C-level handler writes the signal number to the wakeup fd
  (`signal.set_wakeup_fd`), from whichever thread took the signal; the watcher reads it.
- It gives the main thread WATCHER_GRACE_S to start the handler itself.
- If the main thread has not, and the agent's handler is still SIGTERM's (a script that
  replaced it after `attach` decides alone), it closes the agents' senders from its own thread.
  It never touches the capturer, which belongs to the training thread: captures not handed
  over yet are counted as dropped, `unsent_at_close`.
- Where SIGTERM had the default disposition, it then ends the process with SIGTERM.
- A previous wakeup fd (asyncio's) gets every byte forwarded; one set after ours replaces it,
  and the handler alone remains, as before.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import threading
import weakref

log = logging.getLogger(__name__)

WATCHER_GRACE_S = 1.0
"""How long the watcher leaves the main thread to run the SIGTERM handler before it closes the
agents from its own thread."""

_LIVE: weakref.WeakSet = weakref.WeakSet()
"""Agents not closed yet."""
_INSTALL = threading.Lock()
_installed = False
_handler_started = threading.Event()
"""Set by the SIGTERM handler as it starts (in the main thread)."""
_handler = None
"""The SIGTERM handler installed here: the watcher acts only while it is still the one."""


def register(agent) -> None:
    """Close `agent` at exit and on SIGTERM unless it is closed first (installs the hooks once)."""
    _LIVE.add(agent)
    _install()


def unregister(agent) -> None:
    _LIVE.discard(agent)


def close_live_agents(why: str, *, from_watcher: bool = False) -> None:
    for agent in list(_LIVE):
        try:
            agent._close(None, why, from_watcher=from_watcher)
        except Exception:  # pragma: no cover - close never raises; belt and braces at exit
            pass


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) does not own its parent's agents: their sender
    threads are not in it, and their records are the parent's to deliver. It neither closes nor
    reports them (at its SIGTERM or exit)."""
    _LIVE.clear()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_in_child)


def _on_sigterm(previous):
    def handler(signum, frame):
        _handler_started.set()
        close_live_agents("SIGTERM")
        if callable(previous):
            previous(signum, frame)
            return
        # Die of SIGTERM as the process would have, so torchrun sees the same exit status.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    return handler


def _install() -> None:
    """Once per process: the atexit hook; from the main thread, the SIGTERM handler over the
    default disposition or a Python handler (a process that ignores SIGTERM keeps ignoring it),
    with its watcher."""
    global _installed, _handler
    with _INSTALL:
        if _installed:
            return
        _installed = True
        atexit.register(close_live_agents, "interpreter exit")
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            previous = signal.getsignal(signal.SIGTERM)
            if previous is signal.SIG_DFL or (callable(previous) and previous is not
                                              signal.default_int_handler):
                _handler = _on_sigterm(previous)
                signal.signal(signal.SIGTERM, _handler)
                _Watcher.start(dies=previous is signal.SIG_DFL)
        except (ValueError, OSError):  # not the main interpreter, or no signals here
            pass


class _Watcher:
    """The thread that reads the wakeup fd (see the module's docstring)."""

    def __init__(self, read_fd: int, write_fd: int, previous_fd: int, dies: bool) -> None:
        self.read_fd, self.write_fd, self.previous_fd = read_fd, write_fd, previous_fd
        self.dies = dies

    @classmethod
    def start(cls, dies: bool) -> None:
        r, w = os.pipe()
        os.set_blocking(w, False)  # set_wakeup_fd requires it: a signal handler never blocks
        try:
            previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):
            os.close(r)
            os.close(w)
            return
        watcher = cls(r, w, previous, dies)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=watcher.after_fork_in_child)
        threading.Thread(target=watcher.run, name="numaudit-sigterm", daemon=True).start()

    def after_fork_in_child(self) -> None:
        """A forked child (a DataLoader worker) must not wake its parent's watcher through the
        shared pipe: it gets back the wakeup fd from before ours, and the pipe is closed."""
        try:
            if signal.set_wakeup_fd(self.previous_fd, warn_on_full_buffer=False) == self.write_fd:
                os.close(self.read_fd)
                os.close(self.write_fd)
        except (ValueError, OSError):
            pass

    def run(self) -> None:
        while True:
            try:
                data = os.read(self.read_fd, 512)  # EINTR is retried by os.read itself
            except OSError:
                return
            if not data:
                return
            if self.previous_fd >= 0:
                try:
                    os.write(self.previous_fd, data)
                except OSError:
                    pass
            if int(signal.SIGTERM) in data:
                try:
                    self.on_sigterm()
                except Exception as exc:  # pragma: no cover - a bug; the handler remains
                    log.warning("numaudit: SIGTERM watcher failed: %r", exc)

    def on_sigterm(self) -> None:
        if _handler_started.wait(WATCHER_GRACE_S) or not _ours():
            # The main thread is closing the agents itself; or the script replaced the agent's
            # handler after attach, and its own handler decides what SIGTERM does.
            return
        for rank in sorted({agent.ident.rank for agent in list(_LIVE)}):
            log.warning("rank %d: numaudit: SIGTERM came while the main thread was blocked (in "
                        "a C call, a collective); the agent is closed from a watcher thread",
                        rank)
        close_live_agents("SIGTERM", from_watcher=True)
        if not self.dies or _handler_started.is_set():
            return  # a previous Python handler, or the main thread's own, has the last word
        _die_of_sigterm()


def _ours() -> bool:
    """The agent's handler is still SIGTERM's (signal.getsignal reads it from any thread)."""
    try:
        return signal.getsignal(signal.SIGTERM) is _handler
    except (ValueError, OSError):  # pragma: no cover
        return False


def _die_of_sigterm() -> None:
    """End the process by SIGTERM's default action from a thread other than the main one
    (where `signal.signal` cannot be called): the C library's disposition is reset, then the
    signal sent again. A process that still lives (SIGTERM blocked in every thread) exits 143."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        libc.signal(signal.SIGTERM, None)  # SIG_DFL is the null handler
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait(1.0)
    finally:
        os._exit(128 + signal.SIGTERM)
