"""Benchmarks (GPU for absolute times; each compares ours against a baseline in one run)."""
