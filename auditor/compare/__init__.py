"""The comparison: two stored runs in, a report model out (docs/comparison.md).

Owns the vocabulary of keys (`align`), the run columns read from the store (`columns`), digest
merging (`digests`, `merge`, `keys`, `segments`), metrics (`metrics`), policies (`policy_model`,
read from TOML by `policy`), and the engine's stages: `uneven` and `regroup` (records re-placed
before the merge: uneven batch shares, microbatches grouped otherwise), `verdicts` (cheap verdicts
from the columns), `slow` and `payloads` (metrics where fingerprints cannot decide),
`per_sample` and `sample_estimate` (keys whose pieces were placed, measured from per-sample
digests), `samples` (aligning two runs' samples),
`conventions` (loss reduction and activation-gradient scale from the evidence), `factors` (exact
factors named), `order` (execution order), `causes` (why), `breaks` (graph breaks), `tied` (tied
parameters), `ragged_hint` (undeclared ragged outputs), `localize` and `ranks` (which ranks'
pieces differ),
`comparison` (the columnar result), `result` (the `Report` model that `auditor.report` renders),
`engine` (`compare_runs`) and `live` (`auditor watch`). It reads the store and imports no
service, CLI or renderer.
"""
