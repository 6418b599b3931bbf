"""Benchmarks (run bench/benchmark.py)."""
