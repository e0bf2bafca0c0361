"""``relax report RUN_DIR``: one self-contained HTML page of what a run did.

- :mod:`~relax_report.data`: the page's data, read from the run directory's ``run.jsonl``
  (the ``jsonl`` tracker's records): per-step series, phase times, each shared slice's GPU
  residency lanes, the samples;
- :mod:`~relax_report.page`: the page, its charts inline SVG (:mod:`~relax_report.svg`), so
  nothing is fetched when it is viewed.

See ``docs/run.md`` (the report).
"""

import os

from relax_report.data import report_data
from relax_report.page import CHARTS, render_page

__all__ = ["CHARTS", "REPORT_FILE", "render_page", "report_data", "write_report"]

#: The page's file name in the run directory.
REPORT_FILE = "report.html"


def write_report(run_dir: str, out: str | None = None) -> str:
    """Write the report of the run in ``run_dir`` to ``out`` (default ``RUN_DIR/report.html``,
    atomically); its path.

    :raises ValueError: the run directory has no ``run.jsonl``, or a line of it is not JSON.
    :raises OSError: the page cannot be written.
    """
    path = out or os.path.join(run_dir, REPORT_FILE)
    page = render_page(report_data(run_dir))
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(page)
    os.replace(tmp, path)
    return path
