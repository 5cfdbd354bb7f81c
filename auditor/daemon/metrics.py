"""Prometheus metrics of one daemon (`auditor serve --metrics-listen HOST:PORT`, docs/metrics.md).

Each daemon has its own `CollectorRegistry` (never prometheus_client's global one), so several
in-process servers (tests) keep separate counts. The registry always exists and is cheap to
update (a counter increment is a lock and an add); it is served over HTTP only when asked, by
`metrics_http.MetricsServer` (one thread, connections timed out, the page rendered at most once
a second however often it is scraped). Updated from the event loop; the gauges read the
admission counters when the page is rendered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from numaudit.auditor.daemon.metrics_http import MetricsServer

log = logging.getLogger(__name__)

PREFIX = "numaudit_auditor_"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_COMPARE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class DaemonMetrics:
    """The metrics of one daemon; `serve_http` exposes them. Names: docs/metrics.md."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.address = ""
        """"HOST:PORT" of the HTTP endpoint once `serve_http` ran."""
        self._http: Any = None
        r = self.registry
        self.batches = Counter(PREFIX + "batches_acked", "Ingest batches committed and acked",
                               registry=r)
        self.records = Counter(PREFIX + "records_ingested",
                               "Records in acked batches (stored, duplicates and conflicts)",
                               ["outcome"], registry=r)
        self.bytes = Counter(PREFIX + "ingested_bytes", "Serialized bytes of acked batches",
                             registry=r)
        self.refusals = Counter(PREFIX + "refusals", "Calls answered with an error status",
                                ["method", "code", "reason"], registry=r)
        self.dropped = Counter(PREFIX + "records_dropped",
                               "Records the agents reported dropped at CloseSession", registry=r)
        self.ack_latency = Histogram(PREFIX + "ack_latency_seconds",
                                     "From a batch's receipt to its ack (admission, validation, "
                                     "commit)", buckets=_LATENCY_BUCKETS, registry=r)
        self.compare_seconds = Histogram(PREFIX + "compare_duration_seconds",
                                         "Compare calls, from receipt to reply (or refusal)",
                                         buckets=_COMPARE_BUCKETS, registry=r)
        self.evictions = Counter(PREFIX + "receive_slot_evictions",
                                 "Idle Ingest streams ended to free a receive slot", registry=r)

    def watch_admission(self, admission: Any, slots: Any) -> None:
        """Gauges that read the live counts of `admission.Admission` and the receive slots."""
        gauges: list[tuple[str, str, Callable[[], float]]] = [
            ("open_streams", "Ingest streams open", lambda: admission.streams),
            ("inflight_bytes", "Memory of batches received and admitted, not yet committed "
             "(4 bytes a wire byte)",
             lambda: admission.inflight_bytes),
            ("receiving_streams", "Ingest streams holding a receive slot",
             lambda: slots.held),
            ("waiting_streams", "Ingest streams waiting for a receive slot",
             lambda: slots.waiting),
            ("open_watches", "Watch streams open", lambda: sum(admission.watches.values())),
            ("compares", "Compare calls running or queued", lambda: admission.compares),
        ]
        for name, doc, read in gauges:
            Gauge(PREFIX + name, doc, registry=self.registry).set_function(read)

    def refused(self, method: str, code: str, exc: BaseException) -> None:
        reason = getattr(exc, "kind", None) or type(exc).__name__
        self.refusals.labels(method=method, code=code, reason=reason).inc()

    def acked(self, nbytes: int, stored: int, duplicates: int, conflicts: int,
              seconds: float) -> None:
        self.batches.inc()
        self.bytes.inc(nbytes)
        for outcome, n in (("stored", stored), ("duplicate", duplicates),
                           ("conflict", conflicts)):
            if n:
                self.records.labels(outcome=outcome).inc(n)
        self.ack_latency.observe(seconds)

    def serve_http(self, listen: str) -> str:
        """Serves /metrics on `listen` ("HOST:PORT", port 0 picks one); returns the bound
        "HOST:PORT". Plain HTTP: keep it on loopback or a private network."""
        host, _, port = listen.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"metrics-listen: {listen!r} is not HOST:PORT")
        host = host.strip("[]") or "0.0.0.0"
        server = MetricsServer(host, int(port),
                               lambda: (generate_latest(self.registry), CONTENT_TYPE_LATEST))
        self._http = server
        self.address = f"{listen.rpartition(':')[0]}:{server.server_address[1]}"
        log.info("metrics on http://%s/metrics", self.address)
        return self.address

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None
