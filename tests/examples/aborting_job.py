"""A torchrun job whose rank 1 dies the way a C++ exception ends a process (the message on
stderr, then SIGABRT) after rank 0 has printed a lot: what examples/audit.py must still report."""

import os
import sys

rank = int(os.environ["RANK"])
for i in range(200):
    print(f"rank {rank}: step {i}", flush=True)
if rank == 1:
    sys.stderr.write("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
                     "  what():  [enforce fail at gloo/transport/tcp/pair.cc:446] "
                     "op.preamble.length <= op.nbytes\n")
    sys.stderr.flush()
    os.abort()
