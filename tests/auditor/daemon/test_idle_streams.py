"""Streams that never send (issue 40, item 10): 20,000 Ingest streams opened and never used
kept 4,080 open at the cap, and a new rank's Ingest got DEADLINE_EXCEEDED. At the cap a new
stream now takes the place of the oldest stream that has sent nothing `first_batch_s` (5 s)
after it opened, so a capped daemon admits new ranks within seconds of such a flood, while a
stream slow to send its first batch is never ended on a daemon with room (a fixed 5 s limit cut
off agents on throttled links: `test_a_first_batch_slower_than_first_batch_s...`)."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import grpc
import pytest

from numaudit.auditor.daemon.admission import ServerLimits
from numaudit.auditor.daemon.server import BackgroundServer
from numaudit.protos import numaudit_pb2_grpc
from numaudit.wire import limits
from tests.auditor.builders import batch, record, register_request
from tests.auditor.daemon.daemon_proc import daemon

pytestmark = pytest.mark.timeout(120)
CAP = 200
FLOOD = 1000
NEW_RANKS = 2


async def _flood(address: str) -> list:
    channels = [grpc.aio.insecure_channel(address, options=limits.client_options() + [
        ("grpc.use_local_subchannel_pool", 1)]) for _ in range(4)]
    calls = [numaudit_pb2_grpc.AuditorStub(channels[i % 4]).Ingest() for i in range(FLOOD)]
    await asyncio.sleep(1.0)  # the daemon has taken what it takes
    return [channels, calls]


async def _ended(calls: list) -> dict:
    """How the calls that have ended so far ended: code name, and for UNAVAILABLE whether the
    daemon said it ended the stream (`wire.limits.ENDED_PREFIX`)."""
    await asyncio.sleep(0.5)  # the client takes in the ends the daemon sent meanwhile
    out: dict = {}
    for call in calls:
        if call.done():
            code = (await call.code()).name
            if code == "UNAVAILABLE" and (await call.details()).startswith(limits.ENDED_PREFIX):
                code = "ended"
            out[code] = out.get(code, 0) + 1
    return out


def _ack_as_an_agent(stub, session: str, since: float) -> tuple[float, list]:
    """Resend after a refusal or an end, backing off, as the agent does; (seconds, refusals)."""
    stub.Register(register_request(run=session, session_id=session), timeout=10)
    attempts, ack = [], None
    while ack is None and time.monotonic() - since < 60:
        try:
            (ack,) = stub.Ingest(iter([batch(1, [record(0, 0, f"{session}.0")],
                                             session_id=session)]), timeout=5)
        except grpc.RpcError as exc:
            attempts.append(exc.code().name)
            time.sleep(0.5)
    assert ack is not None and ack.stored == 1, attempts
    return time.monotonic() - since, attempts


def test_new_ranks_are_admitted_within_seconds_of_a_flood_of_silent_streams(tmp_path):
    db = tmp_path / "a.db"
    with daemon(db, "--max-streams", str(CAP)) as (_, address):
        loop = asyncio.new_event_loop()
        try:
            held = loop.run_until_complete(_flood(address))
            flooded = time.monotonic()
            with grpc.insecure_channel(address, options=limits.client_options()) as ch:
                stub = numaudit_pb2_grpc.AuditorStub(ch)
                admitted_s, attempts = _ack_as_an_agent(stub, "late", flooded)
                more = [_ack_as_an_agent(stub, f"late{i}", time.monotonic())
                        for i in range(NEW_RANKS)]
            outcome = loop.run_until_complete(_ended(held[1]))
            for call in held[1]:
                call.cancel()
            for channel in held[0]:
                loop.run_until_complete(channel.close())
        finally:
            loop.close()
    more_s = max(s for s, _ in more)
    print(f"FIGURE idle_streams.new_rank_acked_after_s {admitted_s:.1f} attempts={attempts} "
          f"next_{NEW_RANKS}_ranks_max_s {more_s:.1f} {more} flood_outcome={outcome}")
    assert admitted_s < 15, (admitted_s, attempts)
    assert more_s < 10, more
    # The flood's streams over the cap were refused; of those held, only the ones whose place
    # or receive slot was wanted were ended, each told so; the rest stay until idle_stream_s.
    ended = outcome.get("ended", 0)
    assert outcome.get("RESOURCE_EXHAUSTED", 0) >= FLOOD - CAP - 5, outcome
    assert 1 + NEW_RANKS <= ended < CAP // 2, outcome
    assert outcome.get("UNAVAILABLE", 0) == 0, outcome


def _slow_first_batch(address: str, session: str, delay_s: float):
    """An Ingest stream whose first batch arrives `delay_s` after the stream opened."""
    def batches():
        time.sleep(delay_s)
        yield batch(1, [record(0, 0, f"{session}.0")], session_id=session)

    with grpc.insecure_channel(address, options=limits.client_options()) as ch:
        stub = numaudit_pb2_grpc.AuditorStub(ch)
        stub.Register(register_request(run=session, session_id=session), timeout=10)
        return list(stub.Ingest(batches(), timeout=delay_s + 10))


def test_a_first_batch_slower_than_first_batch_s_is_acked_while_there_is_room(tmp_path):
    """An agent whose first batch takes longer than `first_batch_s` to arrive (a throttled
    link, a loaded machine) is acked: with a fixed limit it was ended every time, never acked."""
    first_s = 0.3
    with BackgroundServer("127.0.0.1:0", tmp_path / "a.db", grace=1.0,
                          server_limits=ServerLimits(first_batch_s=first_s)) as server:
        (ack,) = _slow_first_batch(server.address, "slow", 4 * first_s)
    assert ack.stored == 1 and ack.acked_seq == 1


def test_at_the_cap_a_new_stream_takes_the_place_of_the_oldest_silent_one(tmp_path):
    """Only a stream that has sent nothing for `first_batch_s` gives its place up, the oldest
    first, one per new stream; a stream that has delivered a batch keeps its place."""
    first_s = 0.5
    # receive slots for every stream: none is ended for its slot (only for its place)
    limits_ = ServerLimits(max_ingest_streams=3, first_batch_s=first_s,
                           max_inflight_bytes=4 * 4 * limits.MAX_MESSAGE_BYTES)
    with BackgroundServer("127.0.0.1:0", tmp_path / "a.db", grace=1.0,
                          server_limits=limits_) as server, \
            grpc.insecure_channel(server.address, options=limits.client_options()) as ch:
        stub = numaudit_pb2_grpc.AuditorStub(ch)
        stub.Register(register_request(run="w", session_id="w"), timeout=10)
        outbox: queue.Queue = queue.Queue()
        working = stub.Ingest(iter(outbox.get, None), timeout=60)
        outbox.put(batch(1, [record(0, 0, "w.0")], session_id="w"))
        assert next(working).acked_seq == 1  # a working stream, idle from now on
        old = stub.Ingest(iter(threading.Event().wait, True), timeout=60)  # never sends
        time.sleep(0.1)
        young = stub.Ingest(iter(threading.Event().wait, True), timeout=60)
        time.sleep(0.1)
        # at the cap with no stream silent for first_batch_s yet: refused, nothing ended
        with pytest.raises(grpc.RpcError) as refused:
            stub.Register(register_request(run="n", session_id="n"), timeout=10)
            list(stub.Ingest(iter([batch(1, [record(0, 0, "n.0")], session_id="n")]),
                             timeout=5))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.details().startswith(limits.BUSY_PREFIX)
        time.sleep(first_s)
        (ack,) = stub.Ingest(iter([batch(1, [record(0, 0, "n.0")], session_id="n")]), timeout=5)
        assert ack.stored == 1
        with pytest.raises(grpc.RpcError) as ended:
            next(old)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert ended.value.details().startswith(limits.ENDED_PREFIX + "Ingest: 3 streams open")
        assert not young.done()  # the oldest silent stream went, only it
        outbox.put(batch(2, [record(1, 0, "w.0")], session_id="w"))
        assert next(working).acked_seq == 2  # the working stream kept its place
        outbox.put(None)
        young.cancel()
