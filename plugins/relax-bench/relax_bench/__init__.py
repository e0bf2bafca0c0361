"""Relax's benchmarks, run by ``relax bench NAME`` (``relax bench`` lists them).

Each module defines ``run(quick: bool) -> dict`` (the JSON the CLI prints) and
``format_result(result) -> str`` for a human-readable report; :mod:`relax_bench.plugin`
registers them as :class:`relax_core.BenchmarkSpec` records. Every number is reported next to
a baseline measured in the same run, since shared machines are noisy.
"""
