"""Benchmarks of an allocation: all-reduce bandwidth, GPU health, node-scaling studies."""
