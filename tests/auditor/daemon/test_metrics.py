"""Issue 30 item 3: Prometheus metrics of `auditor serve --metrics-listen 127.0.0.1:0`.

A real daemon (subprocess); real batches; the endpoint is scraped over HTTP before and after, and
every counter must have moved by exactly what was sent (docs/metrics.md lists the names)."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from numaudit.auditor.daemon.metrics import DaemonMetrics
from numaudit.auditor.daemon.server import BackgroundServer
from numaudit.protos import numaudit_pb2 as pb
from numaudit.protos import numaudit_pb2_grpc
from numaudit.wire import limits
from tests.auditor.builders import V1, batch, float32_bytes, record, register_request
from tests.auditor.daemon.daemon_proc import daemon

pytestmark = pytest.mark.timeout(120)
P = "numaudit_auditor_"


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def moved(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (P + name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_count_what_the_daemon_did(tmp_path):
    db = tmp_path / "m.db"
    with daemon(db, "--metrics-listen", "127.0.0.1:0") as (proc, address):
        metrics_port = int(db.with_suffix(".port.metrics").read_text())
        maddr = f"127.0.0.1:{metrics_port}"
        before = scrape(maddr)
        assert before[(P + "open_streams", ())] == 0
        with grpc.insecure_channel(address, options=limits.client_options()) as ch:
            stub = numaudit_pb2_grpc.AuditorStub(ch)
            stub.Register(register_request(run="ref", session_id="s"), timeout=10)
            batches = [batch(1, [record(0, m, f"l.{m}") for m in range(5)], session_id="s"),
                       batch(2, [record(1, 0, "l.0", payload=float32_bytes(12)),
                                 record(1, 1, "l.1")], session_id="s"),
                       batch(3, [record(0, 0, "l.0"), record(2, 0, "l.0")], session_id="s")]
            acks = list(stub.Ingest(iter(batches), timeout=30))
            assert [a.stored for a in acks] == [5, 2, 1] and acks[2].duplicates == 1
            # a refusal: a version this build does not speak (FAILED_PRECONDITION, "version")
            bad = batch(4, [record(3, 0, "l.0")], session_id="s")
            bad.schema_version = V1 + 99
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Ingest(iter([bad]), timeout=30))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            # and one more: a record without a site (INVALID_ARGUMENT, "invalid")
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Ingest(iter([batch(4, [record(3, 0, "")], session_id="s")]), timeout=30))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            stub.CloseSession(pb.CloseSessionRequest(schema_version=V1, session_id="s",
                                                     records_sent=9, records_dropped=7), timeout=10)
            with pytest.raises(grpc.RpcError) as err:  # unknown runs: refused, and timed
                stub.Compare(pb.CompareRequest(ref="nope", cand="nada"), timeout=60)
            compare_code = err.value.code()
            deadline = time.monotonic() + 10
            while True:  # the stream's slot is freed as the handler ends, just after the reply
                after = scrape(maddr)
                if after[(P + "open_streams", ())] == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
    print(f"FIGURE metrics scraped at {maddr}: compare refused {compare_code.name}")
    assert moved(before, after, "batches_acked_total") == 3
    assert moved(before, after, "records_ingested_total", outcome="stored") == 8
    assert moved(before, after, "records_ingested_total", outcome="duplicate") == 1
    assert moved(before, after, "records_ingested_total", outcome="conflict") == 0
    assert moved(before, after, "ingested_bytes_total") == sum(b.ByteSize() for b in batches)
    assert moved(before, after, "records_dropped_total") == 7
    assert moved(before, after, "refusals_total", method="Ingest", code="FAILED_PRECONDITION",
                 reason="version") == 1
    assert moved(before, after, "refusals_total", method="Ingest", code="INVALID_ARGUMENT",
                 reason="invalid") == 1
    assert moved(before, after, "refusals_total", method="Compare", code=compare_code.name,
                 reason="UnknownRun") == 1
    assert moved(before, after, "ack_latency_seconds_count") == 3
    assert moved(before, after, "ack_latency_seconds_bucket", le="+Inf") == 3
    assert 0 < moved(before, after, "ack_latency_seconds_sum") < 30
    assert moved(before, after, "compare_duration_seconds_count") == 1
    assert after[(P + "open_streams", ())] == 0
    assert after[(P + "inflight_bytes", ())] == 0


def test_in_process_servers_keep_their_own_registries(tmp_path):
    """Two daemons in one process: a dedicated registry each, no global collisions."""
    one, two = DaemonMetrics(), DaemonMetrics()
    with BackgroundServer("127.0.0.1:0", tmp_path / "a.db", metrics=one,
                          metrics_listen="127.0.0.1:0") as a, \
            BackgroundServer("127.0.0.1:0", tmp_path / "b.db", metrics=two,
                             metrics_listen="127.0.0.1:0"):
        with grpc.insecure_channel(a.address, options=limits.client_options()) as ch:
            stub = numaudit_pb2_grpc.AuditorStub(ch)
            stub.Register(register_request(run="ref", session_id="s"), timeout=10)
            list(stub.Ingest(iter([batch(1, [record(0, 0, "l.0")], session_id="s")]), timeout=30))
        assert one.address != two.address
        assert scrape(one.address)[(P + "batches_acked_total", ())] == 1
        assert scrape(two.address)[(P + "batches_acked_total", ())] == 0
