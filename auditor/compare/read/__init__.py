"""Reading runs: a stored run's records as numpy columns, on the key both runs align on.

Owns the key vocabulary and execution order's pure rules (`align`: sites normalized, renames,
phases and roles), the store queries (`reads`), a run's columns and the catalog of its layouts,
sites, dtypes and shapes (`columns`), the key range a comparison keeps (`selection`), where each
key was captured in execution order (`positions`), per-sample digests as stored (`sample_digests`)
and two small helpers every later stage uses: segments of sorted arrays (`segments`) and sets of
integers said compactly (`ranges`). Hand-off: `RunColumns` and `Catalog`, read from an open
`auditor.store.Reader`; nothing here merges, measures or judges.
"""
