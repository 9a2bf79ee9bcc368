"""Benchmark scripts (`python benchmarks/<name>.py`, README.md). A package so that the tests import the very
code a benchmark runs (`from benchmarks import preemption`)."""
