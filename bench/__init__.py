"""Benchmarks: ``python -m bench [--quick]`` runs every registered benchmark (bench/__main__.py)."""
