"""Policy: which keys a comparison checks, by which metric, against which threshold.

Owns the policy model (`model`: rules, checks, presets, per-dtype tolerances) and reading it from
TOML files, presets and Compare requests (`load`, the one place callers import a `Policy` from;
docs/policy.md). Hand-off: a `Policy` the measurement asks per key for its check.
"""
