"""Short programs that use hoplite_gpu, to read and copy (``python examples/<name>.py``); importable
so that the benchmarks (``bench/workloads``) reuse their models and the tests run them in small form."""
