"""Benchmarks: scripts whose figures go in BENCHMARKS.md (run each as `python benchmarks/NAME.py`)."""
