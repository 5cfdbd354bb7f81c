"""The `auditor` command line: thin commands over the daemon, the store and the comparison.

Owns the click group `main` (`auditor.cli.main`, with serve, runs and show) and the modules that
register more commands on it: `compare` (compare, watch) and `ingest` (ingest); `about` holds
`--version` and the environment variables every help page lists. It may import
everything below it (daemon, store, compare, report, wire); nothing imports the CLI.
"""

from auditor.cli.main import main
from auditor.cli import compare as _compare  # noqa: F401  (registers compare, watch)
from auditor.cli import ingest as _ingest  # noqa: F401  (registers ingest)
from auditor.cli import checkpoint as _checkpoint  # noqa: F401  (registers checkpoint)
from auditor.cli.about import attach_environment_help

attach_environment_help(main)  # after every command is registered: each help names its variables

__all__ = ["main"]
