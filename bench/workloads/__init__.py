"""The workloads the benchmarks run: the examples' programs with the machinery a measurement needs
(baselines in other systems, timings, records, fault injection), imported by ``bench/*.py`` and the
tests. Each one reuses its example's model or environment, so both run the same computation."""
