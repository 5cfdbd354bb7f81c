"""The HTML report without a browser: self-contained, escaped, bounded for large runs, and wired
into `auditor compare` (the browser tests are in test_html_browser.py)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from numaudit.auditor.compare.engine import compare_runs
from numaudit.auditor.compare.policy.load import preset_policy
from numaudit.auditor.report import html as H
from numaudit.auditor.report.json_report import to_json
from tests.auditor.cli.three_runs import cli, runs
from tests.auditor.synth import write_runs

EVIL = "<img src=x onerror=alert(1)></script><!--&amp;"


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> Path:
    return write_runs(tmp_path_factory.mktemp("html") / "audit.db", *runs())


@pytest.fixture(scope="module")
def bumped(db):
    return compare_runs(db, "ref", "bumped", preset_policy("fp32"))


def blob(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="numaudit-data">(.*?)</script>', page,
                  re.S)
    assert m, "no data blob"
    return json.loads(m.group(1))


def test_page_is_self_contained(bumped):
    page = H.to_html(bumped)
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"<link|@import|\bsrc\s*=|\bhref\s*=|fetch\(|XMLHttpRequest", page)
    # the only URL is the SVG namespace, which names and loads nothing
    assert set(re.findall(r"https?://[^\s'\"]+", page)) == {"http://www.w3.org/2000/svg"}
    data = blob(page)
    assert data["first"]["site"] == "layers.1" and data["first"]["cell"] is not None
    assert {h["phase"] for h in data["heatmaps"]} >= {"fwd", "bwd", "grad", "loss"}
    assert data["findings"] and all(f["verdict"] != "identical" for f in data["findings"])


def test_json_and_report_paths_give_the_same_page(bumped):
    """The daemon's path (rendered from the JSON report) shows what the store path shows."""
    doc = json.loads(to_json(bumped))
    a, b = blob(H.render_html(doc, doc["findings"])), blob(H.to_html(bumped))
    assert a["heatmaps"] == b["heatmaps"] and a["first"] == b["first"]
    assert a["findings"] == b["findings"]


def test_strings_from_runs_are_escaped(bumped):
    doc = json.loads(to_json(bumped))
    doc["runs"]["cand"]["name"] = EVIL
    doc["warnings"] = [EVIL]
    for f in doc["findings"] + [doc["first_divergence"]]:
        if f["key"]["site"] == "layers.1":
            f["key"]["site"] = EVIL
            f["notes"] = [EVIL]
    page = H.render_html(doc, doc["findings"])
    assert "<img" not in page and "<!--&" not in page
    assert page.count("</script>") == 2  # the blob's end and the script's end
    data = blob(page)
    assert data["first"]["site"] == EVIL and EVIL in data["first"]["notes"]
    assert EVIL in data["title"] and "&lt;img" in page.split("</title>")[0]


