"""The digest algebra on the host: pure numpy over merged pieces, no store, no runs.

Owns merging pieces' digests (`algebra`: disjoint tiles, Partial addends, fingerprints moved by
an exact factor), distances from sketches and moments with their error bars (`metrics`), ULP
distances (`ulp`), distances from per-sample digests (`sample_estimate`) and whether a ratio is a
count (`integer_ratio`). Hand-off: functions of arrays, called by the merge, the measurement and
the explanations; it imports nothing else of the comparison (docs/digests.md).
"""
