"""The `auditor` command line: thin commands over the daemon, the store and the comparison.

Owns the click group `main` (`auditor.cli.main`, with serve) and the modules that register more
commands on it: `runs` (runs, show), `compare` (compare, watch), `ingest` (ingest),
`checkpoint` (checkpoint), `calibrate` (calibrate; the noise options of compare and watch) and
`drill` (drill: the rerun plan that finds the operation);
`about` holds `--version` and the environment variables every help page lists. It may import
everything below it (daemon, store, compare, report, wire); nothing imports the CLI.

Ctrl-C is quiet from the command's first instant: the `auditor` script imports this package
first, and while it imports click, grpc and the rest (about a second) SIGINT ends the process
with one line and status 130 instead of a traceback from whichever import it hit; afterwards
the usual KeyboardInterrupt is back (a command turns it into "auditor: interrupted", exit 130).
"""

import signal as _signal
import threading as _threading


def _interrupted_while_starting(signum, frame):  # pragma: no cover - exercised by a subprocess
    import os

    os.write(2, b"auditor: interrupted\n")
    os._exit(130)


_previous = None
if _threading.current_thread() is _threading.main_thread() and \
        _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
    _previous = _signal.signal(_signal.SIGINT, _interrupted_while_starting)

from numaudit.auditor.cli import calibrate as _calibrate  # noqa: E402,F401  (registers calibrate)
from numaudit.auditor.cli import checkpoint as _checkpoint  # noqa: E402,F401  (registers checkpoint)
from numaudit.auditor.cli import compare as _compare  # noqa: E402,F401  (registers compare, watch)
from numaudit.auditor.cli import drill as _drill  # noqa: E402,F401  (registers drill)
from numaudit.auditor.cli import ingest as _ingest  # noqa: E402,F401  (registers ingest)
from numaudit.auditor.cli import runs as _runs  # noqa: E402,F401  (registers runs, show)
from numaudit.auditor.cli.about import attach_environment_help  # noqa: E402
from numaudit.auditor.cli.main import main  # noqa: E402

attach_environment_help(main)  # after every command is registered: each help names its variables

if _previous is not None:
    _signal.signal(_signal.SIGINT, _previous)

__all__ = ["main"]
