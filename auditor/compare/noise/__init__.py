"""Noise bands: the candidate judged against the reference's own run-to-run noise (docs/noise.md).

Owns the bands measured among a reference's reruns (`bands`, `calibrate`), their file
(`bands_file`), distances per reference piece (`pieces`), the judgement of each differing key
against its band (`judge`) and the reference's nondeterminism named (`nondeterminism`). Hand-off:
`judge.apply_bands` fills the comparison's ``noise`` before the report is built.
"""
