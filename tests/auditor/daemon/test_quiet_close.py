"""Issue 10 item 14: a session that closes normally logs nothing at ERROR in the daemon.

The agent ends an Ingest stream by finishing its request iterator and cancelling the call
(agents/delivery/transport.py); a handler waiting for the next batch at that moment used to leave an
orphaned `__anext__` task whose StopAsyncIteration asyncio logged as "Task exception was never
retrieved"."""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time

import grpc
import pytest

from numaudit.auditor.daemon.server import BackgroundServer
from numaudit.protos import numaudit_pb2 as pb
from numaudit.protos import numaudit_pb2_grpc
from numaudit.wire import limits
from tests.auditor.builders import V1, batch, record, register_request

T = 10
pytestmark = pytest.mark.timeout(120)


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _session(stub, n: int, *, cancel: bool) -> None:
    sid = f"s{n}"
    stub.Register(register_request(session_id=sid, rank=n % 2), timeout=T)
    outbox: queue.Queue = queue.Queue()

    def requests():
        while (item := outbox.get()) is not None:
            yield item

    call = stub.Ingest(requests(), timeout=T)
    acks = []
    reader = threading.Thread(target=lambda: acks.extend(_drain(call)), daemon=True)
    reader.start()
    for seq in (1, 2):
        outbox.put(batch(seq, [record(n, seq, "layers.0")], session_id=sid))
    deadline = time.monotonic() + T
    while len(acks) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(acks) == 2
    outbox.put(None)  # what the agent does at close: end the iterator...
    if cancel:
        call.cancel()  # ...and cancel the call
    reader.join(T)
    stub.CloseSession(pb.CloseSessionRequest(schema_version=V1, session_id=sid, records_sent=2),
                      timeout=T)


def _drain(call):
    try:
        yield from call
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.CANCELLED


def test_normal_closes_log_nothing_at_error(tmp_path):
    errors = _Errors()
    logging.getLogger().addHandler(errors)
    try:
        with BackgroundServer("127.0.0.1:0", tmp_path / "a.db", grace=1.0) as server:
            with grpc.insecure_channel(server.address, options=limits.client_options()) as ch:
                stub = numaudit_pb2_grpc.AuditorStub(ch)
                for n in range(24):
                    _session(stub, n, cancel=n % 3 != 0)
            time.sleep(0.3)
            gc.collect()  # orphaned tasks report their exception when collected
            time.sleep(0.1)
    finally:
        logging.getLogger().removeHandler(errors)
    assert [r.getMessage() for r in errors.records] == []
