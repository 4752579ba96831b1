"""Benchmarks behind `kvloop bench`."""
