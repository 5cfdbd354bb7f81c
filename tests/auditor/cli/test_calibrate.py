"""`auditor calibrate` and the noise options of `compare` and `watch` (issue 39), against a real
store of runs whose rank 0 backward is nondeterministic (tests/auditor/noisy_runs.py)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from tests.auditor.cli.three_runs import cli
from tests.auditor.noisy_runs import noisy_runs
from tests.auditor.synth import write_runs


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    return write_runs(tmp_path_factory.mktemp("calibrate") / "audit.db", *noisy_runs())


def test_calibrate_saves_bands_that_compare_reuses(db, tmp_path):
    out = tmp_path / "bands.npz"
    res = cli("calibrate", "ref", "ref2", "ref3", "-o", out, "--db", db, "--preset", "fp32")
    assert res.exit_code == 0, res.output
    assert f"{out}: bands of 4 keys among 3 runs (ref, ref2, ref3; 3 pairs): 2 noisy, " \
           "2 bitwise equal, 0 without a band" in res.output
    assert "The reference's own nondeterminism" in res.output
    assert "Likely mechanism: attention backward" in res.output
    assert "[calibrate] ref vs ref2: 2 of 4 keys bitwise equal" in res.stderr
    plain = cli("compare", "ref", "clean", "--db", db, "--preset", "fp32")
    assert plain.exit_code == 1
    banded = cli("compare", "ref", "clean", "--db", db, "--preset", "fp32", "--noise-bands", out)
    assert banded.exit_code == 0, banded.output
    assert "within their band (2 of them beyond the preset alone)" in banded.output
    assert "Reference noise" in banded.output and "first differ at bwd layers.0.attn" in \
        banded.output.replace("\n  ", " ")
    measured = cli("compare", "ref", "clean", "--db", db, "--preset", "fp32", "--noise", "ref2",
                   "--noise", "ref3", "--format", "json")
    assert measured.exit_code == 0
    doc = json.loads(measured.stdout)
    assert doc["summary"]["noise"]["excused"] == 2 and doc["noise"]["source"] == "runs"


def test_compare_with_noise_names_the_breach(db):
    res = cli("compare", "ref", "x125", "--db", db, "--preset", "bf16", "--noise", "ref2",
              "--noise", "ref3", "--noise-slack", "3")
    assert res.exit_code == 1
    text = res.output.replace("\n  ", " ")
    assert "x the reference's run-to-run noise" in text and "within 3x" in text


def test_junit_and_html_carry_the_bands(db, tmp_path):
    res = cli("compare", "ref", "clean", "--db", db, "--preset", "fp32", "--noise", "ref2",
              "--noise", "ref3", "--format", "junit", "--html-output", tmp_path / "r.html")
    assert res.exit_code == 0
    root = ET.fromstring(res.stdout)
    props = {p.get("name"): p.get("value") for p in root.iter("property")}
    assert props["noise.runs"] == "ref,ref2,ref3" and props["noise.excused"] == "2"
    outs = " ".join(o.text or "" for o in root.iter("system-out"))
    assert "1 within the reference's run-to-run noise, beyond the preset alone" in outs
    page = (tmp_path / "r.html").read_text()
    assert "noise bands of 3 reference runs" in page and "own nondeterminism" in page


def test_watch_with_noise_ends_with_the_banded_summary(db):
    res = cli("watch", "ref", "rank1", "--db", db, "--preset", "bf16", "--noise", "ref2",
              "--noise", "ref3", "--format", "json", "--poll", "0.05")
    assert res.exit_code == 1
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    first = [ev["finding"] for ev in lines if ev["event"] == "first_divergence"]
    assert first[0]["metrics"]["noise"]["kind"] == "beyond_floor"
    assert lines[-1]["event"] == "summary" and lines[-1]["summary"]["noise"]["beyond_floor"] == 1


@pytest.mark.parametrize("args, message", [
    (("calibrate", "ref", "-o", "{tmp}/b.npz"), "runs: give the reference and at least one"),
    (("calibrate", "ref", "reff2", "-o", "{tmp}/b.npz"), "did you mean 'ref2'"),
    (("calibrate", "ref", "ref2", "-o", "/nonexistent/dir/b.npz"), "does not exist"),
    (("compare", "ref", "clean", "--noise", "ref2", "--noise-bands", "{tmp}/b.npz"),
     "not both"),
    (("compare", "ref", "clean", "--noise-slack", "3"), "noise-slack: needs --noise"),
    (("compare", "ref", "clean", "--noise-bands", "{tmp}/missing.npz"), "no such file"),
    (("compare", "ref", "clean", "--noise", "reff2"), "did you mean 'ref2'"),
    (("compare", "ref", "clean", "--noise", "ref2", "--noise-slack", "0.5"), "0.5"),
    (("compare", "ref", "clean", "--noise", "ref"), "'ref' is the reference itself"),
    (("watch", "ref", "clean", "--noise", "ref"), "'ref' is the reference itself"),
])
def test_noise_usage_errors_exit_2_in_one_line(db, tmp_path, args, message):
    res = cli(*(a.format(tmp=tmp_path) for a in args), "--db", db)
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output


def test_noise_needs_the_store(db):
    res = cli("compare", "ref", "clean", "--noise", "ref2", "--address", "127.0.0.1:1")
    assert res.exit_code == 2 and "noise: needs the store" in res.output
