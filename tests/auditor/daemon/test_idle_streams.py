"""Streams that never send (issue 40, item 10): 20,000 Ingest streams opened and never used
kept 4,080 open at the cap, and a new rank's Ingest got DEADLINE_EXCEEDED. A stream that has
sent nothing `first_batch_s` (5 s) after it opened is now ended, so a capped daemon admits a
new rank within seconds of such a flood."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from protos import numaudit_pb2_grpc
from tests.auditor.builders import batch, record, register_request
from tests.auditor.daemon.daemon_proc import daemon
from wire import limits

pytestmark = pytest.mark.timeout(120)
CAP = 200
FLOOD = 1000


async def _flood(address: str) -> list:
    channels = [grpc.aio.insecure_channel(address, options=limits.client_options() + [
        ("grpc.use_local_subchannel_pool", 1)]) for _ in range(4)]
    calls = [numaudit_pb2_grpc.AuditorStub(channels[i % 4]).Ingest() for i in range(FLOOD)]
    await asyncio.sleep(1.0)  # the daemon has taken what it takes
    return [channels, calls]


async def _codes(calls: list, timeout: float) -> list:
    return await asyncio.wait_for(asyncio.gather(*(call.code() for call in calls)), timeout)


def test_a_new_rank_is_admitted_within_seconds_of_a_flood_of_silent_streams(tmp_path):
    db = tmp_path / "a.db"
    with daemon(db, "--max-streams", str(CAP)) as (_, address):
        loop = asyncio.new_event_loop()
        try:
            held = loop.run_until_complete(_flood(address))
            flooded = time.monotonic()
            with grpc.insecure_channel(address, options=limits.client_options()) as ch:
                stub = numaudit_pb2_grpc.AuditorStub(ch)
                stub.Register(register_request(run="late", session_id="late"), timeout=10)
                attempts, ack = [], None
                while ack is None and time.monotonic() - flooded < 60:
                    try:  # as the agent does: resend after a refusal or an end, backing off
                        (ack,) = stub.Ingest(iter([batch(1, [record(0, 0, "l.0")],
                                                         session_id="late")]), timeout=5)
                    except grpc.RpcError as exc:
                        attempts.append(exc.code().name)
                        time.sleep(0.5)
                admitted_s = time.monotonic() - flooded
            # every silent stream the daemon held is ended within first_batch_s of opening
            codes = loop.run_until_complete(_codes(held[1], 15))
            ended_s = time.monotonic() - flooded
            for call in held[1]:
                call.cancel()
            for channel in held[0]:
                loop.run_until_complete(channel.close())
        finally:
            loop.close()
    outcome = {c.name: codes.count(c) for c in set(codes)}
    print(f"FIGURE idle_streams.new_rank_acked_after_s {admitted_s:.1f} attempts={attempts} "
          f"flood_ended_after_s {ended_s:.1f} outcome={outcome}")
    assert ack is not None and ack.stored == 1, attempts
    assert admitted_s < 15, (admitted_s, attempts)
    assert ended_s < 15 and outcome.get("UNAVAILABLE", 0) >= CAP // 2, outcome
