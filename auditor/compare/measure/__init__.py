"""Measuring: the two runs' logical keys aligned, measured and judged against the policy.

Owns the verdict vocabulary and `Finding` (`findings`), the columnar result (`comparison`:
`Comparison`, one entry per aligned key), the cheap verdicts decided from the columns
(`verdicts.evaluate`: missing, None, incomplete, replica divergence, non-finite, identical where
fingerprints agree), the slow path for the rest (`slow`: moments and sketches; `payloads`: exact
metrics from bytes; `per_sample`: keys re-placed after capture, from per-sample digests),
execution order and each key's predecessor (`order`), parents whose forward never ran in a stage
(`parents`) and tied parameters (`tied`). Hand-off: a `Comparison` whose verdicts are final under
the conventions it was evaluated with; `auditor.compare.evaluation` may evaluate again.
"""
