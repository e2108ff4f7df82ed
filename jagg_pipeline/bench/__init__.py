"""Benchmarks and diagnostics: the update benchmark and the gradient check."""
