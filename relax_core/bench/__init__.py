"""Benchmarks run by ``relax bench NAME``.

Each module defines ``run(quick: bool) -> dict`` (the JSON the CLI prints) and may define
``format_result(result) -> str`` for a human-readable report. Every number is reported next to a
baseline measured in the same run, since shared machines are noisy.
"""
