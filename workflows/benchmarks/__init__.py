"""Benchmark scripts: ratios against a reference measured in the same run, never timed tests."""
