"""Worked examples shared by the notebooks, the tests and the benchmarks (they need the `test` extra's packages)."""
