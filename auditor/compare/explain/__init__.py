"""Explaining: why a key diverged, where, and what a report says once for many keys.

Owns a finding materialized from the comparison's columns (`finding`), its cause: introduced or
inherited, and by what (`causes`, with `state_cause`, `optimizer_cause` and `evidence_gaps`),
exact factors named by the runs' counts (`factors`), backward-graph breaks (`breaks`), which
ranks' pieces differ (`localize`), and breaches grouped by cause (`groups`, with `site_sets` for
many modules said compactly). Hand-off: findings, causes and groups for `auditor.compare.result`.
"""
