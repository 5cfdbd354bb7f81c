"""`auditor watch --wait`: wait, within a deadline, for runs that have not registered yet.

A watch is often started before the jobs it watches (a CI script that starts the auditor, the
watch and then torchrun). Without --wait a run the store does not know is an input error; with it
the watch polls the source until every run named has registered, and gives up with the usual
one-line input error once --wait-timeout has passed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import grpc

from numaudit.auditor.cli.main import AddressSource, InputError, StoreSource
from numaudit.auditor.store import UnknownRun
from numaudit.protos import numaudit_pb2 as pb

DEFAULT_WAIT_TIMEOUT_S = 600.0
"""Default of --wait-timeout: how long a watch waits for its runs to register."""


def _registered(source: StoreSource | AddressSource, run: str) -> bool:
    """Whether `run` has registered; errors other than "no such run" are input errors."""
    if isinstance(source, StoreSource):
        try:
            source.reader.run_id(run)
        except UnknownRun:
            return False
        return True
    try:
        source.stub.DescribeRun(pb.DescribeRunRequest(run=run), timeout=source.timeout)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return False
        source.call(source.stub.DescribeRun, pb.DescribeRunRequest(run=run))  # the usual error
    return True


def wait_for_runs(source: StoreSource | AddressSource, runs: Sequence[str], *, timeout: float,
                  poll: float, status: Callable[[str], object],
                  clock: Callable[[], float] = time.monotonic) -> None:
    """Return once every run of `runs` is registered in `source`; InputError after `timeout`
    seconds. `status` is told once which runs it waits for."""
    deadline = clock() + timeout
    pending = [r for r in dict.fromkeys(runs) if not _registered(source, r)]
    if not pending:
        return
    status(f"waiting up to {timeout:g}s for {', '.join(pending)} to register")
    while True:
        pending = [r for r in pending if not _registered(source, r)]
        if not pending:
            return
        left = deadline - clock()
        if left <= 0:
            raise InputError(f"run: {', '.join(repr(r) for r in pending)} not registered in "
                             f"{source.label} after {timeout:g}s (--wait-timeout)")
        time.sleep(min(poll, left))
