"""Merging pieces: the records of each rank rebuilt into logical tensors, one key at a time.

Owns the tiling of pieces into a logical tensor and its checks (`tiling`: coverage, replicas,
Partial addends), every key of a run merged at once (`keys`), the boxes a key's pieces occupy and
the run's mesh (`ranks`), and the stages that re-place records before the merge: uneven batch
shares (`uneven`), microbatches grouped otherwise (`regroup`, with `samples` aligning two runs'
samples by content), outputs that do not hold the batch (`replicas`), and undeclared ragged
outputs (`ragged_hint`). Hand-off: `LogicalKeys` per run, for the measurement to align and judge.
"""
