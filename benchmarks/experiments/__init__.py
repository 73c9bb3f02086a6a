"""One-off investigations; their figures are on BENCHMARKS.md, with the commit that made them."""