def _synthetic_doc(sites: int, columns: int) -> tuple[dict, list[dict]]:
    """A JSON-form report of sites x columns fwd keys, a few of them breaching."""
    findings = []
    order = 0
    for step in range(columns // 10):
        for mb in range(10):
            for s in range(sites):
                bad = (s * 7 + mb) % 997 == 0
                f = {"key": {"step": step, "microbatch": mb, "phase": "fwd",
                             "site": f"layers.{s}.mlp", "role": "output", "index": 0, "call": 0},
                     "verdict": "diverged" if bad else ("close" if s % 5 == 0 else "identical"),
                     "breach": bad, "stage": 0, "ref_stage": 0,
                     "ranks": {"ref": [0], "cand": [0, 1]}, "metric": "rel_l2",
                     "value": 1e-3 if bad else (1e-8 * (1 + s % 9) if s % 5 == 0 else None),
                     "threshold": 1.3e-6, "rule": "default", "detail": "", "notes": [],
                     "cause": None, "pieces": None, "order": order}
                findings.append(f)
                order += 1
    first = next(f for f in findings if f["breach"])
    doc = {"runs": {side: {"name": side, "world_size": 2, "stages": [], "dtype": "float32"}
                    for side in ("ref", "cand")},
           "policy": {"name": "fp32", "source": "preset", "sha256": "0" * 64},
           "summary": {"keys": len(findings), "verdicts": {"identical": 1}, "ignored": 0,
                       "breaches": 1, "uncertain": 0, "exit_code": 1},
           "first_divergence": first, "graph_breaks": [], "warnings": []}
    return doc, findings


def test_large_runs_are_aggregated_to_a_bounded_page():
    doc, findings = _synthetic_doc(sites=1000, columns=100)  # 10^5 keys
    started = time.perf_counter()
    page = H.render_html(doc, findings)
    took = time.perf_counter() - started
    data = blob(page)
    [hm] = data["heatmaps"]
    assert (hm["sites"], hm["columns"]) == (1000, 100)
    assert len(hm["rows"]) == H.MAX_ROWS and len(hm["cols"]) == H.MAX_COLS
    assert hm["col_steps"][0] == "0" and hm["col_mbs"][0] == "0-1"  # 100 columns in 64
    assert len(hm["cells"]) // 5 <= H.MAX_ROWS * H.MAX_COLS
    assert len(data["findings"]) <= H.MAX_TABLE_ROWS
    assert data["findings_listed"] == sum(f["verdict"] != "identical" for f in findings)
    assert all(f["breach"] for f in data["findings"][:1]) and data["first"]["cell"]
    assert len(page) < 1_500_000, len(page)
    assert took < 10, took


def test_buckets_cover_every_item_in_order():
    of, labels = H._buckets(list(range(1000)), 100, str)
    assert len(labels) == 100 and of == sorted(of) and set(of) == set(range(100))
    assert labels[0] == "0 … 9 (10)" and labels[-1] == "990 … 999 (10)"
    assert H._buckets(["a", "b"], 100, str) == ([0, 1], ["a", "b"])


def test_cli_writes_html_as_format_and_beside_any_format(db, tmp_path):
    page = tmp_path / "r.html"
    res = cli("compare", "ref", "bumped", "--db", db, "--format", "html", "-o", page)
    assert res.exit_code == 1, res.output
    assert blob(page.read_text())["first"]["site"] == "layers.1"
    beside = tmp_path / "b.html"
    res = cli("compare", "ref", "bumped", "--db", db, "--html-output", beside)
    assert res.exit_code == 1 and "First divergence" in res.output
    assert blob(beside.read_text())["first"]["site"] == "layers.1"
    same = cli("compare", "ref", "bumped", "--db", db, "-o", page, "--html-output", page)
    assert same.exit_code == 2 and "html-output" in same.output and "also the --output" in \
        same.output


def test_cli_renders_the_daemons_report_as_the_same_page(db, tmp_path):
    """--address: the page is rendered here from the Compare RPC's JSON, as from a store."""
    import grpc

    from numaudit.auditor.daemon.server import BackgroundServer
    from numaudit.protos import numaudit_pb2_grpc
    from numaudit.wire import limits
    from tests.auditor.synth import send

    local, remote = tmp_path / "local.html", tmp_path / "remote.html"
    assert cli("compare", "ref", "bumped", "--db", db, "--html-output", local).exit_code == 1
    with BackgroundServer("127.0.0.1:0", tmp_path / "d.db", synchronous="NORMAL",
                          grace=0.5) as srv:
        with grpc.insecure_channel(srv.address, options=limits.client_options()) as channel:
            stub = numaudit_pb2_grpc.AuditorStub(channel)
            for run in runs():
                send(stub, run, timeout=30.0)
        res = cli("compare", "ref", "bumped", "--address", srv.address, "--format", "html",
                  "-o", remote)
    assert res.exit_code == 1, res.output
    a, b = blob(local.read_text()), blob(remote.read_text())
    assert a["heatmaps"] == b["heatmaps"] and a["first"]["head"] == b["first"]["head"]
    assert [f["head"] for f in a["findings"]] == [f["head"] for f in b["findings"]]
