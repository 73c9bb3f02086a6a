"""evoattn's benchmarks: maintained tools, each run as `python -m benchmarks.NAME` from the
repository root; one-off investigations in experiments/."""
