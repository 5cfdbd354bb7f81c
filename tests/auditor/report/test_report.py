"""Reports: the versioned JSON schema, text, JUnit XML, and the RPC size budget."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
import torch

from numaudit.auditor.compare.engine import compare_runs
from numaudit.auditor.compare.policy.load import preset_policy
from numaudit.auditor.compare.result import SCHEMA, SCHEMA_VERSION
from numaudit.auditor.daemon.compare_service import report_json_within
from numaudit.auditor.report.json_report import to_json
from numaudit.auditor.report.junit import to_junit
from numaudit.auditor.report.text import render_text, to_text
from tests.auditor.synth import mlp_run, write_runs


def _ulp(kind, step, mb, site, t):
    if (kind, site, mb) == ("fwd", "layers.1", 1):
        t = t.clone()
        t[0, 3] += 0.25  # flows on into layers.2 and the loss
        return t
    if (kind, site) == ("grad", "layers.0.weight"):
        return None  # a backward-graph break in the candidate
    return _frozen(kind, step, mb, site, t)


def _frozen(kind, step, mb, site, t):
    return None if (kind, site) == ("grad", "layers.2.weight") else t  # None in both runs


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    db = tmp_path_factory.mktemp("report") / "audit.db"
    write_runs(db, mlp_run("ref", world=2, perturb=_frozen), mlp_run("cand", world=4, perturb=_ulp))
    return compare_runs(db, "ref", "cand", preset_policy("bitwise"))


def test_json_schema_fields(report):
    doc = json.loads(to_json(report))
    assert (doc["schema"], doc["schema_version"]) == (SCHEMA, SCHEMA_VERSION)
    assert set(doc) >= {"runs", "policy", "summary", "first_divergence", "graph_breaks",
                        "warnings", "findings", "findings_included", "generated_unix"}
    assert doc["runs"]["ref"]["name"] == "ref" and doc["runs"]["cand"]["world_size"] == 4
    assert doc["policy"]["name"] == "bitwise" and len(doc["policy"]["sha256"]) == 64
    s = doc["summary"]
    assert s["exit_code"] == 1 and s["breaches"] == 4
    assert s["verdicts"]["diverged"] == 3 and s["verdicts"]["grad_none"] == 1
    assert len(doc["findings"]) == s["keys"] == sum(s["verdicts"].values())
    for f in doc["findings"]:
        assert set(f) >= {"key", "verdict", "breach", "stage", "ranks", "metrics", "threshold",
                          "metric", "value", "sigma", "rule", "cause", "order"}
        assert set(f["key"]) == {"step", "microbatch", "phase", "site", "role", "index", "call"}
    assert [f["order"] for f in doc["findings"]] == sorted(f["order"] for f in doc["findings"])
    first = doc["first_divergence"]
    assert first["key"]["site"] == "layers.1" and first["cause"]["kind"] == "introduced"
    [gb] = doc["graph_breaks"]
    assert gb["scope"] == "module" and gb["sites"] == ["layers.0.weight"]


def test_fast_identical_json_equals_the_finding(report):
    comp = report.comparison
    doc = json.loads(to_json(report))
    by_order = {f["order"]: f for f in doc["findings"]}
    n = 0
    for i in comp.indices():
        assert by_order[int(comp.rank_in_order[i])] == report.finding(i).as_dict()
        n += comp.verdict[i] == 0  # identical
    assert n > 10
    assert any(f["detail"] == "None in both runs" for f in doc["findings"])


def test_fast_close_json_equals_the_finding(tmp_path):
    db = tmp_path / "audit.db"
    write_runs(db, mlp_run("ref", world=2), mlp_run("cand", world=3, perturb=_ulp_only))
    report = compare_runs(db, "ref", "cand")  # fp32 defaults: the ulp-sized change is close
    comp = report.comparison
    doc = json.loads(to_json(report))
    close = [f for f in doc["findings"] if f["verdict"] == "close"]
    assert close and all("rel_l2" in f["metrics"] for f in close)
    by_order = {f["order"]: f for f in doc["findings"]}
    for i in comp.indices():
        assert by_order[int(comp.rank_in_order[i])] == report.finding(i).as_dict()


def _ulp_only(kind, step, mb, site, t):
    if (kind, site, mb) == ("fwd", "layers.1", 1):
        t = t.clone()
        t[0, 3] = torch.nextafter(t[0, 3], torch.tensor(2.0))
    return t


def test_json_without_identical_and_pretty(report):
    doc = json.loads(to_json(report, include_identical=False, indent=2))
    assert doc["findings_included"] == "non_identical"
    assert all(f["verdict"] != "identical" for f in doc["findings"])
    assert doc["findings_omitted"]["identical"] == report.counts["identical"]


def test_rpc_budget_drops_identical_then_passing_findings(report):
    full = report_json_within(report)
    assert json.loads(full)["findings_included"] == "all"
    small = report_json_within(report, budget=len(to_json(report, include_identical=False)) - 1)
    doc = json.loads(small)
    assert doc["findings_included"] in ("breaches", "first_breaches")
    assert all(f["breach"] for f in doc["findings"])


def test_text_report_sections_and_width(report):
    text = to_text(report, width=80)
    lines = text.splitlines()
    assert lines[0].startswith("numaudit: ref (2 ranks, float32) vs cand (4 ranks, float32)")
    assert "— 4 breach the policy" in lines[2]
    assert "First divergence" in text and "introduced" in text
    assert "Backward-graph breaks" in text and "layers.0" in text
    assert "Breaching findings: 4 in 4 groups by cause; --verbose lists every finding" in text
    assert "by phase and stage" not in text
    assert max(len(line) for line in lines) <= 80
    verbose = to_text(report, width=80, verbose=True)
    assert verbose.startswith(text.replace("; --verbose lists every finding", "")[:-1])
    assert "Breaching findings, by phase and stage" in verbose
    everything = to_text(report, width=200, show_all=True)
    assert "identical" in everything.split("Findings, by phase and stage")[1]
    limited = to_text(report, width=120, limit=1, verbose=True)
    assert "... and 1 more" in limited


def test_groups_in_json_and_text(report):
    """Every breaching finding names its group; the groups count them all, in execution
    order, and the text says each group once."""
    doc = json.loads(to_json(report))
    groups = doc["groups"]
    breaches = [f for f in doc["findings"] if f["breach"]]
    assert sum(g["count"] for g in groups) == len(breaches) == doc["summary"]["breaches"]
    assert all(f["group"] is None for f in doc["findings"] if not f["breach"])
    for g in groups:
        members = [f for f in breaches if f["group"] == g["index"]]
        assert len(members) == g["count"] and members[0]["order"] == g["first_order"]
        assert {f["key"]["site"] for f in members} == set(g["sites"])
    assert [g["first_order"] for g in groups] == sorted(g["first_order"] for g in groups)
    assert doc["first_divergence"]["group"] == 0
    text = to_text(report, width=120)
    for g in groups:
        assert g["headline"] in text


def test_text_from_the_json_form_is_the_same(report):
    doc = json.loads(to_json(report))
    from_json = render_text(doc, doc["findings"], width=100)
    assert from_json == to_text(report, width=100)


def test_junit_has_a_case_per_site_and_phase(report):
    root = ET.fromstring(to_junit(report))
    cases = {(tc.get("classname"), tc.get("name")): tc for tc in root.iter("testcase")}
    assert ("numaudit.fwd", "layers.1") in cases
    failed = {k for k, tc in cases.items() if tc.find("failure") is not None}
    assert failed == {("numaudit.fwd", "layers.1"), ("numaudit.fwd", "layers.2"),
                      ("numaudit.loss", "loss"), ("numaudit.grad", "layers.0.weight")}
    assert root.get("failures") == "4" and int(root.get("tests")) == len(cases)
    msg = cases[("numaudit.fwd", "layers.1")].find("failure").get("message")
    assert msg.startswith("1 of 2 keys breach the policy")
