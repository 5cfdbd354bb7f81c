"""The comparison reads a PostgreSQL store exactly as a SQLite one: the same runs, written
through the same ingest path into each backend, give the same report."""

from __future__ import annotations

import json

import pytest

from numaudit.auditor.compare.engine import compare_runs
from numaudit.auditor.compare.policy.load import preset_policy
from numaudit.auditor.report.json_report import to_json
from tests.auditor.synth import mlp_run, one_ulp, write_runs

pytestmark = pytest.mark.timeout(120)


def _ulp_and_nan(kind, step, mb, site, t):
    if kind == "fwd" and site == "layers.1" and mb == 1:
        return one_ulp(t, 3)
    if kind == "grad" and site == "layers.2.weight":
        t = t.clone()
        t.view(-1)[5] = float("nan")
    return t


def _report(location, policy):
    report = json.loads(to_json(compare_runs(location, "ref", "cand", preset_policy(policy))))
    report.pop("timings", None)
    report.pop("generated_unix")
    for side in ("ref", "cand"):
        report.get("runs", {}).get(side, {}).pop("created", None)
    return report


@pytest.mark.parametrize("policy", ["bitwise", "fp32"])
def test_the_same_runs_compare_the_same_on_sqlite_and_postgresql(tmp_path, pg_url, policy):
    runs = (mlp_run("ref", steps=2, world=2, payload=True),
            mlp_run("cand", steps=2, world=2, perturb=_ulp_and_nan, payload=True))
    write_runs(tmp_path / "audit.db", *runs)
    write_runs(pg_url, *runs)
    on_sqlite, on_pg = _report(tmp_path / "audit.db", policy), _report(pg_url, policy)
    assert on_sqlite["summary"] == on_pg["summary"]
    assert on_sqlite == on_pg
    verdicts = on_pg["summary"]["verdicts"]  # the perturbations were seen, on both
    assert verdicts["nonfinite"] > 0 and verdicts["identical"] < on_pg["summary"]["keys"]
