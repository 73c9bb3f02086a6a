"""Benchmarks of evoattn: maintained tools, run as `python -m benchmarks.NAME` from the repository root."""
