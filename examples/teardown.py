"""End a torchrun rank once its work is done, without the interpreter's teardown.

torch 2.13's gloo backend can abort a rank at exit, after ``destroy_process_group()``, with
``terminate called without an active exception``. A native backtrace of one such rank
(docs/reliability.md) shows why: a gloo worker thread (``pt_gloo_runloop``) releases a finished
all-reduce whose tensors still have Python objects; the release needs the GIL; the main thread
is already finalizing the interpreter, so CPython ends the worker thread with
``pthread_exit``, whose unwinding through a destructor that may not throw calls
``std::terminate``. torchrun then reports the job as failed although every rank finished. It
happened to 2 of 16 runs of the DS3 reference job on the Xeon host, the same with and without
numaudit's changes of the day.

Ending the process with ``os._exit`` once the work is done skips that teardown: nothing of the
job is lost by then (the agent is closed, its records acked or spooled; outputs are written and
flushed here). Call it last, from the ``__main__`` block, after ``destroy_process_group()``: a
rank that fails raises before it and keeps its traceback and exit status.
"""

from __future__ import annotations

import os
import sys


def exit_rank(code: int = 0) -> None:
    """Flush stdout and stderr and end this process now with ``code``."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing left to write to
            pass
    os._exit(code)
