"""Evaluation backends beyond this machine's GPUs: `dask` (a Dask distributed cluster)."""
