"""The HTML report in a real browser (headless Chromium): the page's script builds the heatmaps,
marks the first divergence, filters the table from the URL fragment, never runs markup from a
run's strings, and opens a 10^5-key report quickly. tests/browser.py says how Chromium is found
(NUMAUDIT_BROWSER=skip skips these tests; a missing browser fails them, saying why)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from numaudit.auditor.compare.engine import compare_runs
from numaudit.auditor.compare.policy.load import preset_policy
from numaudit.auditor.report import html as H
from numaudit.auditor.report.json_report import to_json
from tests import browser
from tests.auditor.cli.three_runs import runs
from tests.auditor.report.test_html import EVIL, _synthetic_doc
from tests.auditor.synth import mlp_run, one_ulp, write_runs

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", autouse=True)
def _chromium():
    if os.environ.get(browser.ENV_BROWSER) == "skip":
        pytest.skip(f"{browser.ENV_BROWSER}=skip")
    try:
        browser.find_chromium()
    except browser.BrowserUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("html-browser")
    db = write_runs(tmp / "audit.db", *runs())
    out = tmp / "bumped.html"
    out.write_text(H.to_html(compare_runs(db, "ref", "bumped", preset_policy("fp32"))))
    return out


def _dom(path: Path, fragment: str = "") -> str:
    try:
        dom, _ = browser.dump_dom(path, fragment)
    except browser.BrowserUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)
    assert 'data-ready="1"' in dom, "the page's script did not finish"
    return dom


def _rows(dom: str) -> list[str]:
    return re.findall(r'<tr class="finding[^"]*" data-o="(\d+)"', dom)


def test_heatmaps_first_divergence_and_table(page):
    dom = _dom(page)
    cells = re.findall(r'<rect [^>]*class="cell (s\d)[^"]*"', dom)
    assert len(cells) > 20 and {"s0", "s2"} <= set(cells)
    first = re.search(r'<rect [^>]*id="first-cell"[^>]*>', dom) or \
        re.search(r'<rect [^>]*class="cell s2 first"[^>]*id="first-cell"[^>]*>', dom)
    assert first and 'class="cell s2 first"' in first.group(0)
    assert 'id="first-outline"' in dom
    assert "fwd layers.1 output @ step 0 mb 1" in dom.split('id="first-headline"')[1][:300]
    data = json.loads(re.search(r'id="numaudit-data">(.*?)</script>', dom, re.S).group(1))
    assert len(_rows(dom)) == len(data["findings"]) > 1


def test_filter_from_the_url_narrows_the_table(page):
    everything = _rows(_dom(page))
    only = _dom(page, "phase=loss&breach=1")
    rows = _rows(only)
    assert 0 < len(rows) < len(everything)
    assert all("<td class=\"phase\">loss</td>" in tr
               for tr in re.findall(r'<tr class="finding.*?</tr>', only))
    assert re.search(r'<select id="f-phase">', only)
    selected = _dom(page, f"sel={everything[0]}")
    assert f'class="finding breach selected" data-o="{everything[0]}"' in selected
    assert 'class="rk held"' in selected  # the rank map of the selected finding


def test_strings_from_runs_do_not_run_as_markup(page, tmp_path):
    doc = json.loads(to_json(compare_runs(page.parent / "audit.db", "ref", "bumped")))
    doc["runs"]["cand"]["name"] = EVIL
    for f in doc["findings"] + [doc["first_divergence"]]:
        if f["key"]["site"] == "layers.1":
            f["key"]["site"] = EVIL
    evil = tmp_path / "evil.html"
    evil.write_text(H.render_html(doc, doc["findings"]))
    dom = _dom(evil)
    assert "<img" not in dom.split('id="numaudit-data"')[0]
    assert "&lt;img src=x onerror=alert(1)&gt;" in dom


def _doubled(kind, step, mb, site, t):
    return t * 2 if kind == "grad" else t


def _ulp(kind, step, mb, site, t):
    return one_ulp(t, 3) if (kind, site, mb) == ("fwd", "layers.1", 1) else t


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> tuple[Path, Path]:
    """Two more pages: gradients twice the reference's (DDP-2 against one process), and one
    element one ulp off, compared bitwise from payloads (one process each)."""
    tmp = tmp_path_factory.mktemp("html-measures")
    db = write_runs(tmp / "audit.db", mlp_run("ref", world=1, steps=2),
                    mlp_run("doubled", world=2, steps=2, perturb=_doubled),
                    mlp_run("ref_p", world=1, payload=True),
                    mlp_run("ulp", world=1, payload=True, perturb=_ulp))
    pages = []
    for ref, cand, preset in (("ref", "doubled", "fp32"), ("ref_p", "ulp", "bitwise")):
        out = tmp / f"{cand}.html"
        out.write_text(H.to_html(compare_runs(db, ref, cand, preset_policy(preset))))
        pages.append(out)
    return pages[0], pages[1]


def _columns(dom: str) -> list[str]:
    head = re.search(r'<table id="findings-table"><thead><tr>(.*?)</tr></thead>', dom, re.S)
    return re.findall(r'<th data-sort="(\w+)"', head.group(1))


def _cells(dom: str, column: str) -> list[str]:
    return re.findall(rf'<td class="{column}">([^<]*)</td>', dom)


def test_heatmap_cells_are_large_and_both_axes_labelled(page):
    dom = _dom(page)
    sizes = {(float(w), float(h)) for w, h in re.findall(
        r'<rect x="[^"]*" y="[^"]*" width="([\d.]+)" height="([\d.]+)" class="cell', dom)}
    assert sizes and all(w >= 16 and h >= 16 for w, h in sizes), sizes
    fwd = re.search(r'<svg [^>]*data-phase="fwd".*?</svg>', dom, re.S).group(0)
    assert re.search(r'class="axis x-step">step</text>', fwd)
    assert re.search(r'class="axis x-mb">microbatch</text>', fwd)
    assert re.findall(r'class="col-step">([^<]*)</text>', fwd) == ["0"]
    assert re.findall(r'class="col-mb">([^<]*)</text>', fwd) == ["0", "1"]
    assert re.findall(r'class="row-label">([^<]*)</text>', fwd) == \
        ["layers.0", "layers.1", "layers.2"]
    grad = re.search(r'<svg [^>]*data-phase="grad".*?</svg>', dom, re.S).group(0)
    assert "x-mb" not in grad and re.findall(r'class="col-step">([^<]*)</text>', grad) == ["0"]
    assert "<b>fwd</b>: 3 modules × 1 step × 2 microbatches</summary>" in dom
    assert "<b>grad</b>: 3 modules × 1 step, all identical</summary>" in dom


def test_the_table_shows_each_verdicts_own_measure(page, measured):
    doubled, ulp = measured
    dom = _dom(doubled)
    assert "stage" not in _columns(dom)  # nothing is pipelined: no empty column
    assert "measure" in _columns(dom) and "group" in _columns(dom)
    assert set(_cells(dom, "measure")) >= {"×2.00"}
    assert re.search(r'<li data-group="0"><span class="bad">G0: 6 parameter gradients of '
                     r'steps 0-1: all scaled by 2.00</span>', dom), "the cause, once"
    whys = _cells(dom, "why")
    assert whys.count("as G0's first") == 5 and whys[0].startswith("introduced: ")
    dom = _dom(ulp)
    assert _cells(dom, "measure")[0].startswith("max_abs ") and \
        _cells(dom, "measure")[0].endswith(", 1 ulp")
    assert "(1 rank; blue" in _dom(ulp, "sel=" + _rows(dom)[0])
    dom = _dom(page)
    assert all(m.startswith(("rel_l2 ", "allclose ", "max_abs ", "×")) or m == ""
               for m in _cells(dom, "measure"))
    assert any(m.startswith("rel_l2 ") for m in _cells(dom, "measure"))


def test_screenshot(page, tmp_path):
    png = tmp_path / "report.png"
    try:
        browser.screenshot(page, png)
    except browser.BrowserUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_a_large_report_opens_quickly(tmp_path):
    doc, findings = _synthetic_doc(sites=1000, columns=100)  # 10^5 keys
    big = tmp_path / "big.html"
    big.write_text(H.render_html(doc, findings))
    dom = _dom(big)
    assert len(re.findall(r'class="cell s', dom)) == H.MAX_ROWS * H.MAX_COLS
    # milliseconds from navigation start to the end of the page's script, and to its first frame
    render_ms = int(re.search(r'data-render-ms="(\d+)"', dom).group(1))
    painted = re.search(r'data-painted-ms="(\d+)"', dom)
    assert painted, "the page never painted a frame"
    assert render_ms <= int(painted.group(1)) < 2000, f"the page opened in {painted.group(1)} ms"
