"""Issue 10 item 6: what clients can make the daemon hold is capped.

10,000 Ingest streams and 100 Watch streams opened against `auditor serve` (a subprocess, so its
RSS is its own): those over the caps are answered RESOURCE_EXHAUSTED, the daemon's RSS stays under
RSS_BOUND, an agent stream opened before the flood keeps getting acks, idle streams are ended after
the idle timeout, and a new stream acks afterwards."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import grpc
import pytest

from numaudit.protos import numaudit_pb2 as pb
from numaudit.protos import numaudit_pb2_grpc
from numaudit.wire import limits
from tests.auditor.builders import batch, record, register_request
from tests.auditor.daemon.daemon_proc import daemon, rss_bytes

pytestmark = pytest.mark.timeout(300)
STREAMS = 10_000
WATCHES = 100
MAX_STREAMS = 2000
IDLE_S = 8.0
RSS_BOUND = 300 << 20
"""The daemon's resident memory with MAX_STREAMS idle streams held (docs/reliability.md)."""
IDLE = "held, then ended for idleness"


async def _flood(address: str) -> tuple[dict, list]:
    """Open STREAMS Ingest calls and WATCHES Watch calls; count how each ended (or that it is
    still open after the daemon had time to refuse it)."""
    channels = [grpc.aio.insecure_channel(address, options=limits.client_options() + [
        ("grpc.use_local_subchannel_pool", 1)]) for _ in range(10)]  # 10 connections
    calls = []
    for i in range(STREAMS):
        stub = numaudit_pb2_grpc.AuditorStub(channels[i % len(channels)])
        calls.append(stub.Ingest())
    watches = [numaudit_pb2_grpc.AuditorStub(channels[0]).Watch(
        pb.WatchRequest(ref="ref", cand="cand", poll_interval_s=5.0)) for _ in range(WATCHES)]
    await asyncio.sleep(8.0)  # the daemon has seen every call by now
    outcome: dict = {}
    for call in calls + watches:
        code = (await call.code()) if call.done() else None
        if code == grpc.StatusCode.UNAVAILABLE and "no batch" in await call.details():
            code = IDLE  # the daemon held it, then ended it for idleness (IDLE_S is near the sleep)
        outcome[code] = outcome.get(code, 0) + 1
    return outcome, [channels, calls, watches]


async def _ends(calls: list, timeout: float) -> dict:
    """Wait (at most `timeout` s) for every call to end; how many ended with each code."""
    codes = await asyncio.wait_for(asyncio.gather(*(call.code() for call in calls)), timeout)
    out: dict = {}
    for code in codes:
        out[code] = out.get(code, 0) + 1
    return out


def test_many_streams_and_watches_are_capped(tmp_path):
    db = tmp_path / "a.db"
    with daemon(db, "--max-streams", str(MAX_STREAMS),
                "--idle-timeout", str(IDLE_S)) as (proc, address):
        with grpc.insecure_channel(address, options=limits.client_options()) as ch:
            stub = numaudit_pb2_grpc.AuditorStub(ch)
            for run in ("ref", "cand", "live"):
                stub.Register(register_request(run=run, session_id=run), timeout=10)
            outbox: queue.Queue = queue.Queue()
            agent = iter(stub.Ingest(iter(outbox.get, None), timeout=120))
            seq = 0

            def ack_once() -> float:
                nonlocal seq
                seq += 1
                t0 = time.monotonic()
                outbox.put(batch(seq, [record(seq, 0, "live.0")], session_id="live"))
                next(agent)
                return time.monotonic() - t0

            ack_once()
            rss_before = rss_bytes(proc.pid)
            latencies: list[float] = []
            flooding = threading.Event()
            flooding.set()

            def agent_acks() -> None:  # an agent that keeps sending through the flood
                while flooding.is_set():
                    latencies.append(ack_once())
                    time.sleep(0.25)

            acker = threading.Thread(target=agent_acks)
            acker.start()
            loop = asyncio.new_event_loop()
            try:
                t0 = time.monotonic()
                outcome, held = loop.run_until_complete(_flood(address))
                flood_s = time.monotonic() - t0
                rss_flood = rss_bytes(proc.pid)
                flooding.clear()
                acker.join(10)
                during = max(latencies)
                # Idle streams are ended (UNAVAILABLE), each IDLE_S after the daemon took it:
                # wait for every held Ingest call to end rather than a fixed IDLE_S + 2 s.
                t_idle = time.monotonic()
                idle_codes = loop.run_until_complete(_ends(held[1], IDLE_S + 10))
                idle_wait_s = time.monotonic() - t_idle
                rss_after_idle = rss_bytes(proc.pid)
                # ...and a stream opened now acks (the agent's own stream was idle too: reconnect)
                (ack,) = stub.Ingest(iter([batch(seq + 1, [record(seq + 1, 0, "live.0")],
                                                 session_id="live")]), timeout=10)
                outbox.put(None)
                for call in held[1] + held[2]:
                    call.cancel()
                for channel in held[0]:
                    loop.run_until_complete(channel.close())
            finally:
                loop.close()
    print(f"FIGURE streams={STREAMS} watches={WATCHES} "
          f"outcome={ {str(k): v for k, v in outcome.items()} } "
          f"flood={flood_s:.1f}s rss_before={rss_before >> 20}MiB rss_flood={rss_flood >> 20}MiB "
          f"rss_after_idle={rss_after_idle >> 20}MiB ack_max_during={during * 1e3:.1f}ms "
          f"over {len(latencies)} acks "
          f"idle_wait={idle_wait_s:.1f}s idle_codes={ {str(k): v for k, v in idle_codes.items()} }")
    exhausted = outcome.get(grpc.StatusCode.RESOURCE_EXHAUSTED, 0)
    # Held: the cap (the agent's own stream is one of them) and 8 watches (per caller). On a
    # loaded machine some of 10,000 calls opened at once fail UNAVAILABLE in transport before
    # the daemon sees them: they are neither held nor refused, and they may fall anywhere in the
    # flood. Over the cap that does not matter (229 did in one full `make test`, with exactly the
    # cap held); under it each one leaves a slot unused (39 did in CI, with 39 fewer held). So the
    # cap is an upper bound, and every slot under it is either held or lost in transport.
    unavailable = outcome.get(grpc.StatusCode.UNAVAILABLE, 0)
    held = outcome.get(None, 0) + outcome.get(IDLE, 0)
    cap = MAX_STREAMS - 1 + 8
    assert held <= cap <= held + unavailable, outcome
    assert held >= MAX_STREAMS // 2, outcome  # the flood did reach the cap's order of magnitude
    # The rest were refused RESOURCE_EXHAUSTED; a client that has not half-closed its side may
    # see CANCELLED instead when the server's RST_STREAM overtakes the trailers (gRPC core).
    refused = exhausted + outcome.get(grpc.StatusCode.CANCELLED, 0)
    assert held + refused + unavailable == STREAMS + WATCHES, outcome
    assert exhausted > 0, outcome  # the share that sees CANCELLED depends on timing
    assert rss_flood < RSS_BOUND, rss_flood
    assert during < 5.0  # still acks; the flood itself costs the event loop (docs/reliability.md)
    assert ack.stored == 1
    # every Ingest stream the daemon held was ended for idleness (or refused before)
    assert idle_codes.get(grpc.StatusCode.UNAVAILABLE, 0) >= held - 8, idle_codes
