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

from auditor.compare.engine import compare_runs
from auditor.compare.policy import preset_policy
from auditor.report import html as H
from auditor.report.json_report import to_json
from tests import browser
from tests.auditor.cli.three_runs import runs
from tests.auditor.report.test_html import EVIL, _synthetic_doc
from tests.auditor.synth import write_runs

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
    assert len(re.findall(r'class="cell s', dom)) == H.MAX_ROWS * 100
    # milliseconds from navigation start to the end of the page's script, and to its first frame
    render_ms = int(re.search(r'data-render-ms="(\d+)"', dom).group(1))
    painted = re.search(r'data-painted-ms="(\d+)"', dom)
    assert painted, "the page never painted a frame"
    assert render_ms <= int(painted.group(1)) < 2000, f"the page opened in {painted.group(1)} ms"
