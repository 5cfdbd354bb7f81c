"""The comparison: two stored runs in, a report model out (docs/comparison.md).

Owns the pipeline, one subpackage a stage, each importing only the stages before it:

- `read`: a run's records as numpy columns, on the key the runs align on;
- `digests`: the digest algebra and distances, pure numpy;
- `policy`: which check applies to which key;
- `merge`: pieces re-placed and merged into logical tensors;
- `measure`: logical keys aligned, measured and judged (`Comparison`, `Finding`);
- `explain`: causes, factors, graph breaks, localization to ranks, groups;
- `conventions`: loss reduction and activation-gradient scale from the evidence;
- `noise`: the candidate against the reference's own run-to-run noise;
- `ops`: drill-down to the operation inside a module call.

At the top, the drivers: `engine.compare_runs` (the whole pipeline), `evaluation.evaluate_runs`
(measurement under the conventions, declared or inferred), `live.LiveComparison` (`auditor
watch`), and `result.Report`, the model `auditor.report` renders. It reads the store and imports
no service, CLI or renderer.
"""
