"""A torchrun job whose rank 1 dies the way a C++ exception ends a process (the message on
stderr, then SIGABRT) after printing a lot: what examples/audit.py must still report.

Rank 0 ends at once, so that nothing else writes to the shared log while rank 1 dies: the
faulthandler writes its report in pieces ("Fatal Python error: ", then "Aborted"), and a line
of another rank written in between split it once in a full `make test`."""

import os
import sys

rank = int(os.environ["RANK"])
if rank == 1:
    for i in range(200):
        print(f"rank {rank}: step {i}", flush=True)
    sys.stderr.write("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
                     "  what():  [enforce fail at gloo/transport/tcp/pair.cc:446] "
                     "op.preamble.length <= op.nbytes\n")
    sys.stderr.flush()
    os.abort()
