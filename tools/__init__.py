"""Benchmark and check tools run by hand on a GPU or CPU machine; not part of the workflow (see benchmarks/README.md)."""
