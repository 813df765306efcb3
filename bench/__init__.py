"""Reproducible benchmarks; each module runs with `python -m bench.<name>` and prints ratios against a baseline measured in the same run."""
