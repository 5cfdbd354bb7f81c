"""JUnit XML: a test suite per phase, a test case per site, so CI systems show breaches."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterable, Iterator

from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.result import Report


def render_junit(doc: dict, findings: Iterable[dict]) -> str:
    """JUnit XML: a test suite per phase, a test case per site (failed when a key breaches)."""
    suites: dict[str, dict[str, list[dict]]] = {}
    for f in findings:
        k = f["key"]
        suites.setdefault(k["phase"], {}).setdefault(k["site"], []).append(f)
    runs = doc["runs"]
    root = ET.Element("testsuites",
                      name=f"numaudit {runs['ref']['name']} vs {runs['cand']['name']}",
                      tests="0", failures="0")
    total = fails = 0
    for phase, cases in suites.items():
        suite = ET.SubElement(root, "testsuite", name=f"numaudit.{phase}", tests=str(len(cases)))
        nfail = 0
        for site, items in cases.items():
            tc = ET.SubElement(suite, "testcase", classname=f"numaudit.{phase}", name=site,
                               time="0")
            bad = [f for f in items if f["breach"]]
            if bad:
                nfail += 1
                verdicts = sorted({f["verdict"] for f in bad})
                fail = ET.SubElement(tc, "failure", type=",".join(verdicts),
                                     message=f"{len(bad)} of {len(items)} keys breach the policy; "
                                             f"first: {F.headline(bad[0])}")
                fail.text = "\n".join(F.headline(f) for f in bad[:100]) + (
                    f"\n... and {len(bad) - 100} more" if len(bad) > 100 else "")
            else:
                close = sum(1 for f in items if f["verdict"] == "close")
                out = ET.SubElement(tc, "system-out")
                out.text = f"{len(items)} keys: {len(items) - close} identical, {close} close"
                excused = sum(1 for f in items
                              if ((f.get("metrics") or {}).get("noise") or {}).get("kind")
                              == "excused")
                if excused:
                    out.text += (f" ({excused} within the reference's run-to-run noise, "
                                 "beyond the preset alone)")
        suite.set("failures", str(nfail))
        total += len(cases)
        fails += nfail
    root.set("tests", str(total))
    root.set("failures", str(fails))
    if doc.get("noise"):  # judged against the reference's noise bands (docs/noise.md)
        props = ET.Element("properties")
        counts = doc["noise"].get("counts", {})
        for name, value in [("noise.runs", ",".join(doc["noise"].get("runs", []))),
                            ("noise.slack", f"{doc['noise'].get('slack', 0):g}"),
                            *((f"noise.{k}", str(v)) for k, v in counts.items())]:
            ET.SubElement(props, "property", name=name, value=value)
        for suite in root:
            suite.insert(0, props)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") \
        + "\n"


def to_junit(report: Report) -> str:
    """The JUnit report of a comparison."""
    return render_junit(report.header_dict(), _lite_findings(report))


def _lite_findings(report: Report) -> Iterator[dict]:
    """Finding dicts; identical ones reduced to what the JUnit report reads."""
    comp = report.comparison
    for i in comp.indices():
        if comp.verdict[i] == F.IDENTICAL:
            k = comp.key(int(i))
            yield {"key": k.as_dict(), "verdict": "identical", "breach": False}
        else:
            yield report.finding(int(i)).as_dict()
