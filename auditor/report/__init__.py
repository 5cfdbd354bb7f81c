"""Renderers of a comparison's report model (`auditor.compare.result.Report`).

Owns one module per format: `text` (the human report, rich, terminal width), `json_report`
(docs/report-schema.md, streamed), `junit` (for CI systems), `html` (one self-contained page to
explore in a browser, docs/report-html.md; its inline CSS and script in `html_assets`).
Renderers read the model and the comparison's vocabulary (`auditor.compare`); they never run a
comparison, and nothing in `auditor.compare` imports them.
"""
