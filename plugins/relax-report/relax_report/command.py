"""``relax report RUN_DIR``: the run's report, one self-contained HTML page.

Drawn from what the run left in its directory (``relax run --run-dir``, or ``relax-runs/<job>``):
the ``jsonl`` tracker's ``run.jsonl``. Exit status 2 when the directory holds no run or the page
cannot be written.
"""

from __future__ import annotations

import argparse
import sys

NAME = "report"
HELP = "Write a run's report: one self-contained HTML page of its steps, phases and GPUs."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dir", metavar="RUN_DIR", help="the run's directory (relax run --run-dir)"
    )
    parser.add_argument("-o", "--output", help="the page's file (default: RUN_DIR/report.html)")


def run(args: argparse.Namespace) -> int:
    from relax_report.report import write_report

    try:
        path = write_report(args.run_dir, args.output)
    except (OSError, ValueError) as exc:
        print(f"relax report: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0
