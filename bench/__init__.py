"""Benchmarks of hoplite_gpu (not installed with the package)."""
