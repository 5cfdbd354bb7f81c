"""A small DeepSeek-V3-style model and synthetic data for the reference and pipeline examples."""
