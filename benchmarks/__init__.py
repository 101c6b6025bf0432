"""Benchmarks: speeds measured side by side in one run (make bench-*), never tests. Run from the
repository root: python -m benchmarks.bench NAME."""
