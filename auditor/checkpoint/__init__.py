"""Checkpoint audit (docs/checkpoints.md).

Owns reading saved checkpoints in bounded memory and digesting them as a live agent would
(phase ``state``), for the comparison engine: `sources` is the format-neutral model (entries,
chunks, bounded reads), `dcp` and `safetensors` the readers, `formats` picks one, `mapping`
is the name map of a conversion, `digest` reads a checkpoint into a store.
"""
