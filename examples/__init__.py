"""Runnable examples of hoplite_gpu (importable so that the tests can run them in small form)."""
